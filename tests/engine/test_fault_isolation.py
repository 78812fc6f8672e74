"""One request's fault ends that request only.

A fault is injected into one sequence of a batch of 8, in sampling, in detokenization, or
through sampling parameters that validation would have refused; the faulty request finishes
with finish reason "error" and a log line naming it, the other 7 finish with exactly the tokens
of a run without the fault, and every KV block goes back to the pool.
"""

from __future__ import annotations

import logging
import random

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.detokenizer import RequestTextStream
from servelab.engine.sampler import Sampler
from servelab.errors import InvalidArgument
from tests.scheduler_checks import check_invariants

BAD = "r3"


def _params(i: int) -> SamplingParams:
    # Greedy rows and seeded random rows: both are reproducible whatever else is in the batch.
    if i % 2:
        return SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=0.5)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {f"r{i}": [rng.randrange(3, 400) for _ in range(rng.randint(4, 30))] for i in range(8)}


def _run(engine, setup=None, prefix: str = "") -> dict[str, tuple[list[int], FinishReason]]:
    seqs = {
        prefix + rid: engine.add_request(prefix + rid, ids, _params(i))
        for i, (rid, ids) in enumerate(_prompts().items())
    }
    if setup is not None:
        setup(engine, seqs[BAD])
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert not engine.has_unfinished(), "a request hung"
    check_invariants(engine.scheduler)
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total, "a KV block leaked"
    assert set(finished) == set(seqs)
    return {rid.removeprefix(prefix): (seq.output_token_ids, finished[rid]) for rid, seq in seqs.items()}


@pytest.fixture(scope="module")
def baseline(tiny_engine_factory):
    out = _run(tiny_engine_factory())
    assert all(reason is FinishReason.LENGTH for _, reason in out.values())
    return out


def _sampler_raises(monkeypatch):
    real = Sampler.sample

    def sample(self, logits, seqs, argmax=None):
        if any(s.request_id == BAD and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("injected sampler fault")
        return real(self, logits, seqs, argmax)

    monkeypatch.setattr(Sampler, "sample", sample)


def _id_past_the_vocabulary(monkeypatch):
    real = Sampler.sample

    def sample(self, logits, seqs, argmax=None):
        tokens, logprobs = real(self, logits, seqs, argmax)
        return [logits.shape[1] + 5 if s.request_id == BAD else t for s, t in zip(seqs, tokens)], logprobs

    monkeypatch.setattr(Sampler, "sample", sample)


def _detokenizer_raises(monkeypatch):
    real = RequestTextStream.add
    bad_streams = []

    def add(self, token_ids):
        if self in bad_streams:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(self, token_ids)

    monkeypatch.setattr(RequestTextStream, "add", add)
    return lambda engine, seq: bad_streams.append(engine.output_processor._requests[seq.request_id].stream)


def _huge_temperature(monkeypatch):
    """The issue's reproduction, past validation: temperature 1e39 (inf in fp32) with min_tokens
    masking EOS made -inf / inf = NaN, and the sampler returned an id past the vocabulary."""

    def setup(engine, seq):
        seq.params.temperature = 1e39
        seq.params.min_tokens = 5
        seq.params.ignore_eos = False

    return setup


FAULTS = {
    "sampler-raises": _sampler_raises,
    "id-past-vocabulary": _id_past_the_vocabulary,
    "detokenizer-raises": _detokenizer_raises,
    "temperature-1e39": _huge_temperature,
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_in_one_request_ends_only_that_request(fault, tiny_engine_factory, baseline, monkeypatch, caplog):
    setup = FAULTS[fault](monkeypatch)
    engine = tiny_engine_factory()
    with caplog.at_level(logging.WARNING, logger="servelab.engine"):
        out = _run(engine, setup)
    assert out[BAD][1] is FinishReason.ERROR
    for rid, expected in baseline.items():
        if rid != BAD:
            assert out[rid] == expected, rid
    assert any(f"request {BAD}:" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    monkeypatch.undo()
    assert _run(engine, prefix="again-") == baseline  # and the engine keeps serving


def test_the_issue_reproduction_is_refused_at_admission(tiny_engine_factory):
    engine = tiny_engine_factory()
    with pytest.raises(InvalidArgument, match=r"temperature must be a number in \[0, 100\]"):
        engine.add_request("x", [5, 6, 7], SamplingParams(temperature=1e39, min_tokens=4))


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_engine_factory):
    engine = tiny_engine_factory()
    vocab = engine.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(
            InvalidArgument, match=rf"stop_token_ids holds {bad}, outside the vocabulary \[0, {vocab}\)"
        ) as err:
            engine.add_request("x", [5, 6, 7], SamplingParams(stop_token_ids=[3, bad], min_tokens=1))
        assert err.value.param == "stop_token_ids"
    assert not engine.has_unfinished()
