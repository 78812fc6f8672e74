"""What travels on a link: small pickled dataclasses. A request goes as the engine core's own
EngineCoreRequest, made by the front end's input processor; the worker's engine answers with
plain EngineOutputs. Times cross processes (and hosts, whose clocks differ) as offsets, never as
clock readings: AddRequests carries the front end's clock at sending, from which the worker
takes each request's age, and outputs' times are relative to the request's arrival."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from servelab.engine.grammar_workers import GrammarConfig
from servelab.errors import ServelabError

if TYPE_CHECKING:
    from servelab.core.config import ResolvedSchedulerConfig
    from servelab.engine.core import EngineCoreRequest
    from servelab.engine.llm_engine import EngineArgs
    from servelab.engine.outputs import EngineOutput, EngineStats

ROLES = ("mixed", "prefill", "decode")  # a worker's role; prefill and decode: cluster/disagg_worker.py


# ---- front end -> worker ------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerConfig:
    """The first message a worker gets: the engine to build (the front end's flags)."""

    engine_args: EngineArgs
    role: str = "mixed"
    threads: int | None = None  # torch threads; None: torch's choice (a host of its own)
    disagg: Any = None  # prefill and decode workers: their pools and transfer settings (disagg_worker.DisaggConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)  # the front end's --structured-output-* flags
    # a restarted prefill or decode worker: the name of its pair link (channel.pair_link) to each
    # live peer of the other pool, by the peer's rank (None: it joins the world's transfer groups)
    peer_links: dict[int, str] | None = None


@dataclass(slots=True)
class AddRequests:
    """All admitted or none (the n choices of one client request); answered by Admitted. Their
    `arrival_s` and `sent_s` are on the front end's clock: a request's age is their difference."""

    batch: int
    requests: list[EngineCoreRequest]
    sent_s: float
    decode_rank: int | None = None  # to a prefill worker: the decode worker their KV goes to


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class Stop:
    """Abort everything and exit."""


@dataclass(slots=True)
class LinkPeer:
    """To a prefill or decode worker: the other pool's worker `rank` was restarted; form a pair
    link (channel.pair_link) with its replacement under `name`."""

    rank: int
    name: str


@dataclass(slots=True)
class Heartbeat:
    """Sent when nothing else went for HEARTBEAT_S; the worker's carries its stats, and how long
    its step loop has been in its current pass (0: idle), for the front end's hang watchdog."""

    stats: EngineStats | None = None
    busy_s: float = 0.0


# ---- worker -> front end ------------------------------------------------------------------------


@dataclass(slots=True)
class WireError:
    """A ServelabError across the link: its class name, message and fields."""

    kind: str
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        if isinstance(exc, ServelabError):
            return cls(type(exc).__name__, exc.message, exc.param, exc.code)
        return cls("", f"{type(exc).__name__}: {exc}")

    def known(self) -> ServelabError | None:
        """The same error, when it is one of servelab.errors' (else None: the front end decides)."""
        import servelab.errors

        kind = getattr(servelab.errors, self.kind, None) if self.kind else None
        if isinstance(kind, type) and issubclass(kind, ServelabError):
            return kind(self.message, param=self.param, code=self.code)
        return None


@dataclass(slots=True)
class WorkerReady:
    """The engine is built: what the front end needs to serve in its name."""

    rank: int
    model_name: str
    scheduler_config: ResolvedSchedulerConfig  # num_blocks and max_model_len are sized
    vocab_size: int
    kv_cache_dtype: str
    sampling_defaults: dict[str, float]
    pid: int
    host: str
    role: str = "mixed"


@dataclass(slots=True)
class WorkerFailed:
    """The worker could not start (e.g. the model does not load there)."""

    rank: int
    error: WireError


@dataclass(slots=True)
class Admitted:
    batch: int
    error: WireError | None = None
    stats: EngineStats | None = None  # the worker's, with the batch in its waiting queue


@dataclass(slots=True)
class KVTransferRecord:
    """How a request's KV crossed from its prefill worker to its decode worker."""

    num_bytes: int
    transfer_s: float  # from the decode worker's receives posted to the last piece written
    decode_queue_s: float  # from the offer's arrival to the decode worker's reservation


@dataclass(slots=True)
class Outputs:
    """One step's outputs, the step's query tokens, and the engine's stats after it."""

    outputs: list[EngineOutput]  # as the worker's engine made them: plain data, times after arrival
    num_tokens: int
    stats: EngineStats
    kv_transfers: list[KVTransferRecord] = field(
        default_factory=list
    )  # a decode worker's, of requests whose KV came in


@dataclass(slots=True)
class RequestsFailed:
    """A step raised: these requests ended with an error (the worker keeps serving)."""

    request_ids: list[str]
    error: WireError
    in_step: bool = True  # False: they failed outside a step (disaggregated: a KV transfer, a lost peer)
