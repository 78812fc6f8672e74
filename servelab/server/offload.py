"""CPU work a request needs before (or after) the engine, kept off the event loop.

Parsing a large body, rendering the chat template, tokenizing and detokenizing take time in
proportion to the input; on the event loop they would stall /health and every stream for as
long (docs/limits-and-safety.md). They run here instead, on a small pool of threads; the
tokenizer's calls release the GIL (see `engine/tokenizer.py`), so the loop keeps its pace.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def default_workers() -> int:
    # Tokenizing is short next to a model step; a few threads keep one big request from
    # queueing the small ones behind it without competing with the engine for cores.
    return max(2, min(4, (os.cpu_count() or 1) // 2))


class Offload:
    """A bounded thread pool, one per app; `run` awaits a blocking call made on it."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers or default_workers()
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="servelab-offload")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["Offload", "default_workers"]
