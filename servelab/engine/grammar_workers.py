"""Grammar compilation in worker processes, apart from request preparation.

xgrammar compiles in C++ for as long as its input makes it and cannot be interrupted from
Python: in a thread, a runaway compile would go on burning a core and its memory after its
request had gone. Here each compile runs in a worker process. A compile past its deadline, or
whose client left, has its process killed, and a constraint that crashes the compiler ends
only its worker. The grammar comes back serialized: 1-40 ms each way for grammars within
core/structured_output.py's limits. Each worker holds xgrammar and torch (~270 MB resident) and
takes ~2 s to start: the pool is started with its server or cluster worker (`start`), and a
killed worker's replacement starts at once; a compile that waits for a start is not charged it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.structured_output import DEFAULT_CACHE_BYTES, StructuredOutputBackend, compile_spec
from servelab.errors import CompilerUnavailable, InvalidArgument

logger = logging.getLogger("servelab.server")

WORKER_START_TIMEOUT_S = 120.0  # ~2 s idle; tens of seconds on a loaded host

# (xgrammar GrammarCompiler, spec) -> CompiledGrammar; module-level, so a spawned worker can import it.
CompileFn = Callable[[Any, StructuredOutputSpec], Any]


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    # from the request's arrival at the compiler, its wait for other compiles included; a wait for
    # a worker process to start (a killed one's replacement) is not counted
    compile_timeout_s: float = 10.0
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
        # "ready": xgrammar imported, the vocabulary loaded (EOFError if it died); a start that
        # hangs must not hold the server's start-up, or a compile's thread, for ever
        if not self.conn.poll(WORKER_START_TIMEOUT_S):
            self.close()
            raise TimeoutError(f"a grammar worker did not start within {WORKER_START_TIMEOUT_S:g} s")
        self.conn.recv()

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class _Job:
    """One compile; `cancel` (from the event loop) kills the process running it, if one is."""

    __slots__ = ("cancelled", "lock", "spec", "startup_s", "starting_since", "worker")

    def __init__(self, spec: StructuredOutputSpec):
        self.spec = spec
        self.lock = threading.Lock()
        self.cancelled = False
        self.worker: _Worker | None = None
        # Time spent waiting for a worker process to start (a cold one, or the replacement of a
        # killed one): the server's cost, not the constraint's, so not counted against its timeout.
        self.startup_s = 0.0
        self.starting_since: float | None = None  # time.monotonic() while waiting for one

    def start_waiting(self) -> None:
        with self.lock:
            if self.starting_since is None:
                self.starting_since = time.monotonic()

    def stop_waiting(self) -> None:
        with self.lock:
            if self.starting_since is not None:
                self.startup_s += time.monotonic() - self.starting_since
                self.starting_since = None

    def excused_s(self, now: float) -> float:
        with self.lock:
            since = self.starting_since
            return self.startup_s + (0.0 if since is None else now - since)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.worker is not None:
                self.worker.process.kill()


class _Cancelled(Exception):
    pass


class GrammarWorkers:
    """Compiles grammars for the server (and for each cluster worker): cached ones at once, others
    in worker processes, each bounded in time; at most `num_workers` at once (one thread each
    waits on its process)."""

    def __init__(self, backend: StructuredOutputBackend, config: GrammarConfig = GrammarConfig(),
                 compile_fn: CompileFn = compile_spec):  # fmt: skip
        self.backend = backend
        self.config = config
        backend.cache.resize(config.cache_bytes)
        self._compile_fn = compile_fn
        self._threads = ThreadPoolExecutor(config.num_workers, thread_name_prefix="servelab-grammar")
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)  # a replacement is ready (or failed)
        self._replacing = 0  # replacements of killed workers being started
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._info_lock = threading.Lock()
        self._tokenizer_info_json: str | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # runs `submit`'s compiles; started on the first
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
        future = asyncio.wrap_future(self._threads.submit(self._run, job))
        deadline = time.monotonic() + self.config.compile_timeout_s
        try:
            while not future.done():
                now = time.monotonic()
                remaining_s = deadline + job.excused_s(now) - now
                if remaining_s <= 0:
                    raise TimeoutError
                await asyncio.wait({future}, timeout=remaining_s)
            compiled = future.result()
        except TimeoutError:
            job.cancel()
            future.cancel()
            raise InvalidArgument(
                f"{spec.source}: the {spec.kind} constraint did not compile within {self.config.compile_timeout_s:g} s "
                "(the server's --structured-output-compile-timeout); simplify it: fewer enum values, smaller "
                "repetition bounds, fewer properties", param=spec.source,
            ) from None  # fmt: skip
        except asyncio.CancelledError:
            job.cancel()
            future.cancel()
            raise
        self.backend.cache.put(spec, compiled)
        return compiled

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """`compile` for a caller on a plain thread (a cluster worker's preparer): its future,
        whose cancel kills the compile as a cancelled `compile` does."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="servelab-grammar-loop", daemon=True).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(self.compile(spec), loop)

    def _run(self, job: _Job) -> Any:
        if job.cancelled:
            raise _Cancelled
        worker = self._take_worker(job)  # may wait for a process to start: seconds, outside the job's lock
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

    def _take_worker(self, job: _Job) -> _Worker:
        """An idle worker; else the replacement being started for a killed one, or a new one,
        the wait for it excused from the job's timeout."""
        with self._lock:
            while not self._closed and not self._idle and self._replacing:
                job.start_waiting()
                self._started.wait()
            if self._closed or self._idle:
                job.stop_waiting()
                if self._closed:
                    raise _Cancelled
                worker = self._idle.pop()
                self._busy.add(worker)
                return worker
        job.start_waiting()
        try:
            worker = _Worker(self._info_json(), self._compile_fn)
        except (OSError, EOFError, TimeoutError) as exc:  # not the constraint's doing, nor its timeout
            raise CompilerUnavailable(f"the grammar compiler could not start ({type(exc).__name__}: {exc}); "
                                      "retry later") from exc  # fmt: skip
        finally:
            job.stop_waiting()
        with self._lock:
            self._busy.add(worker)
        return worker

    def _info_json(self) -> str:
        with self._info_lock:  # not _lock: the first takes seconds (xgrammar imported, the vocabulary read)
            if self._tokenizer_info_json is None:
                self._tokenizer_info_json = self.backend.tokenizer_info().serialize_json()
            return self._tokenizer_info_json

    def _give_back(self, worker: _Worker, *, healthy: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            if healthy and not self._closed:
                self._idle.append(worker)
                return
            self.num_killed += not self._closed
            replace = not self._closed
            self._replacing += replace
        worker.close()
        if replace:  # on a thread of its own: this one may take the next job meanwhile
            threading.Thread(target=self._replace, name="servelab-grammar-start", daemon=True).start()

    def _replace(self) -> None:
        worker: _Worker | None = None
        try:
            if not self._closed:
                worker = _Worker(self._info_json(), self._compile_fn)
        except Exception as exc:  # noqa: BLE001 - a job that needs one starts its own
            if not self._closed:
                logger.warning("servelab: a grammar worker did not start (%s: %s)", type(exc).__name__, exc)
        with self._lock:
            self._replacing -= 1
            if worker is not None and not self._closed:
                self._idle.append(worker)
                worker = None
            self._started.notify_all()
        if worker is not None:
            worker.close()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
            self._started.notify_all()
        for worker in workers:
            worker.process.kill()  # a thread waiting on one returns; it closes its own
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        for worker in workers:
            worker.process.join(timeout=1.0)


__all__ = ["CompileFn", "GrammarConfig", "GrammarWorkers"]
