"""The engine's three parts on their own: the input processor makes plain core requests, the core
returns plain outputs without text, and the output processor adds the text and stop strings."""

from __future__ import annotations

import pickle

import pytest

from servelab.core.config import SchedulerConfig
from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.core import EngineCore, EngineCoreRequest
from servelab.engine.input_processor import InputProcessor
from servelab.engine.llm_engine import LLMEngine
from servelab.engine.output_processor import OutputProcessor
from servelab.engine.tokenizer import Tokenizer
from servelab.errors import InvalidArgument, RequestTooLong
from tests.fake_executor import FakeExecutor

CONFIG = SchedulerConfig(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_hf_dir(tiny_llama)


def _executor(tokenizer: Tokenizer) -> FakeExecutor:
    # Tokens in [100, vocab), ordinary pieces of the tiny model's vocabulary, never its EOS, by
    # position alone: every request with the same prompt gets the same tokens.
    span = tokenizer.vocab_size - 100
    return FakeExecutor(vocab_size=tokenizer.vocab_size, token_fn=lambda seq, pos: 100 + pos * 7_919 % span)


def _drain(step) -> list:
    outs = []
    for _ in range(200):
        batch = step()
        outs.extend(batch)
        if not batch:
            return outs
    raise AssertionError("the engine never went idle")


def test_the_core_takes_and_returns_plain_data(tokenizer):
    core = EngineCore(_executor(tokenizer), CONFIG)
    request = EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
    core.add_request(request)
    outs = _drain(core.step)
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert all(o.text_delta == "" for o in outs)  # text is the output processor's
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 4
    assert outs[0].prompt_token_ids == [5, 6, 7] and all(o.prompt_token_ids is None for o in outs[1:])
    assert pickle.loads(pickle.dumps(outs)) == outs  # what a worker sends over its link
    assert core.num_requests == 0 and core.stats().num_free_blocks == CONFIG.num_blocks


def test_a_core_abort_returns_the_last_output_and_frees_the_blocks(tokenizer):
    core = EngineCore(_executor(tokenizer), CONFIG)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), 0.0))
    core.step()
    out = core.abort("r")
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert out.new_token_ids == [] and out.num_output_tokens == 1
    assert core.abort("r") is None and core.step() == []
    assert core.stats().num_free_blocks == CONFIG.num_blocks


def test_the_input_processor_checks_and_tokenizes(tokenizer):
    inputs = InputProcessor(tokenizer, tokenizer.vocab_size, max_model_len=64)
    request = inputs.process("r", "hello world", SamplingParams(max_tokens=8), priority=2, arrival_s=1.5)
    assert request.prompt_token_ids == tokenizer.encode_prompt("hello world")
    assert (request.priority, request.arrival_s) == (2, 1.5)
    assert request.eos_token_ids == tuple(tokenizer.eos_token_ids)
    with pytest.raises(InvalidArgument) as bad_id:
        inputs.process("r", [1, tokenizer.vocab_size], SamplingParams())
    assert bad_id.value.param == "prompt"
    with pytest.raises(RequestTooLong) as too_long:
        inputs.process("r", [1] * 60, SamplingParams(max_tokens=8))
    assert too_long.value.param == "max_tokens"
    with pytest.raises(InvalidArgument) as not_params:
        inputs.process("r", [1], {"max_tokens": 8})  # type: ignore[arg-type]
    assert not_params.value.param == "sampling_params"


def test_the_output_processor_adds_the_text_the_tokens_decode_to(tokenizer):
    core = EngineCore(_executor(tokenizer), CONFIG)
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, 0.0))
    outputs.add_request("r", [5, 6, 7], params)
    processed = [outputs.process(o) for o in _drain(core.step)]
    ids = [t for o in processed for t in o.new_token_ids]
    assert "".join(o.text_delta for o in processed) == tokenizer.decode(ids)
    assert "r" not in outputs  # its last output dropped its text state


