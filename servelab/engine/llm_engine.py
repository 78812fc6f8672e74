"""The engine: an input processor, an engine core and an output processor, driven one step at a time.

`LLMEngine` composes them as vLLM v1 does: `InputProcessor` (engine/input_processor.py) checks and
tokenizes a request into an `EngineCoreRequest`; `EngineCore` (engine/core.py, the scheduler and
the executor) runs it and returns plain `EngineOutput`s; `OutputProcessor`
(engine/output_processor.py) adds their text and applies stop strings. The in-process server
(server/async_engine.py), a cluster worker (cluster/worker_loop.py) and the offline `LLM` all
drive it through `add_request`, `abort` and `step` (client.SyncEngine).

Single-threaded by design: the server calls `step()` from one dedicated thread and hands it
requests and aborts through a queue. Importing this module does not import torch; the model is
loaded inside `LLMEngine.from_args`, so the CLI and the server start fast until a model is needed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelab.core.config import SchedulerConfig
from servelab.core.kv_groups import max_context_tokens
from servelab.core.sequence import FinishReason, PoolingParams, SamplingParams, Sequence
from servelab.engine.args import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    EngineArgs,
    native_bf16_on_cpu,
)
from servelab.engine.client import EngineFront
from servelab.engine.core import EngineCore, EngineCoreRequest
from servelab.engine.input_processor import InputProcessor
from servelab.engine.output_processor import OutputProcessor, failed_output
from servelab.engine.speculative import Proposers
from servelab.engine.outputs import EngineOutput, EngineStats
from servelab.errors import InvalidArgument
from servelab.spec.kv_groups import KVGroups

if TYPE_CHECKING:
    from servelab.core.config import ResolvedSchedulerConfig
    from servelab.core.plan import Executor, StepPlan, TokenLogprobs
    from servelab.core.scheduler import Scheduler
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.tokenizer import Tokenizer
    from servelab.spec.model import ModelSpec

__all__ = ["EngineArgs", "LLMEngine"]

logger = logging.getLogger("servelab.engine")


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        tokenizer: Tokenizer,
        scheduler_config: SchedulerConfig,
        model_name: str,
        logits_processors: LogitsProcessors | None = None,
    ):
        self.core = EngineCore(executor, scheduler_config, logits_processors)
        self.tokenizer = tokenizer
        self.model_name = model_name
        vocab_size: int = getattr(executor, "vocab_size", None) or tokenizer.vocab_size
        self.input_processor = InputProcessor(tokenizer, vocab_size, self.core.config.max_model_len, logits_processors)
        # requests with a `prediction` speculate; from_args adds the configured method (--speculative-config)
        self.core.proposers = Proposers(None, vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        # The model's description (its shape, for the engine and the cost model), set by from_args;
        # None for an engine over a simulated or fake executor.
        self.model_spec: ModelSpec | None = None
        # Sampling fields the model's generation_config.json sets (generation_config.py), set by from_args.
        self.sampling_defaults: dict[str, float] = {}
        self._pending: list[EngineOutput] = []  # outputs for the next step(): aborts, transferred first tokens

    # What callers read of the parts, by their old names.
    @property
    def executor(self) -> Executor:
        return self.core.executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        self.core.executor = executor

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def scheduler_config(self) -> ResolvedSchedulerConfig:
        return self.core.config

    @property
    def max_model_len(self) -> int:
        return self.core.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    @property
    def logits_processors(self) -> LogitsProcessors | None:
        """logit_bias, allowed_token_ids, bad_words, structured outputs: the sampler applies them;
        None where the executor samples no real logits (a simulated or fake one)."""
        return self.core.logits_processors

    @logits_processors.setter
    def logits_processors(self, processors: LogitsProcessors | None) -> None:
        self.core.logits_processors = self.input_processor.logits_processors = processors

    @property
    def last_step_num_tokens(self) -> int:
        return self.core.last_step_num_tokens

    @property
    def last_plan(self) -> StepPlan | None:
        return self.core.last_plan

    @property
    def last_execute_s(self) -> float:
        return self.core.last_execute_s

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
        from servelab.runtime.block_quant import Q8_MIN_ROWS, linear_paths, q8_linears
        from servelab.runtime.loader import ModelOptions, load_model, servable_context
        from servelab.runtime.weights import (
            CPU_AUTO_DTYPE_REASON,
            CPU_AUTO_KV_CACHE_REASON,
            CPU_BF16_DTYPE_REASON,
            resolve_dtype,
        )

        path = args.model or str(bundled_model_path())
        if (mapped := native_bf16_on_cpu(args)) is not args:
            logger.info(
                "dtype bfloat16 on a CPU -> bf16 linears on servelab's kernels (--quantization bf16), the rest "
                "in float32, KV cache %s: %s",
                mapped.kv_cache_dtype,
                CPU_BF16_DTYPE_REASON,
            )
            args = mapped
        fp32 = args.quantization or args.deterministic or args.exact
        dtype = resolve_dtype("float32" if fp32 else args.dtype, args.device)
        if args.dtype is None and args.device == "cpu" and not fp32:
            logger.info("dtype auto -> float32: %s", CPU_AUTO_DTYPE_REASON)
        if args.quantization is not None:
            from servelab.runtime.quantization import check_supported

            check_supported(args.quantization)  # before the minutes of loading
        tp = args.tensor_parallel_size
        loaded = load_model(path, dtype=dtype, device=args.device, tp_rank=0, tp_size=tp)
        # an explicit --dtype float32, --exact and --deterministic keep exact fp32 linears everywhere
        q8 = args.dtype is None and not (args.exact or args.deterministic or args.quantization)
        options = ModelOptions(args.quantization, args.deterministic, Q8_MIN_ROWS if q8 else None)
        options.apply(loaded.model)
        linears = [*(w for layer in loaded.model.layers for w in layer.linears()), loaded.model.lm_head]
        if (paths := linear_paths(linears, options.q8_min_rows)) is not None:
            logger.info("%s", paths)
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
        if args.kv_cache_dtype != "auto":
            kv_dtype = getattr(torch, args.kv_cache_dtype)
        elif q8_linears(linears):
            # the int8 path's cache (a CPU's default over GGUF blocks): within the accuracy contract,
            # half the bytes decode reads
            kv_dtype = torch.float16
            logger.info("KV cache auto -> float16: %s", CPU_AUTO_KV_CACHE_REASON)
        else:
            kv_dtype = dtype
        # a page: one KV group's layers (all of them for a plain model), this rank's heads
        block_bytes = PagedKVCache.bytes_per_block(model.config, knobs.block_size, kv_dtype)
        groups = KVGroups.of_model(model.config)
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
        # a windowed layer holds only its window: the longest sequence grows with the pool's share
        # of full-attention layers (None: every layer windowed, no length too long)
        windows = groups.windows if args.free_window_blocks else (None,) * groups.num_groups
        capacity_tokens = max_context_tokens(windows, num_blocks, knobs.block_size, knobs.chunk_tokens)
        if capacity_tokens is not None and capacity_tokens < max_model_len:
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
        scheduler_config = knobs.resolve(num_blocks=num_blocks, max_model_len=max_model_len, kv_group_windows=windows)
        name = args.served_model_name or loaded.name
        engine = cls(executor, tokenizer, scheduler_config, name, processors)
        engine.model_spec = spec
        engine.sampling_defaults = load_sampling_defaults(path)
        # Not yet on CUDA or across tensor-parallel ranks: there a prediction changes nothing.
        cpu_alone = args.device == "cpu" and tp == 1
        spec_config, draft = args.speculative_config, None
        if spec_config is not None and spec_config.method == "draft_model":
            from servelab.engine.speculative import load_draft_proposer

            draft = load_draft_proposer(spec_config, dtype=dtype, kv_dtype=kv_dtype, device=args.device,
                                        options=options, num_blocks=num_blocks, block_size=knobs.block_size,
                                        vocab_size=model.vocab_size)  # fmt: skip
        engine.core.proposers = Proposers(spec_config, engine.vocab_size, predictions=cpu_alone, draft=draft)
        return engine

    def close(self) -> None:
        """Stops what the engine started besides itself (tensor-parallel workers); idempotent."""
        self.core.close()

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
        fields are then unused). The returned sequence is for code in this process (tests, the
        CLI); outputs never carry it."""
        if request_id in self.core:
            raise InvalidArgument(f"request id {request_id!r} is already in use", param="request_id")
        request = self.input_processor.process(request_id, prompt, params, priority=priority, arrival_s=arrival_s,
                                               pooling=pooling)  # fmt: skip
        return self._queue(request)

    def add_core_request(self, request: EngineCoreRequest) -> Sequence:
        """A request another process's input processor made (a cluster's front end): its logits
        processors are prepared here, where they run, and it is queued as add_request queues."""
        if request.request_id in self.core:
            raise InvalidArgument(f"request id {request.request_id!r} is already in use", param="request_id")
        self.input_processor.prepare_logits_processors(request.params)
        return self._queue(request)

    def _queue(self, request: EngineCoreRequest) -> Sequence:
        seq = self.core.add_request(request)  # raises QueueFull / RequestTooLong for the KV pool
        self.output_processor.add_request(request.request_id, request.prompt_token_ids, request.params)
        return seq

    def prepare_logits_processors(self, params: SamplingParams, *siblings: SamplingParams, grammar: Any = None) -> None:
        """InputProcessor.prepare_logits_processors: the server calls it on a worker thread before
        admission, so that add_request, on the step loop's thread, finds the work done."""
        self.input_processor.prepare_logits_processors(params, *siblings, grammar=grammar)

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its stream gets one last output with finish_reason ABORT on the next step."""
        self.output_processor.forget(request_id)
        out = self.core.abort(request_id)
        if out is None:
            return False
        self._pending.append(out)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.core.has_unfinished()

    def output_text(self, request_id: str) -> str | None:
        return self.output_processor.output_text(request_id)

    def sequence(self, request_id: str) -> Sequence | None:
        """A request's live sequence, for code in the engine's own process (a prefill worker hands
        a prefilled one on); None once it ended. Outputs never carry it."""
        return self.core.sequence(request_id)

    # ------------------------------------------------------------------ disaggregated prefill/decode

    def detach_prefilled(self, request_id: str) -> list[int]:
        """Prefill side: a running request whose first token was just sampled leaves this engine
        without an output; its KV blocks stay held and are returned, for release_held() once they
        have been sent (cluster/disagg_worker.py)."""
        self.output_processor.forget(request_id)
        return self.core.detach_prefilled(request_id)

    def release_held(self, held: list[int]) -> None:
        self.core.release_held(held)

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
        request = self.input_processor.prefilled(request_id, prompt_token_ids, params, arrival_s)
        return self.core.reserve_prefilled(request, first_token_id)

    def start_prefilled(self, seq: Sequence, first_logprobs: TokenLogprobs | None = None) -> None:
        """Decode side: the reserved sequence's KV is written; it joins the running set and its
        first token is streamed by the next step()."""
        self.prepare_logits_processors(seq.params)
        out = self.core.start_prefilled(seq, first_logprobs)
        self.output_processor.add_request(seq.request_id, seq.prompt_token_ids, seq.params)
        processed = self._process(out)
        if processed is not None:
            self._pending.append(processed)

    def cancel_prefilled(self, seq: Sequence) -> None:
        """Decode side: a reservation whose KV did not arrive gives its blocks back."""
        self.core.cancel_prefilled(seq)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        for out in self.core.step():
            processed = self._process(out)
            if processed is not None:
                outputs.append(processed)
        return outputs

    def _process(self, out: EngineOutput) -> EngineOutput | None:
        """The output with its text; a stop string found in it ends the request in the core too.
        Detokenizing or stop-string matching that raises ends only this request, with an error."""
        ended_here = not out.finished
        try:
            processed = self.output_processor.process(out)
        except Exception as exc:
            return self._fail(out, exc)
        if processed is not None and processed.finished and ended_here:
            processed.finished_offset_s = self.core.finish(out.request_id, FinishReason.STOP, processed.stop_reason)
        return processed

    def _fail(self, out: EngineOutput, exc: Exception) -> EngineOutput:
        logger.error(
            "request %s: processing its output raised %s: %s; ending it with an error",
            out.request_id, type(exc).__name__, exc, exc_info=exc,
        )  # fmt: skip
        self.output_processor.forget(out.request_id)
        return failed_output(out, self.core.finish(out.request_id, FinishReason.ERROR))

    def stats(self) -> EngineStats:
        return EngineStats(self.core.stats(), self.scheduler_config.num_blocks, self.scheduler.num_reserved)
