"""CPU work a request needs before (or after) the engine, kept off the event loop.

Parsing a large body, rendering the chat template, tokenizing and detokenizing take time in
proportion to the input; on the event loop they would stall /health and every stream for as
long (docs/limits-and-safety.md). They run here instead, on small pools of threads; the
tokenizer's calls release the GIL (see `engine/tokenizer.py`), so the loop keeps its pace.

Two lanes, by the size of the request's body: a large body (seconds of tokenizing per MB) runs
on a lane of its own, one thread, so the small requests never queue behind it. Grammars compile
elsewhere (engine/grammar_workers.py). Each lane bounds the calls waiting for it: past the bound
the client gets 503 and retries, as at the engine's waiting queue.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from servelab.errors import QueueFull

P = ParamSpec("P")
T = TypeVar("T")

# Bodies from this size up take the large lane: 64 KiB of text tokenizes in ~0.2 s; a prompt that
# fills an 8k-token context is ~32 KiB.
LARGE_REQUEST_BYTES = 64 * 1024
DEFAULT_MAX_PENDING = 4096  # calls waiting for, or running on, the small lane
MAX_PENDING_LARGE = 16  # and on the large lane, whose calls take seconds each


def default_workers() -> int:
    # Tokenizing is short next to a model step; a few threads keep one big request from
    # queueing the small ones behind it without competing with the engine for cores.
    return max(2, min(4, (os.cpu_count() or 1) // 2))


class Lane:
    """A bounded thread pool; `run` awaits a blocking call made on it."""

    def __init__(self, name: str, max_workers: int, max_pending: int):
        self.name = name
        self.max_workers = max_workers
        self.max_pending = max_pending
        self.num_pending = 0
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"servelab-{name}")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self.num_pending >= self.max_pending:
            raise QueueFull(f"the server is preparing {self.num_pending} requests on its {self.name} lane, its "
                            "most; retry shortly")  # fmt: skip
        self.num_pending += 1  # on the event loop's thread only
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self.num_pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Offload:
    """One per app: the small lane (`run`) and the large one, chosen by `lane(body_bytes)`."""

    def __init__(self, max_workers: int | None = None, *, large_request_bytes: int = LARGE_REQUEST_BYTES,
                 max_pending: int = DEFAULT_MAX_PENDING):  # fmt: skip
        self.max_workers = max_workers or default_workers()
        self.large_request_bytes = large_request_bytes
        self.small = Lane("offload", self.max_workers, max_pending)
        self.large = Lane("offload-large", 1, MAX_PENDING_LARGE)

    def lane(self, body_bytes: int) -> Lane:
        return self.large if body_bytes >= self.large_request_bytes else self.small

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.small.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self.small.shutdown()
        self.large.shutdown()


__all__ = ["LARGE_REQUEST_BYTES", "Lane", "Offload", "default_workers"]
