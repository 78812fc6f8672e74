"""Grammar compilation in worker processes, apart from request preparation.

xgrammar compiles in C++ for as long as its input makes it and cannot be interrupted from
Python: in a thread, a runaway compile would go on burning a core and its memory after its
request had gone. Here each compile runs in a worker process. A compile past its deadline, or
whose client left, has its process killed (a fresh one starts for the next compile), and a
constraint that crashes the compiler ends only its worker. The grammar comes back serialized:
1-40 ms each way for grammars within core/structured_output.py's limits. Each worker holds
xgrammar and torch (~270 MB resident) and starts on the first compile that needs it (~2 s);
a killed one is replaced at once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.structured_output import DEFAULT_CACHE_BYTES, StructuredOutputBackend, compile_spec
from servelab.errors import InvalidArgument

# (xgrammar GrammarCompiler, spec) -> CompiledGrammar; module-level, so a spawned worker can import it.
CompileFn = Callable[[Any, StructuredOutputSpec], Any]


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    compile_timeout_s: float = 10.0  # from the request's arrival at the compiler, its wait included
    num_workers: int = 2  # compiles at once; each a process
    cache_bytes: int = DEFAULT_CACHE_BYTES  # compiled grammars kept, by xgrammar's memory_size_bytes


def _worker_main(conn: Connection, tokenizer_info_json: str, compile_fn: CompileFn) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):  # the server went away
            return
        try:
            compiled = compile_fn(compiler, spec)
        except InvalidArgument as e:
            conn.send(("error", e.message))
        else:
            conn.send(("ok", compiled.serialize_json()))


class _Worker:
    def __init__(self, tokenizer_info_json: str, compile_fn: CompileFn):
        # spawn: the server's threads make fork unsafe
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, tokenizer_info_json, compile_fn),
                                   name="servelab-grammar", daemon=True)  # fmt: skip
        self.process.start()
        child.close()
        self.conn.recv()  # "ready": xgrammar imported, the vocabulary loaded (EOFError if it died)

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class _Job:
    """One compile; `cancel` (from the event loop) kills the process running it, if one is."""

    __slots__ = ("cancelled", "lock", "spec", "worker")

    def __init__(self, spec: StructuredOutputSpec):
        self.spec = spec
        self.lock = threading.Lock()
        self.cancelled = False
        self.worker: _Worker | None = None

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.worker is not None:
                self.worker.process.kill()


class _Cancelled(Exception):
    pass


class GrammarWorkers:
    """Compiles grammars for the server: cached ones at once, others in worker processes, each
    bounded in time; at most `num_workers` at once (one thread each waits on its process)."""

    def __init__(self, backend: StructuredOutputBackend, config: GrammarConfig = GrammarConfig(),
                 compile_fn: CompileFn = compile_spec):  # fmt: skip
        self.backend = backend
        self.config = config
        backend.cache.resize(config.cache_bytes)
        self._compile_fn = compile_fn
        self._threads = ThreadPoolExecutor(config.num_workers, thread_name_prefix="servelab-grammar")
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._tokenizer_info_json: str | None = None
        self._closed = False
        self.num_killed = 0  # workers killed at a deadline or a cancel

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in [*self._idle, *self._busy] if w.process.pid is not None]

    async def compile(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar of `spec`. InvalidArgument naming its field when it does not compile
        or not within the timeout; cancelling the caller kills its compile."""
        cached = self.backend.cache.get(spec)
        if cached is not None:
            return cached
        job = _Job(spec)
        future = self._threads.submit(self._run, job)
        try:
            compiled = await asyncio.wait_for(asyncio.wrap_future(future), self.config.compile_timeout_s)
        except TimeoutError:
            job.cancel()
            raise InvalidArgument(
                f"{spec.source}: the {spec.kind} constraint did not compile within {self.config.compile_timeout_s:g} s "
                "(the server's --structured-output-compile-timeout); simplify it: fewer enum values, smaller "
                "repetition bounds, fewer properties", param=spec.source,
            ) from None  # fmt: skip
        except asyncio.CancelledError:
            job.cancel()
            raise
        self.backend.cache.put(spec, compiled)
        return compiled

    def _run(self, job: _Job) -> Any:
        if job.cancelled:
            raise _Cancelled
        worker = self._take_worker()  # may start a process: seconds, outside the job's lock
        with job.lock:
            if job.cancelled:
                self._give_back(worker, healthy=True)
                raise _Cancelled
            job.worker = worker
        try:
            worker.conn.send(job.spec)
            status, payload = worker.conn.recv()
        except (EOFError, OSError):
            status, payload = "died", None
        with job.lock:
            job.worker = None
            cancelled = job.cancelled
        self._give_back(worker, healthy=status != "died" and not cancelled)
        if cancelled:
            raise _Cancelled
        if status == "died":
            spec = job.spec
            raise InvalidArgument(f"{spec.source}: the grammar compiler failed on this {spec.kind} constraint "
                                  "(its worker process exited)", param=spec.source)  # fmt: skip
        if status == "error":
            raise InvalidArgument(payload, param=job.spec.source)
        return self.backend.deserialize(payload)

    def _take_worker(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise _Cancelled
            if self._idle:
                worker = self._idle.pop()
                self._busy.add(worker)
                return worker
            if self._tokenizer_info_json is None:
                self._tokenizer_info_json = self.backend.tokenizer_info().serialize_json()
        worker = _Worker(self._tokenizer_info_json, self._compile_fn)
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: _Worker, *, healthy: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            if healthy and not self._closed:
                self._idle.append(worker)
                return
            self.num_killed += not self._closed
        worker.close()
        if not self._closed:  # its replacement starts now, not inside the next request's deadline
            replacement = _Worker(self._tokenizer_info_json, self._compile_fn)
            with self._lock:
                (self._idle if not self._closed else []).append(replacement)
            if self._closed:
                replacement.close()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
        for worker in workers:
            worker.process.kill()  # a thread waiting on one returns; it closes its own
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.process.join(timeout=1.0)


__all__ = ["CompileFn", "GrammarConfig", "GrammarWorkers"]
