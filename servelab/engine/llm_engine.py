"""The engine loop: requests in, scheduler steps through an executor, text deltas out.

Single-threaded by design: the server calls `step()` from one dedicated thread and hands it
requests and aborts through a queue. Importing this module does not import torch; the model is
loaded inside `LLMEngine.from_args`, so the CLI and the server start fast until a model is needed.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelab.core.config import SchedulerConfig
from servelab.core.plan import RequestOutput, StepPlan, TokenLogprobs
from servelab.core.sequence import FinishReason, PoolingParams, SamplingParams, Sequence
from servelab.engine.args import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    EngineArgs,
    native_bf16_on_cpu,
)
from servelab.engine.client import EngineFront, prepare_logits_processors
from servelab.engine.detokenizer import RequestTextStream
from servelab.engine.outputs import EngineOutput, EngineStats
from servelab.engine.speculative import Proposers
from servelab.errors import InvalidArgument, RequestTooLong

if TYPE_CHECKING:
    from servelab.core.plan import Executor
    from servelab.core.scheduler import Scheduler
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.tokenizer import Tokenizer
    from servelab.spec.model import ModelSpec

logger = logging.getLogger("servelab.engine")


def _token_id(t: Any) -> int:
    """A prompt's token id as an int: any integer (numpy's too), never a bool or a float."""
    try:
        if not isinstance(t, bool):
            return operator.index(t)
    except TypeError:
        pass
    raise InvalidArgument(f"prompt token ids must be integers, got {t!r}", param="prompt")


@dataclass(slots=True)
class _RequestState:
    """Per-request text state: the detokenizer and stop-string matcher, and the text so far."""

    seq: Sequence
    stream: RequestTextStream
    output_text: str = ""
    prompt_logprobs_sent: int = 0  # entries of seq.prompt_logprobs already in an output


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        tokenizer: Tokenizer,
        scheduler_config: SchedulerConfig,
        model_name: str,
        logits_processors: LogitsProcessors | None = None,
    ):
        from servelab.core.scheduler import Scheduler

        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler: Scheduler = Scheduler(scheduler_config)
        self.scheduler_config = self.scheduler.config  # resolved: the pool and context are sized
        self.model_name = model_name
        self.max_model_len = self.scheduler_config.max_model_len
        self.vocab_size: int = getattr(executor, "vocab_size", None) or tokenizer.vocab_size
        # The model's description (its shape, for the engine and the cost model), set by from_args;
        # None for an engine over a simulated or fake executor.
        self.model_spec: ModelSpec | None = None
        # Sampling fields the model's generation_config.json sets (generation_config.py), set by from_args.
        self.sampling_defaults: dict[str, float] = {}
        # logit_bias, allowed_token_ids, bad_words, structured outputs: the sampler applies them;
        # None where the executor samples no real logits (a simulated or fake one).
        self.logits_processors = logits_processors
        self._requests: dict[str, _RequestState] = {}
        self._aborted: list[EngineOutput] = []  # outputs for the next step(): aborts, transferred first tokens
        self.last_step_num_tokens = 0  # query tokens the last step ran (the metrics' iteration tokens)
        self.last_plan: StepPlan | None = None  # the last step's plan and its executor's wall time
        self.last_execute_s = 0.0
        # Speculative decoding: drafts set before each schedule(); from_args sets the configured method.
        self.proposers = Proposers(None, self.vocab_size)

    @property
    def front(self) -> EngineFront:
        """What the HTTP layer reads of this engine (its sampling_defaults dict is shared)."""
        kv = getattr(self.executor, "kv_cache", None)  # absent on a simulated executor
        return EngineFront(self.model_name, self.tokenizer, self.scheduler_config, self.vocab_size,
                           "none" if kv is None else str(kv.dtype).removeprefix("torch."), self.sampling_defaults,
                           self.logits_processors)  # fmt: skip

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        import torch

        from servelab.engine.bundled import bundled_model_path
        from servelab.engine.generation_config import load_sampling_defaults
        from servelab.engine.logits_processors import LogitsProcessors
        from servelab.engine.model_executor import ModelExecutor
        from servelab.engine.sampler import Sampler
        from servelab.engine.tokenizer import Tokenizer
        from servelab.runtime.kv_cache import PagedKVCache
        from servelab.runtime.loader import ModelOptions, load_model, servable_context
        from servelab.runtime.weights import CPU_AUTO_DTYPE_REASON, CPU_BF16_DTYPE_REASON, resolve_dtype

        path = args.model or str(bundled_model_path())
        if (mapped := native_bf16_on_cpu(args)) is not args:
            logger.info(
                "dtype bfloat16 on a CPU -> bf16 linears on servelab's kernels (--quantization bf16), the rest "
                "in float32, KV cache %s: %s",
                mapped.kv_cache_dtype,
                CPU_BF16_DTYPE_REASON,
            )
            args = mapped
        dtype = resolve_dtype("float32" if args.quantization or args.deterministic else args.dtype, args.device)
        if args.dtype is None and args.device == "cpu" and not (args.quantization or args.deterministic):
            logger.info("dtype auto -> float32: %s", CPU_AUTO_DTYPE_REASON)
        if args.quantization is not None:
            from servelab.runtime.quantization import check_supported

            check_supported(args.quantization)  # before the minutes of loading
        tp = args.tensor_parallel_size
        loaded = load_model(path, dtype=dtype, device=args.device, tp_rank=0, tp_size=tp)
        options = ModelOptions(args.quantization, args.deterministic)
        options.apply(loaded.model)
        tokenizer = Tokenizer.from_hf_dir(path) if Path(path).is_dir() else Tokenizer.from_gguf(path)
        if args.deterministic:
            logger.info(
                "deterministic mode: float32 compute%s, every batch size on one kernel per linear, decode "
                "attention in the prefill kernel's order: greedy output is bit-identical whatever the batch",
                "" if args.dtype else " (chosen for it: bf16 is not batch-invariant)",
            )
        spec = loaded.spec
        model: Any = loaded.model  # under tensor parallelism, rank 0's shard until the workers start
        knobs = args.scheduler
        model_context = servable_context(spec)
        max_model_len = knobs.max_model_len or min(model_context, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > model_context:
            raise InvalidArgument(
                f"max_model_len={max_model_len} exceeds the model's context of {model_context} tokens",
                param="max_model_len",
            )
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        block_bytes = PagedKVCache.bytes_per_block(model.config, knobs.block_size, kv_dtype)  # this rank's heads
        if knobs.num_blocks is not None:
            num_blocks = knobs.num_blocks
        else:
            num_blocks = (args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES) // block_bytes
            if num_blocks < 1:
                raise InvalidArgument(
                    f"kv_cache_memory_bytes={args.kv_cache_memory_bytes} holds no KV block "
                    f"(one block of {knobs.block_size} tokens needs {block_bytes} bytes)",
                    param="kv_cache_memory_bytes",
                )
        capacity_tokens = num_blocks * knobs.block_size
        if capacity_tokens < max_model_len:
            if knobs.max_model_len is not None:
                raise InvalidArgument(
                    f"max_model_len={max_model_len} does not fit the KV cache of {num_blocks} blocks x "
                    f"{knobs.block_size} tokens = {capacity_tokens} tokens; raise num_blocks or kv_cache_memory_bytes",
                    param="max_model_len",
                )
            max_model_len = capacity_tokens  # a small cache asked for explicitly bounds the context

        kv_cache = PagedKVCache(
            model.config,
            num_blocks,
            knobs.block_size,
            dtype=kv_dtype,
            device=args.device,
            prefault=args.kv_cache_prefault,
        )
        if tp > 1:  # last, so a configuration error leaves no process behind
            from servelab.runtime.parallel.group import start_tensor_parallel  # torch.distributed
            from servelab.runtime.parallel.worker import worker_main

            model = start_tensor_parallel(
                loaded.model, spec, tp, worker_main, (path, dtype, args.device, options, os.getpid())
            )
            model.group.broadcast((num_blocks, knobs.block_size, kv_dtype, args.kv_cache_prefault))  # their pools
        processors = LogitsProcessors(tokenizer, model.vocab_size)
        executor = ModelExecutor(model, kv_cache, sampler=Sampler(args.seed, processors))
        scheduler_config = knobs.resolve(num_blocks=num_blocks, max_model_len=max_model_len)
        name = args.served_model_name or loaded.name
        engine = cls(executor, tokenizer, scheduler_config, name, processors)
        engine.model_spec = spec
        engine.sampling_defaults = load_sampling_defaults(path)
        # Not yet on CUDA or across tensor-parallel ranks: there a prediction changes nothing.
        cpu_alone = args.device == "cpu" and tp == 1
        spec_config, draft = args.speculative_config, None
        if spec_config is not None and spec_config.method == "draft_model":
            from servelab.engine.speculative import load_draft_proposer

            draft = load_draft_proposer(spec_config, dtype=dtype, device=args.device, options=options,
                                        num_blocks=num_blocks, block_size=knobs.block_size,
                                        vocab_size=model.vocab_size)  # fmt: skip
        engine.proposers = Proposers(spec_config, engine.vocab_size, predictions=cpu_alone, draft=draft)
        return engine

    def close(self) -> None:
        """Stops what the engine started besides itself (tensor-parallel workers); idempotent."""
        close = getattr(getattr(self.executor, "model", None), "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_s: float | None = None,
        pooling: PoolingParams | None = None,
    ) -> Sequence:
        """Tokenizes a str prompt (no chat template: callers render chats with
        tokenizer.apply_chat_template first), checks limits, queues. Raises RequestTooLong /
        QueueFull / InvalidArgument with clear messages. With `pooling`, the request only
        prefills its prompt and ends with the pooled vector in `seq.pooled` (params' sampling
        fields are then unused)."""
        if request_id in self._requests:
            raise InvalidArgument(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", param="sampling_params"
            )
        params.validate(lists=params.prepared_edits is None)  # prepared: its lists were checked then
        self.prepare_logits_processors(params)
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # what JSON's \ud800 escapes make; no tokenizer takes it
                raise InvalidArgument(
                    f"prompt: contains a lone UTF-16 surrogate ({prompt[exc.start]!r} at character {exc.start}), "
                    "which is not Unicode text",
                    param="prompt",
                ) from None
            token_ids = self.tokenizer.encode_prompt(prompt)
        else:
            token_ids = [_token_id(t) for t in prompt]
            bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(
                    f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})", param="stop_token_ids"
            )
        if not token_ids:
            raise InvalidArgument("prompt is empty: it must hold at least one token", param="prompt")
        if pooling is not None and not isinstance(pooling, PoolingParams):
            raise InvalidArgument(f"pooling must be a PoolingParams, got {type(pooling).__name__}", param="pooling")
        if pooling is not None and len(token_ids) > self.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but the input has "
                f"{len(token_ids)} tokens; shorten it",
                param="input",
            )
        if pooling is None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks for "
                f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, {params.max_tokens} in the "
                f"completion); shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_s=time.perf_counter() if arrival_s is None else arrival_s,
            priority=priority,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            pooling=pooling,
        )
        self.scheduler.add(seq, seq.arrival_s)  # raises QueueFull / RequestTooLong for the KV pool
        self._requests[request_id] = self._new_state(seq)
        if params.prediction:
            self.proposers.add_prediction(request_id, params.prediction)
        return seq

    def prepare_logits_processors(self, params: SamplingParams, *siblings: SamplingParams, grammar: Any = None) -> None:
        """Checks token ids against the vocabulary, tokenizes bad words and compiles the grammar
        (cached; `grammar` when the caller compiled it), attached to the params (`siblings`, the
        request's other choices, share it). The server calls it on a worker thread before
        admission, so that add_request, on the step loop's thread, finds the work done."""
        prepare_logits_processors(self.logits_processors, params, *siblings, grammar=grammar)

    def _new_state(self, seq: Sequence) -> _RequestState:
        params = seq.params
        stream = RequestTextStream(self.tokenizer, seq.prompt_token_ids, params.stop, params.skip_special_tokens,
                                   params.include_stop_str_in_output)  # fmt: skip
        return _RequestState(seq=seq, stream=stream)

    def _forget(self, request_id: str) -> _RequestState | None:
        """Drop an ending request's engine-side state: its text stream and its logits-processor rows."""
        if self.logits_processors is not None:
            self.logits_processors.release(request_id)
        self.proposers.release(request_id)
        return self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its stream gets one last output with finish_reason ABORT on the next step."""
        state = self._forget(request_id)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        self._aborted.append(_output(state, [], "", True, state.seq.finish_reason or FinishReason.ABORT))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._aborted) or self.scheduler.num_running + self.scheduler.num_waiting > 0

    # ------------------------------------------------------------------ disaggregated prefill/decode

    def detach_prefilled(self, request_id: str) -> list[int]:
        """Prefill side: a running request whose first token was just sampled leaves this engine
        without an output; its KV blocks stay held and are returned, for release_held() once they
        have been sent (cluster/disagg_worker.py)."""
        state = self._forget(request_id)
        if state is None:
            raise InvalidArgument(f"cannot detach request {request_id!r}: no such request", param="request_id")
        held = self.scheduler.block_manager.hold(state.seq)
        self.scheduler.finish(
            request_id, FinishReason.STOP, time.perf_counter()
        )  # here it is done: the rest runs elsewhere
        return held

    def sequence(self, request_id: str) -> Sequence | None:
        """A request's live sequence, for code in the engine's own process (a prefill worker hands
        a prefilled one on); None once it ended. Outputs never carry it."""
        state = self._requests.get(request_id)
        return None if state is None else state.seq

    def release_held(self, held: list[int]) -> None:
        self.scheduler.block_manager.release(held)

    def reserve_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        arrival_s: float | None = None,
    ) -> Sequence | None:
        """Decode side: blocks for a request prefilled elsewhere, before its KV arrives; None
        while this pool is short (the caller retries). The returned sequence's num_cached_tokens
        prompt tokens were already cached here and need not be sent. `arrival_s`: when the request
        arrived, on this clock (None: now)."""
        if request_id in self._requests:
            raise InvalidArgument(f"request id {request_id!r} is already in use", param="request_id")
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_s=arrival_s or 0.0,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
        )
        seq.token_ids.append(first_token_id)
        return seq if self.scheduler.reserve_prefilled(seq, time.perf_counter()) else None

    def start_prefilled(self, seq: Sequence, first_logprobs: TokenLogprobs | None = None) -> None:
        """Decode side: the reserved sequence's KV is written; it joins the running set and its
        first token is streamed by the next step()."""
        self.prepare_logits_processors(seq.params)
        now = time.perf_counter()
        self.scheduler.start_prefilled(seq, now)
        seq.token_times_s.append(now)
        state = self._requests[seq.request_id] = self._new_state(seq)
        delta = state.stream.add([seq.last_token_id])
        state.output_text = delta.text
        logprobs = None if first_logprobs is None else [first_logprobs]
        self._aborted.append(_output(state, [seq.last_token_id], delta.text, False, None, logprobs))

    def cancel_prefilled(self, seq: Sequence) -> None:
        """Decode side: a reservation whose KV did not arrive gives its blocks back."""
        self.scheduler.cancel_reserved(seq)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[EngineOutput]:
        outputs, self._aborted = self._aborted, []
        self.proposers.propose(self.scheduler.running)
        now = time.perf_counter()
        plan = self.scheduler.schedule(now)
        self.last_step_num_tokens = plan.num_batched_tokens
        self.last_plan = plan
        if plan.is_empty:
            return outputs
        t0 = time.perf_counter()
        result = self.executor.execute(plan)
        self.last_execute_s = time.perf_counter() - t0
        for request_output in self.scheduler.update(plan, result, time.perf_counter()):
            try:
                out = self._process(request_output)
            except Exception as exc:  # detokenizing or stop-string matching: only this request ends
                out = self._fail(request_output.request_id, exc)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process(self, ro: RequestOutput) -> EngineOutput | None:
        state = self._requests.get(ro.request_id)
        if state is None:  # aborted while its step ran
            return None
        seq = state.seq
        finished, reason = ro.finished, ro.finish_reason
        new_text_ids = ro.new_token_ids
        if reason is FinishReason.STOP and not seq.params.include_stop_str_in_output:
            # As vLLM: the EOS or stop token that ended the request adds no text (skip_special_tokens
            # false would show an EOS; a stop token id may be an ordinary word).
            new_text_ids = new_text_ids[:-1]
        delta = state.stream.add(new_text_ids) if new_text_ids else None
        text = delta.text if delta is not None else ""
        stop = delta.stop if delta is not None else None
        if stop is None and finished:
            tail = state.stream.flush()  # held-back text was not a stop string after all (or is one now)
            text += tail.text
            stop = tail.stop
        if stop is not None:
            if not finished:
                self.scheduler.finish(seq.request_id, FinishReason.STOP, time.perf_counter(), stop)
            seq.finish_reason = reason = FinishReason.STOP
            seq.stop_reason = stop
            finished = True
        state.output_text += text
        if finished:
            self._forget(ro.request_id)
        return _output(state, ro.new_token_ids, text, finished, reason, ro.logprobs)

    def _fail(self, request_id: str, exc: Exception) -> EngineOutput | None:
        """End one request with finish reason "error" after its output could not be processed."""
        state = self._forget(request_id)
        if state is None:
            return None
        logger.error(
            "request %s: processing its output raised %s: %s; ending it with an error",
            request_id, type(exc).__name__, exc, exc_info=exc,
        )  # fmt: skip
        seq = state.seq
        if not seq.is_finished:
            self.scheduler.finish(request_id, FinishReason.ERROR, time.perf_counter())
        seq.finish_reason = FinishReason.ERROR  # also when it had just finished: its text is incomplete
        return _output(state, [], "", True, FinishReason.ERROR)

    def output_text(self, request_id: str) -> str | None:
        state = self._requests.get(request_id)
        return None if state is None else state.output_text

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        spec = self.scheduler.spec_counters
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=float(s.kv_usage),
            num_blocks_total=self.scheduler_config.num_blocks,
            num_blocks_free=int(s.num_free_blocks),
            num_preemptions=int(s.num_preemptions),
            prefix_cache_hits=int(s.prefix_cache_hits),
            prefix_cache_queries=int(s.prefix_cache_queries),
            num_waiting_deferred=self.scheduler.num_reserved,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )


def _output(state: _RequestState, new_token_ids: list[int], text: str, finished: bool,
            reason: FinishReason | None, logprobs: list[TokenLogprobs] | None = None) -> EngineOutput:  # fmt: skip
    """The plain output of a request's sequence as it stands, its times after its arrival."""
    seq = state.seq
    arrival = seq.arrival_s
    times = seq.token_times_s
    k = len(new_token_ids)
    prompt_logprobs = seq.prompt_logprobs[state.prompt_logprobs_sent :]
    state.prompt_logprobs_sent = len(seq.prompt_logprobs)

    def after(t: float | None) -> float | None:
        return None if t is None else t - arrival

    return EngineOutput(
        request_id=seq.request_id, new_token_ids=list(new_token_ids), text_delta=text, finished=finished,
        finish_reason=reason, logprobs=logprobs, num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
        num_preemptions=seq.num_preemptions, max_tokens=seq.params.max_tokens, prompt_only=seq.params.prompt_only,
        prompt_logprobs=list(prompt_logprobs), token_offsets_s=[t - arrival for t in times[-k:]] if k else [],
        prev_token_offset_s=after(times[-k - 1]) if len(times) > k else None,
        first_token_offset_s=after(seq.first_token_s), first_scheduled_offset_s=after(seq.first_scheduled_s),
        finished_offset_s=after(seq.finished_s), stop_reason=seq.stop_reason, error=seq.error, pooled=seq.pooled,
        **_prediction_usage(seq),
    )  # fmt: skip


def _prediction_usage(seq: Sequence) -> dict[str, int]:
    """OpenAI's accepted/rejected_prediction_tokens for a request with a prediction: the drafts
    verification kept, and the prediction's other tokens."""
    prediction = seq.params.prediction
    if prediction is None:
        return {}
    accepted = seq.num_accepted_draft_tokens
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": max(len(prediction) - accepted, 0)}
