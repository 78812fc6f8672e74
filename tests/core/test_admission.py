"""The waiting queue on its own: its order under both policies, its bound, lazy removal."""

from __future__ import annotations

import pytest

from servelab.core.admission import WaitingQueue
from servelab.core.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from servelab.errors import QueueFull


def queued(q: WaitingQueue, rid: str, priority: int = 0, arrival_s: float = 0.0) -> Sequence:
    seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=2), priority=priority, arrival_s=arrival_s)
    seq.order_key = q.order_key(seq)
    q.push(seq)
    return seq


def drain(q: WaitingQueue) -> list[str]:
    out = []
    while (seq := q.peek()) is not None:
        assert q.pop() is seq
        out.append(seq.request_id)
    return out


def test_fcfs_admits_in_arrival_order_and_priority_by_priority_then_arrival():
    fcfs, prio = WaitingQueue("fcfs", None), WaitingQueue("priority", None)
    for rid, priority, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 0, 0.5), ("d", 1, 0.2)):
        queued(fcfs, rid, priority, arrival)
        queued(prio, rid, priority, arrival)
    assert [s.request_id for s in prio] == ["c", "b", "d", "a"]
    assert drain(fcfs) == ["a", "b", "c", "d"] and drain(prio) == ["c", "b", "d", "a"]
    assert len(fcfs) == len(prio) == 0


def test_a_finished_sequence_leaves_the_count_at_once_and_the_heap_at_the_head():
    q = WaitingQueue("fcfs", max_waiting=2)
    a, _ = queued(q, "a"), queued(q, "b")
    with pytest.raises(QueueFull, match=r"request 'c' rejected: the waiting queue is full \(max_waiting=2\)"):
        q.check_room("c")
    q.remove(a)
    a.status, a.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
    assert len(q) == 1 and [s.request_id for s in q] == ["b"]
    q.check_room("c")  # room again
    assert drain(q) == ["b"] and len(q) == 0
