"""The engine-client interface: what the HTTP layer drives, whatever runs the model.

`EngineClient` is implemented by the in-process AsyncEngine (server/async_engine.py) and by the
front end of data-parallel or disaggregated workers (cluster/front_end.py); `SyncEngine` is what
each of those steps on its engine thread, and what the offline `LLM` steps directly. Requests go in as
`EngineRequest`s; each client request comes back as a `RequestStream` of plain `EngineOutput`s
(engine/outputs.py), ended by a finished output or a `Failed`. `EngineFront` is the engine's input
and output side without its model: the tokenizer, names and limits, and the logits processors
that prepare a request before admission.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from servelab.core.sequence import PoolingParams, SamplingParams
from servelab.errors import InvalidArgument, ServelabError

if TYPE_CHECKING:
    from servelab.core.config import ResolvedSchedulerConfig
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.outputs import EngineOutput, EngineStats
    from servelab.engine.tokenizer import Tokenizer


class EngineFailure(ServelabError):
    """A step raised: the requests in flight are aborted, the engine keeps serving."""

    http_status = 500
    error_type = "internal_server_error"


class EngineStopped(ServelabError):
    http_status = 503
    error_type = "server_overloaded"


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    arrival_s: float | None = None
    pooling: PoolingParams | None = None  # an embedding: prefill only, its vector in the final output's `pooled`


@dataclass(slots=True)
class Failed:
    """Ends one request's stream with an error (its consumer raises it)."""

    request_id: str
    error: ServelabError


OutputObserver = Callable[["EngineOutput"], None]
StepObserver = Callable[[int], None]  # the query tokens of a step that ran
TransferObserver = Callable[[int, float, float], None]  # a request's KV bytes, transfer s, decode queue s


def take_commands(commands: queue.SimpleQueue | queue.Queue, *, wait: bool) -> list[Any]:
    """Every command queued now; with `wait` (an idle engine), sleep until the first arrives."""
    taken = [commands.get()] if wait else []
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken


def prepare_logits_processors(processors: LogitsProcessors | None, params: SamplingParams, *siblings: SamplingParams,
                              grammar: Any = None) -> None:  # fmt: skip
    """Checks token ids against the vocabulary, tokenizes bad words and compiles the grammar
    (cached; `grammar` when the caller compiled it), attached to the params (`siblings`, the
    request's other choices, share it). None `processors`: the engine samples no real logits."""
    if not params.edits_logits or params.prepared_edits is not None and not siblings:
        return
    if processors is None:
        asked = [f for f in ("logit_bias", "allowed_token_ids", "bad_words") if getattr(params, f)]
        if params.structured_output is not None:
            asked.append(params.structured_output.source)
        raise InvalidArgument(
            "this engine does not sample real logits, so logit_bias, allowed_token_ids, bad_words and "
            "structured outputs are not available",
            param=asked[0],
        )
    processors.prepare(params, *siblings, grammar=grammar)


@dataclass
class EngineFront:
    """What the HTTP layer reads of the engine, none of which runs the model: LLMEngine.front
    in-process, built from the model's tokenizer and the workers' WorkerReady in a cluster."""

    model_name: str
    tokenizer: Tokenizer
    scheduler_config: ResolvedSchedulerConfig  # num_blocks and max_model_len are sized
    vocab_size: int
    kv_cache_dtype: str = "none"  # what the KV cache holds ("none": no real cache, e.g. a simulated executor)
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # the model's generation_config.json
    logits_processors: LogitsProcessors | None = None  # None: the engine samples no real logits

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def prepare_logits_processors(self, params: SamplingParams, *siblings: SamplingParams, grammar: Any = None) -> None:
        """The server calls it on a worker thread before admission (prepare_logits_processors)."""
        prepare_logits_processors(self.logits_processors, params, *siblings, grammar=grammar)


class EngineClient(Protocol):
    """What the server's routes and state use of their engine: AsyncEngine, or the front end of
    data-parallel or disaggregated workers (servelab.cluster.front_end.ClusterEngine)."""

    front: EngineFront

    @property
    def stats(self) -> EngineStats:
        """The engine's gauges and totals (a cluster's: summed over its workers)."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def down_reason(self) -> str | None:
        """Why no request can be taken now (None: they can)."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, requests: list[EngineRequest]) -> RequestStream: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def release(self, request_ids: list[str]) -> None: ...

    def abort_all(self, error: ServelabError) -> int: ...

    def add_observer(self, observer: OutputObserver) -> None: ...

    def add_step_observer(self, observer: StepObserver) -> None: ...

    def add_transfer_observer(self, observer: TransferObserver) -> None:
        """Called for each request whose KV crossed from a prefill to a decode worker."""
        ...

    def worker_stats(self) -> dict[str, EngineStats | None]:
        """Each engine's latest stats by rank (None once it failed), for /metrics' worker label."""
        ...

    def health(self) -> dict[str, Any]:
        """/health's body: {"status": "ok" | "degraded" | "down", ...}."""
        ...


class SyncEngine(Protocol):
    """The engine as a step loop drives it, on one thread: LLMEngine (engine/llm_engine.py). The
    server's engine thread (AsyncEngine), a cluster worker's loop and the offline `LLM` add
    requests, step and abort through these calls and read only the plain outputs."""

    @property
    def front(self) -> EngineFront: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    arrival_s: float | None = None, pooling: PoolingParams | None = None) -> object:  # fmt: skip
        """Checks and queues a request; raises InvalidArgument / RequestTooLong / QueueFull."""
        ...

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its last output (finish reason ABORT) comes from the next step()."""
        ...

    def step(self) -> list[EngineOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


class StreamSource(Protocol):
    """What a RequestStream needs of its engine client."""

    def abort(self, request_ids: list[str]) -> None: ...

    def release(self, request_ids: list[str]) -> None: ...


class RequestStream:
    """The outputs of one client request's engine requests, in the order the engine made them.

    Iterate it to get outputs until every request has finished; `close()` (idempotent, also
    called when iteration ends early, e.g. on a client disconnect that cancels the task) aborts
    the ones still running, which returns their KV blocks to the pool."""

    def __init__(self, engine: StreamSource, request_ids: list[str], sink: asyncio.Queue):
        self._engine = engine
        self.request_ids = request_ids
        self._sink = sink
        self._unfinished = set(request_ids)
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        try:
            while self._unfinished:
                item = await self._sink.get()
                if isinstance(item, Failed):
                    self._unfinished.discard(item.request_id)
                    raise item.error
                if item.finished:
                    self._unfinished.discard(item.request_id)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()
        else:
            self._engine.release(self.request_ids)

    def __del__(self) -> None:
        # Safety net for a response that was dropped before its body ever started.
        try:
            self.close()
        except Exception:
            pass
