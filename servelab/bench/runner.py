"""Drive a list of requests against a server: open-loop at planned send times, or closed-loop at
a fixed concurrency, optionally for a fixed duration and with an early stop.

Open loop: every send time is planned before the run starts (from the workload's arrival
process) and each request leaves at its planned time, whatever the server is doing; the planned
and actual send times are both kept, so client lateness is visible instead of silently becoming
part of the server's latency. Closed loop: `concurrency` workers each send their next request
the moment their previous one ends, or a think time after it (a user reading the answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.bench.client import BenchRequest, OpenAIStreamClient, StreamResult

# Checked on every completion and on this period: a saturated level can stall completions.
_ABORT_POLL_S = 0.25


@dataclass(slots=True)
class InFlight:
    """A request that has been sent and has not finished: what an early-stop rule may look at."""

    send_s: float
    first_token_s: float | None = None
    index: int = -1  # the request's index: an early-stop rule may leave the start-up wave out


@dataclass(slots=True)
class RunOutcome:
    results: list[StreamResult]
    start_s: float  # absolute perf_counter at the start of the run; planned times are relative to it
    end_s: float
    aborted: bool = False  # stopped early by `should_abort`
    abort_reason: str = ""
    cancelled: int = 0  # requests in flight when the run was stopped early (not in `results`)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


# should_abort(finished results, in-flight requests, now) -> reason to stop, or "" to go on
AbortRule = Callable[[list[StreamResult], list[InFlight], float], str]


class _Lookahead:
    """An iterator that knows whether anything is left: a closed loop's shared queue of requests."""

    def __init__(self, items: Iterator[BenchRequest]) -> None:
        self._items = items
        self._head = next(items, None)

    @property
    def empty(self) -> bool:
        return self._head is None

    def take(self) -> BenchRequest | None:
        item, self._head = self._head, (next(self._items, None) if self._head is not None else None)
        return item


@dataclass(slots=True)
class _State:
    results: list[StreamResult] = field(default_factory=list)
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    abort_reason: str = ""


async def run_load(
    client: OpenAIStreamClient,
    requests: Sequence[BenchRequest] | Iterator[BenchRequest],
    *,
    concurrency: int | None = None,
    duration_s: float | None = None,
    should_abort: AbortRule | None = None,
    on_result: Callable[[StreamResult], None] | None = None,
) -> RunOutcome:
    """Run every request (or until `duration_s` has passed: nothing new is sent after it, and
    what is in flight is allowed to finish). Requests with `planned_send_s` set are open-loop;
    `concurrency` caps the requests in flight (closed loop when no send times are planned).
    Closed loop: after a request ends, its worker waits the request's `think_s` before it takes
    and sends its next (none when nothing is left)."""
    state = _State()
    start_s = time.perf_counter()
    stop_sending = asyncio.Event()
    open_loop = not isinstance(requests, Iterator) and any(r.planned_send_s is not None for r in requests)
    if not open_loop and concurrency is None:
        raise ValueError("closed-loop runs need a concurrency")

    def past_deadline() -> bool:
        return duration_s is not None and time.perf_counter() - start_s >= duration_s

    async def one(request: BenchRequest, planned_s: float | None) -> None:
        key = request.index
        state.in_flight[key] = tracker = InFlight(send_s=time.perf_counter(), index=key)

        def first_token(at_s: float) -> None:
            tracker.first_token_s = at_s

        try:
            result = await client.stream(request, planned_send_s=planned_s, on_first_token=first_token)
        except Exception as exc:  # noqa: BLE001
            # stream() records every failure it knows; anything else still counts as a failed
            # request with its reason, rather than vanishing from the run with its task.
            result = StreamResult(index=request.index, planned_send_s=planned_s, send_s=tracker.send_s,
                                  end_s=time.perf_counter(), prompt_tokens_planned=request.prompt_tokens,
                                  output_tokens_planned=request.output_tokens,
                                  error=f"client error: {type(exc).__name__}: {exc}")  # fmt: skip
        finally:
            state.in_flight.pop(key, None)
        state.results.append(result)
        if on_result is not None:
            on_result(result)
        check_abort()

    def check_abort() -> None:
        if should_abort is None or state.abort_reason:
            return
        reason = should_abort(state.results, list(state.in_flight.values()), time.perf_counter())
        if reason:
            state.abort_reason = reason
            stop_sending.set()

    async def watchdog() -> None:
        while not stop_sending.is_set():
            await asyncio.sleep(_ABORT_POLL_S)
            check_abort()

    tasks: set[asyncio.Task[None]] = set()

    async def open_loop_dispatch() -> None:
        limit = asyncio.Semaphore(concurrency) if concurrency else None
        for request in requests:
            planned_abs = start_s + (request.planned_send_s or 0.0)
            delay = planned_abs - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop_sending.wait(), timeout=delay)
                except TimeoutError:
                    pass
            if stop_sending.is_set() or past_deadline():
                break
            if limit is not None:
                await limit.acquire()
                if stop_sending.is_set() or past_deadline():  # while it waited for a slot
                    limit.release()
                    break

            async def guarded(req: BenchRequest = request, planned: float = planned_abs) -> None:
                try:
                    await one(req, planned)
                finally:
                    if limit is not None:
                        limit.release()

            task = asyncio.create_task(guarded())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def think(wait_s: float) -> None:
        """A think time, cut short by an abort or the run's deadline."""
        if duration_s is not None:
            wait_s = min(wait_s, max(0.0, start_s + duration_s - time.perf_counter()))
        try:
            await asyncio.wait_for(stop_sending.wait(), timeout=wait_s)
        except TimeoutError:
            pass

    async def closed_loop_worker(source: _Lookahead) -> None:
        while (request := source.take()) is not None:  # shared: each request is taken by one worker
            if stop_sending.is_set() or past_deadline():
                return
            await one(request, None)
            # The user reads the answer, then takes the next request (as the simulator's client
            # does); with nothing left to take there is nothing to wait for.
            if request.think_s > 0 and not source.empty:
                await think(request.think_s)

    async def until_done_or_aborted(work: asyncio.Future[list[None]]) -> int:
        """Wait for `work`; if the abort rule fires first, cancel it. Returns the requests cut off."""
        aborted = asyncio.create_task(stop_sending.wait())
        either: list[asyncio.Future[Any]] = [work, aborted]  # two result types: asyncio.wait's own bound
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if work.done():
            return 0
        cut_off = len(state.in_flight)
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        return cut_off

    dog = asyncio.create_task(watchdog()) if should_abort is not None else None
    cancelled = 0
    try:
        if open_loop:
            await open_loop_dispatch()
            if tasks:
                cancelled = await until_done_or_aborted(asyncio.gather(*list(tasks)))
        else:
            source = _Lookahead(iter(requests))
            assert concurrency is not None
            workers = [asyncio.create_task(closed_loop_worker(source)) for _ in range(concurrency)]
            cancelled = await until_done_or_aborted(asyncio.gather(*workers))
    finally:
        stop_sending.set()
        if dog is not None:
            dog.cancel()
    end_s = max((r.end_s for r in state.results), default=time.perf_counter())
    return RunOutcome(
        results=sorted(state.results, key=lambda r: r.index),
        start_s=start_s,
        end_s=end_s if not state.abort_reason else time.perf_counter(),
        aborted=bool(state.abort_reason),
        abort_reason=state.abort_reason,
        cancelled=cancelled,
    )