def test_a_stop_string_ends_the_request_in_the_core_and_frees_its_blocks(tokenizer):
    engine = LLMEngine(_executor(tokenizer), tokenizer, CONFIG, "fake")
    greedy = {"max_tokens": 20, "ignore_eos": True}
    engine.add_request("full", [5, 6, 7], SamplingParams(**greedy))
    full = "".join(o.text_delta for o in _drain(engine.step))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    engine.add_request("stop", [5, 6, 7], SamplingParams(**greedy, stop=[stop]))
    outs = _drain(engine.step)
    assert "".join(o.text_delta for o in outs) == full[: full.index(stop)]
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.STOP and last.stop_reason == stop
    assert last.finished_offset_s is not None and last.num_output_tokens < 20
    assert engine.core.num_requests == 0 and engine.output_processor.num_requests == 0
    assert engine.stats().num_blocks_free == CONFIG.num_blocks


def test_a_prefilled_requests_first_token_can_hold_its_stop_string(tokenizer):
    """Decode side of a disaggregated pair: the first token, sampled by the prefill worker, goes
    through the same output processing as any other, stop strings included."""
    engine = LLMEngine(_executor(tokenizer), tokenizer, CONFIG, "fake")
    first = next(t for t in range(100, tokenizer.vocab_size) if tokenizer.decode([t]).strip().isalpha())
    stop = tokenizer.decode([first]).strip()
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop])
    seq = engine.reserve_prefilled("r", [5, 6, 7], first, params)
    assert seq is not None
    engine.start_prefilled(seq)
    outs = _drain(engine.step)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is FinishReason.STOP
    assert outs[0].new_token_ids == [first] and stop not in outs[0].text_delta
    assert engine.core.num_requests == 0 and engine.stats().num_blocks_free == CONFIG.num_blocks


class _OnlySyncEngine:
    """LLMEngine behind client.SyncEngine's calls alone; add_request returns nothing, so a caller
    must build its results from the outputs."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.front = engine.front
        self.sequences: dict = {}

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        self.sequences[request_id] = self._engine.add_request(request_id, prompt, params, **kwargs)

    def abort(self, request_id):
        return self._engine.abort(request_id)

    def step(self):
        return self._engine.step()

    def has_unfinished(self):
        return self._engine.has_unfinished()

    def stats(self):
        return self._engine.stats()

    def close(self):
        self._engine.close()


def test_the_offline_llm_builds_its_results_from_the_outputs_alone(tokenizer):
    from servelab.engine.llm import LLM

    engine = _OnlySyncEngine(LLMEngine(_executor(tokenizer), tokenizer, CONFIG, "fake"))
    llm = LLM.from_engine(engine)
    outs = llm.generate(["hello world", [5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
    for out in outs:
        seq = engine.sequences[out.request_id]
        assert out.prompt_token_ids == seq.prompt_token_ids and out.token_ids == seq.output_token_ids
        assert out.text == tokenizer.decode(seq.output_token_ids) and out.finish_reason is FinishReason.LENGTH
        t, a = out.timings, seq.arrival_s
        assert t.ttft_s == seq.first_token_s - a and t.e2e_s == seq.token_times_s[-1] - a
        assert t.queue_s == seq.first_scheduled_s - a and len(t.itl_s) == 5
        assert t.tpot_s == pytest.approx((t.e2e_s - t.ttft_s) / 5)


def test_the_offline_llm_leaves_the_engine_clean_when_interrupted(tokenizer):
    from servelab.engine.llm import LLM

    inner = LLMEngine(_executor(tokenizer), tokenizer, CONFIG, "fake")
    llm = LLM.from_engine(_OnlySyncEngine(inner))

    def interrupt(out) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], SamplingParams(max_tokens=30, ignore_eos=True), on_output=interrupt)
    assert not inner.has_unfinished() and inner.core.num_requests == 0
    assert inner.stats().num_blocks_free == CONFIG.num_blocks
    assert [o.text for o in llm.generate("a", SamplingParams(max_tokens=3, ignore_eos=True))] != [""]
