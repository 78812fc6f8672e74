"""The test driver, run_to_completion, and the scheduler under it: arrivals on the virtual clock,
queue time, rejections, hooks, determinism under preemption."""

from __future__ import annotations

import zlib

import pytest

from servelab.core.config import SchedulerConfig
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import FinishReason, SamplingParams, Sequence
from servelab.errors import QueueFull, RequestTooLong
from tests.driver import DriverStats, run_to_completion
from tests.fake_executor import FakeExecutor


def make_seq(rid: str, prompt_len: int, max_tokens: int, arrival_s: float = 0.0) -> Sequence:
    return Sequence(
        rid,
        [zlib.crc32(rid.encode()) % 1000 + i for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens),
        arrival_s=arrival_s,
    )


def scheduler(**kw) -> Scheduler:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 8192)
    return Scheduler(SchedulerConfig(**kw))


def test_runs_every_request_to_completion_on_the_virtual_clock():
    s = scheduler(max_num_batched_tokens=32)
    ex = FakeExecutor(step_s=0.01, per_token_s=0.001)
    seqs = [make_seq("a", 10, 3), make_seq("b", 20, 5)]
    stats = DriverStats()
    finished = run_to_completion(s, ex, seqs, stats=stats)
    assert [q.request_id for q in finished] == ["a", "b"]
    assert [q.num_output_tokens for q in finished] == [3, 5]
    assert stats.num_steps == ex.num_steps
    # Virtual time is the sum of the executor's step durations.
    assert stats.end_s == pytest.approx(ex.num_steps * 0.01 + ex.num_batched_tokens * 0.001)
    assert finished[-1].finished_s == pytest.approx(stats.end_s)


def test_requests_join_at_their_arrival_and_idle_time_is_skipped():
    s = scheduler()
    ex = FakeExecutor(step_s=0.01, per_token_s=0.0)
    early, late = make_seq("early", 4, 2, arrival_s=0.0), make_seq("late", 4, 2, arrival_s=5.0)
    finished = run_to_completion(s, ex, [late, early])
    assert [q.request_id for q in finished] == ["early", "late"]
    assert late.first_scheduled_s == pytest.approx(5.0)  # the clock jumped to the arrival
    assert late.arrival_s == 5.0 and early.first_token_s == pytest.approx(0.01)
    assert ex.num_steps == 4  # no empty steps while idle


def test_a_request_arriving_mid_step_joins_the_next_step():
    s = scheduler()
    ex = FakeExecutor(step_s=0.01, per_token_s=0.0)
    a, b = make_seq("a", 4, 5), make_seq("b", 4, 1, arrival_s=0.015)
    run_to_completion(s, ex, [a, b])
    assert b.first_scheduled_s == pytest.approx(0.02)
    assert b.first_scheduled_s - b.arrival_s == pytest.approx(0.005)  # queue time


def test_rejections_go_to_the_hook_or_raise():
    seqs = [make_seq("ok", 4, 2), make_seq("too-long", 60, 10), make_seq("ok2", 4, 2)]
    rejected = []
    finished = run_to_completion(
        scheduler(max_model_len=64),
        FakeExecutor(),
        seqs,
        on_reject=lambda q, e: rejected.append((q.request_id, type(e))),
    )
    assert rejected == [("too-long", RequestTooLong)]
    assert [q.request_id for q in finished] == ["ok", "ok2"]
    with pytest.raises(RequestTooLong, match="exceeds max_model_len 64"):
        run_to_completion(scheduler(max_model_len=64), FakeExecutor(), [make_seq("x", 60, 10)])


def test_a_full_queue_rejects_the_overflow_of_a_burst():
    seqs = [make_seq(f"r{i}", 4, 2) for i in range(5)]
    rejected = []
    stats = DriverStats()
    finished = run_to_completion(
        scheduler(max_waiting=3),
        FakeExecutor(),
        seqs,
        on_reject=lambda q, e: rejected.append((q.request_id, e)),
        stats=stats,
    )
    assert [rid for rid, _ in rejected] == ["r3", "r4"]
    assert all(isinstance(e, QueueFull) for _, e in rejected)
    assert len(finished) == 3 and stats.num_rejected == 2


def test_requests_aborted_by_the_step_hook_are_reported_finished():
    s = scheduler()
    seqs = [make_seq("a", 4, 50), make_seq("b", 4, 3)]

    def on_step(plan, result, outputs):
        if s.get("a").num_output_tokens == 2:
            s.abort("a")

    finished = run_to_completion(s, FakeExecutor(), seqs, on_step=on_step)
    assert {q.request_id: q.finish_reason for q in finished} == {"a": FinishReason.ABORT, "b": FinishReason.LENGTH}
    assert seqs[0].num_output_tokens == 2


def test_max_steps_guards_a_runaway_loop():
    with pytest.raises(RuntimeError, match="max_steps=3"):
        run_to_completion(scheduler(), FakeExecutor(), [make_seq("a", 4, 20)], max_steps=3)


def test_same_workload_same_result_with_and_without_preemption():
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        s = scheduler(num_blocks=num_blocks, max_model_len=64)
        seqs = [make_seq(f"r{i}", 5 + i, 12, arrival_s=0.001 * i) for i in range(8)]
        run_to_completion(s, FakeExecutor(), seqs)
        return {q.request_id: q.output_token_ids for q in seqs}, s.num_preemptions

    roomy, none = run(256)
    tight, some = run(16)
    assert none == 0 and some > 0
    assert roomy == tight
