"""Run requests to completion through a scheduler and an executor, on a virtual clock (tests).

    add arrivals due by now -> schedule(now) -> execute(plan) -> advance the clock -> update(...)

Time is what the executor says a step took, and jumps to the next arrival when nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from servelab.core.plan import Executor, RequestOutput, StepPlan, StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import Sequence
from servelab.errors import ServelabError


StepHook = Callable[[StepPlan, StepResult, list[RequestOutput]], None]
RejectHook = Callable[[Sequence, ServelabError], None]


@dataclass(slots=True)
class DriverStats:
    num_steps: int = 0
    num_rejected: int = 0
    end_s: float = 0.0


def run_to_completion(
    scheduler: Scheduler,
    executor: Executor,
    seqs: Iterable[Sequence],
    *,
    on_step: StepHook | None = None,
    on_reject: RejectHook | None = None,
    max_steps: int | None = None,
    stats: DriverStats | None = None,
) -> list[Sequence]:
    """Feed `seqs` to the scheduler at their `arrival_s` and step until every one has finished.

    Returns the finished sequences in the order they finished (aborted ones included, rejected
    ones not). A request the scheduler rejects (RequestTooLong, QueueFull) goes to `on_reject`;
    without one, the error propagates. `on_step(plan, result, outputs)` runs after each update
    and may add or abort requests through the scheduler. `max_steps` guards against a runaway loop.
    """
    now = 0.0
    stats = stats if stats is not None else DriverStats()
    pending = sorted(seqs, key=lambda s: s.arrival_s)
    next_arrival = 0
    finished: list[Sequence] = []
    outstanding: dict[str, Sequence] = {}  # added, not yet reported finished
    while True:
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            seq = pending[next_arrival]
            next_arrival += 1
            try:
                scheduler.add(seq, now)
                outstanding[seq.request_id] = seq
            except ServelabError as err:
                stats.num_rejected += 1
                if on_reject is None:
                    raise
                on_reject(seq, err)
        if not scheduler.has_unfinished():
            if next_arrival == len(pending):
                break
            now = max(now, pending[next_arrival].arrival_s)
            continue
        if max_steps is not None and stats.num_steps >= max_steps:
            raise RuntimeError(f"run_to_completion: still unfinished after max_steps={max_steps} steps")
        plan = scheduler.schedule(now)
        if plan.is_empty:
            # Live requests but nothing can run: only an abort from outside or a bug gets here.
            raise RuntimeError(
                f"scheduler produced an empty step with {scheduler.num_running} running and "
                f"{scheduler.num_waiting} waiting requests"
            )
        result = executor.execute(plan)
        now += result.duration_s
        outputs = scheduler.update(plan, result, now)
        stats.num_steps += 1
        for out in outputs:
            if out.finished and out.seq is not None:
                finished.append(out.seq)
                outstanding.pop(out.request_id, None)
        if on_step is not None:
            before = scheduler.num_finished
            on_step(plan, result, outputs)
            if scheduler.num_finished != before:
                # The hook aborted or finished some: report them too.
                for rid in [rid for rid, s in outstanding.items() if s.is_finished]:
                    finished.append(outstanding.pop(rid))
    stats.end_s = now
    return finished
