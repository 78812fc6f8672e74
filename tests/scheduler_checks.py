"""Consistency checks of a scheduler's state, for tests: they read its private bookkeeping."""

from __future__ import annotations

from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SequenceStatus
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler


def check_invariants(s: Scheduler) -> None:
    """Raise AssertionError if the scheduler's state is inconsistent."""
    bm = s.block_manager
    bm.check_invariants()
    running_ids = [q.request_id for q in s.running]
    assert len(set(running_ids)) == len(running_ids), "a sequence runs twice"
    assert len(s.running) <= s.config.max_num_seqs, "more running sequences than max_num_seqs"
    keys = [q.order_key for q in s.running]
    assert keys == sorted(keys), "running is out of order"
    waiting = [q for _, q in s._waiting if q.status is SequenceStatus.WAITING]
    assert len(waiting) == s.num_waiting, "waiting count is off"
    assert not set(running_ids) & {q.request_id for q in waiting}, "a sequence is both running and waiting"
    for q in s.running:
        assert q.status is SequenceStatus.RUNNING
        assert q.num_computed_tokens < len(q.token_ids), f"{q.request_id}: nothing left to compute"
        assert len(q.block_table) * bm.block_size >= q.num_computed_tokens, f"{q.request_id}: KV beyond its blocks"
    for q in waiting:
        assert not q.block_table and q.num_computed_tokens == 0, f"{q.request_id}: waiting but holds KV"
    live = set(running_ids) | {q.request_id for q in waiting}
    assert live == set(s._live), "live requests are neither running nor waiting"
    owners = {q.request_id for q in bm.owners()}
    assert owners <= set(running_ids), "a non-running sequence owns blocks"
    if isinstance(s, ImplicitDecodeScheduler):
        check_implicit_invariants(s)


def check_implicit_invariants(s: ImplicitDecodeScheduler) -> None:
    running = s.running
    implicit = [q for q in running if q.implicit_from >= 0]
    assert s._explicit == [q for q in running if q.implicit_from < 0], "explicit list out of step"
    assert s._num_implicit == len(implicit), "implicit count is off"
    assert s._implicit_base == sum(len(q.token_ids) - q.implicit_from for q in implicit), "implicit sums off"
    tick = len(s._clock)
    bs = s.config.block_size
    for q in implicit:
        # Its context at the next tick fits its blocks, or its block just filled and it is
        # queued for a new one; otherwise it has an event ahead.
        next_end = len(q.token_ids) + tick - q.implicit_from
        table_end = len(q.block_table) * bs
        if q.implicit_needs_block:
            assert next_end == table_end + 1 and q in s._needs_block, f"{q.request_id}: lost its block"
        else:
            assert next_end <= table_end, f"{q.request_id}: implicit past its blocks"
            assert q.implicit_wake >= tick and q in s._wake.get(q.implicit_wake, ()), f"{q.request_id}: no wake"
