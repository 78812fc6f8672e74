"""The lab's simulator runs: how many run at once, the time and memory one lesson may take, the
cache of their results (bounded in bytes), and their cancellation when the server stops.

A lesson runs in a thread of the web server's pool, and a thread cannot be killed, so the
simulator's event loop calls `Budget.check` every CHECK_EVERY_EVENTS events: past the lesson's
deadline, or once the server is stopping, it raises and the run ends within milliseconds.
Memory is budgeted before a run starts, from the tokens it would simulate, so a run that does not
fit is refused at once rather than after it has taken the memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from servelab.errors import ServelabError
from servelab.lab.limits import MAX_RUNNING_SIMULATIONS, RETRY_AFTER_S, LabBusy

T = TypeVar("T")

DEFAULT_TIME_BUDGET_S = 30.0
DEFAULT_MEMORY_BUDGET_BYTES = 128 * 2**20
DEFAULT_CACHE_BYTES = 256 * 2**20
# Measured with tracemalloc on the slo lesson's runs (720 requests, 128 and 1,024 output tokens
# each): the peak while a run simulates, per output token and per prompt token it simulates...
PEAK_BYTES_PER_OUTPUT_TOKEN = 32
PEAK_BYTES_PER_PROMPT_TOKEN = 12
# ...and what its result keeps afterwards: a float per token time, and a record per request.
RESULT_BYTES_PER_TOKEN = 8
RESULT_BYTES_PER_REQUEST = 3000


def max_plan_concurrency(prompt_len: int, output_len: int, budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> int:
    """The most clients a capacity level (`servelab plan`'s) may have for its simulation to stay
    within the per-run memory budget: its requests (`planner.level_requests`) at their peak bytes
    per prompt and output token. At least 1."""
    from servelab.bench.planner import level_requests

    per_request = PEAK_BYTES_PER_PROMPT_TOKEN * prompt_len + PEAK_BYTES_PER_OUTPUT_TOKEN * output_len
    lo, hi = 1, max(2, budget_bytes // per_request + 1)  # level_requests(c) > c: hi never fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if level_requests(mid) * per_request <= budget_bytes else (lo, mid)
    return lo


class SimulationOverBudget(ServelabError):
    """A lesson's configuration costs more than the lab gives one run; smaller inputs fit."""

    code = "simulation_over_budget"


class SimulationCancelled(ServelabError):
    http_status = 503
    error_type = "server_overloaded"
    code = "shutting_down"


class ResultCache:
    """Least recently used results under a bound in bytes; a result larger than the bound is not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if nbytes > self.max_bytes:
                return
            while self._entries and self.bytes + nbytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
            self._entries[key] = (value, nbytes)
            self.bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def result_bytes(results: Iterable[Any]) -> int:
    """What SimResults keep in memory: their token times, their records and their step traces."""
    total = 0
    for result in results:
        for record in result.records:
            total += RESULT_BYTES_PER_REQUEST + RESULT_BYTES_PER_TOKEN * len(record.token_times_s)
        trace = result.trace
        total += sum(column.itemsize * len(column) for column in (
            trace.replica, trace.start_s, trace.duration_s, trace.num_seqs, trace.num_decode, trace.num_tokens,
            trace.kv_usage))  # fmt: skip
    return total


class Budget:
    """One lesson's allowance: a deadline, the memory of each simulation it runs, and the cache."""

    def __init__(self, simulations: Simulations, lesson: str):
        self.simulations = simulations
        self.lesson = lesson
        self.deadline = time.monotonic() + simulations.time_budget_s

    def check(self) -> None:
        sims = self.simulations
        if sims.stopping.is_set():
            raise SimulationCancelled("the server is shutting down; the simulation was stopped")
        if time.monotonic() > self.deadline:
            raise SimulationOverBudget(
                f"the {self.lesson} lesson ran past the lab's time budget of {sims.time_budget_s:g} s per lesson; "
                "lower the rate, prompt_len or output_len"
            )

    def require_memory(self, *, prompt_tokens: int, output_tokens: int, inputs: str) -> None:
        """Refuses a run whose simulated tokens would take more than the per-run memory budget;
        `inputs` names what the user can lower ("rate, prompt_len or output_len")."""
        prompt_bytes = PEAK_BYTES_PER_PROMPT_TOKEN * prompt_tokens
        output_bytes = PEAK_BYTES_PER_OUTPUT_TOKEN * output_tokens
        limit = self.simulations.memory_budget_bytes
        if prompt_bytes + output_bytes > limit:
            names = inputs.replace(" or ", ", ").split(", ")
            heavier = "output_len" if output_bytes >= prompt_bytes else "prompt_len"
            raise SimulationOverBudget(
                f"the {self.lesson} lesson would simulate {prompt_tokens:,} prompt and {output_tokens:,} output tokens "
                f"in one run, about {(prompt_bytes + output_bytes) / 2**20:,.0f} MiB while it runs, past the lab's "
                f"budget of {limit / 2**20:,.0f} MiB per run; lower {inputs}",
                param=heavier if heavier in names else names[-1],
            )

    def cached(self, key: Hashable, run: Callable[[], T], size: Callable[[T], int]) -> T:
        """The cached result for `key`, or `run()`'s, then kept (an identical request answers from it)."""
        cache = self.simulations.cache
        value = cache.get(key)
        if value is None:
            self.check()
            value = run()
            cache.put(key, value, size(value))
        return value


class Simulations:
    """The simulator lessons of one lab: at most `max_running` at once (429 beyond), each under a
    Budget; `cancel()` ends the running ones and refuses new ones (the server is stopping)."""

    def __init__(self, *, max_running: int = MAX_RUNNING_SIMULATIONS, time_budget_s: float = DEFAULT_TIME_BUDGET_S,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, cache_bytes: int = DEFAULT_CACHE_BYTES):  # fmt: skip
        self.max_running = max_running
        self.time_budget_s = time_budget_s
        self.memory_budget_bytes = memory_budget_bytes
        self.cache = ResultCache(cache_bytes)
        self.stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(max_running)

    def run(self, lesson: str, fn: Callable[[Budget], T]) -> T:
        budget = Budget(self, lesson)
        budget.check()
        if not self._slots.acquire(blocking=False):
            raise LabBusy(f"the lab is already running {self.max_running} simulations (the most it runs at once); "
                          f"retry in {RETRY_AFTER_S} s")  # fmt: skip
        try:
            return fn(budget)
        finally:
            self._slots.release()

    def cancel(self) -> None:
        self.stopping.set()


__all__ = [
    "Budget",
    "ResultCache",
    "SimulationCancelled",
    "SimulationOverBudget",
    "Simulations",
    "max_plan_concurrency",
    "result_bytes",
]
