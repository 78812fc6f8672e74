"""What a prefill or a decode worker of a disaggregated cluster runs (cluster/disagg.py starts
them). Rank 0 is the front end; each worker owns one LLMEngine.

A request's journey:
1. front end -> prefill worker `add`: the prompt runs there, chunked as usual, and samples the
   first token. A request that ends on it (EOS, max_tokens=1, a stop string) ends there.
2. Otherwise the prefill worker detaches it, holding its KV blocks, and `offer`s it to the
   decode worker the front end chose (prompt, first token, sampling parameters, KV layout).
3. The decode worker queues offers in order and reserves blocks for the head one when its pool
   and sequence budget allow (back-pressure: a busy decode pool leaves the prefill worker
   holding finished prefills, its own pool then fills and it admits no more; nothing is
   dropped). Prompt blocks it already caches are not sent. It answers `go` with a tag and posts
   the receives; the prefill worker sends (cluster/kv_transfer.py) and releases its hold.
4. The decode worker writes the blocks, starts the sequence as prefilled and streams every token
   from the first on. A transfer that fails frees the reservation on one side, the hold on the
   other, and ends the request with an error; so does a lost peer.
An abort reaches both workers; a request between them is dropped once the decode side answers.
KV moves on a transfer thread, so neither engine loop waits for the wire.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

logger = logging.getLogger("servelab.cluster")

FRONT_END = 0
_IDLE_POLL_S = 0.02  # how long an idle worker waits for a message before looking again


@dataclass(slots=True)
class WireOutput:
    """An EngineOutput as it crosses to the front end (no Sequence object)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None
    error: str | None = None  # why a request ended with finish_reason "error"
    kv_bytes: int | None = None  # set on a transferred request's first output
    transfer_s: float | None = None
    queue_s: float | None = None  # decode side: from offer to reservation


@dataclass(slots=True)
class WorkerSpec:
    """What a worker process needs besides its rank."""

    role: str  # "prefill" | "decode"
    engine_args: Any  # EngineArgs
    world_size: int
    num_prefill: int  # ranks 1..num_prefill prefill, the rest decode
    port: int
    threads: int
    kv_timeout_s: float
    granularity: str
    parent_pid: int


    def pools(self) -> tuple[list[int], list[int]]:
        """(prefill ranks, decode ranks)."""
        return list(range(1, self.num_prefill + 1)), list(range(self.num_prefill + 1, self.world_size))


def _error(rid: str, why: str) -> WireOutput:
    return WireOutput(rid, [], "", True, "error", error=why)


def _wire(o: Any) -> WireOutput:
    reason = None if o.finish_reason is None else o.finish_reason.value
    return WireOutput(o.request_id, list(o.new_token_ids), o.text_delta, o.finished, reason, o.logprobs)


def _exit_when_orphaned(parent: int) -> None:
    # a front end killed outright cannot stop its workers; they must not linger
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(rank: int, spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist

    from servelab.cluster.disagg_channel import IDLE_TIMEOUT, Channel
    from servelab.cluster.kv_transfer import KVLayout, pair_groups
    from servelab.engine.llm_engine import LLMEngine

    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.world_size, timeout=timedelta(seconds=spec.kv_timeout_s))  # fmt: skip
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    kv_groups = pair_groups(*spec.pools(), spec.kv_timeout_s)
    channel = Channel([r for r in range(spec.world_size) if r != rank], control)
    try:
        engine = LLMEngine.from_args(spec.engine_args)
    except Exception as exc:
        channel.send(FRONT_END, ("failed", f"{type(exc).__name__}: {exc}"))
        _leave(channel)
    kv = engine.executor.kv_cache
    channel.send(FRONT_END, ("ready", KVLayout.of(kv), engine.scheduler_config.num_blocks))
    loop = (PrefillLoop if spec.role == "prefill" else DecodeLoop)(engine, channel, spec, kv_groups)
    try:
        loop.run()
    finally:
        _leave(channel)


def _leave(channel: Any) -> None:
    """Exits the process without tearing the process groups down: the receiver threads still wait
    inside gloo, and destroying a group under them aborts the process. The peers see the closed
    connections."""
    channel.closing = True
    logging.shutdown()
    os._exit(0)


@dataclass(slots=True)
class _Held:
    """A finished prefill waiting for its decode worker: its blocks stay held here."""

    decode_rank: int
    blocks: list[int]
    aborted: bool = False


@dataclass(slots=True)
class _Offer:
    src: int
    rid: str
    prompt: list[int]
    first_token: int
    params: Any
    logprobs: Any
    arrived_s: float = field(default_factory=time.perf_counter)


class _Loop:
    """The engine loop both roles share: messages in, a step, outputs out, transfers done."""

    def __init__(self, engine: Any, channel: Any, spec: WorkerSpec, kv_groups: dict[int, Any]):
        from servelab.cluster.kv_transfer import KVLayout

        self.kv_groups = kv_groups  # peer rank -> the pair's transfer group
        self.engine = engine
        self.channel = channel
        self.spec = spec
        self.kv = engine.executor.kv_cache
        self.layout = KVLayout.of(self.kv)
        self.transfers = ThreadPoolExecutor(1, thread_name_prefix="servelab-kv")
        self.in_flight: dict[Future, Any] = {}
        self.outbox: list[WireOutput] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            idle = not self.engine.has_unfinished() and not self.in_flight
            self._drain(block=idle)
            if self.engine.has_unfinished():
                self.on_outputs(self.engine.step())
            for future in [f for f in self.in_flight if f.done()]:
                self.on_transfer_done(self.in_flight.pop(future), future)
            self.admit()
            self._flush()

    def _drain(self, block: bool) -> None:
        from servelab.cluster.disagg_channel import PeerLost

        try:
            item = self.channel.inbox.get(timeout=_IDLE_POLL_S) if block else self.channel.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            src, message = item
            if isinstance(message, PeerLost):
                self.on_peer_lost(src, message.why)
            elif message[0] == "stop":
                self.running = False
            elif message[0] == "stats":
                bm = self.engine.scheduler.block_manager
                self.send(FRONT_END, ("stats", {"num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks}))
            else:
                self.on_message(src, message)
            try:
                item = self.channel.inbox.get_nowait()
            except queue.Empty:
                return

    def send(self, dst: int, message: Any) -> bool:
        try:
            self.channel.send(dst, message)
            return True
        except RuntimeError as exc:
            if dst == FRONT_END:
                self.running = False  # nobody to serve
            else:
                self.on_peer_lost(dst, str(exc))
            return False

    def _flush(self) -> None:
        if self.outbox:
            outputs, self.outbox = self.outbox, []
            self.send(FRONT_END, ("out", outputs, self.engine.scheduler.block_manager.usage))

    def on_peer_lost(self, src: int, why: str) -> None:
        if src == FRONT_END:
            self.running = False

    # the role's parts
    def on_message(self, src: int, message: tuple) -> None: ...
    def on_outputs(self, outputs: list) -> None: ...
    def on_transfer_done(self, what: Any, future: Future) -> None: ...
    def admit(self) -> None: ...


class PrefillLoop(_Loop):
    def __init__(self, engine: Any, channel: Any, spec: WorkerSpec, kv_groups: dict[int, Any]):
        super().__init__(engine, channel, spec, kv_groups)
        self.decode_rank: dict[str, int] = {}  # requests in the engine -> their decode worker
        self.held: dict[str, _Held] = {}

    def on_message(self, src: int, message: tuple) -> None:
        kind, rid = message[0], message[1]
        if kind == "add":
            _, _, prompt, params, decode_rank = message
            try:
                self.engine.add_request(rid, prompt, params)
                self.decode_rank[rid] = decode_rank
            except Exception as exc:  # the engine's own checks: a clear message for the client
                self.outbox.append(_error(rid, f"{type(exc).__name__}: {exc}"))
        elif kind == "abort":
            if rid in self.held:
                self.held[rid].aborted = True  # released when the decode worker answers
            else:
                self.engine.abort(rid)
        elif kind == "go":
            _, _, tag, first_block = message
            held = self.held[rid]
            self._start_send(rid, held, held.blocks[first_block:], tag)
        elif kind == "refuse":
            why = message[2]
            held = self.held.pop(rid)
            self.engine.release_held(held.blocks)
            if why is not None and not held.aborted:
                self.outbox.append(_error(rid, why))
            elif held.aborted:
                self.outbox.append(WireOutput(rid, [], "", True, "abort"))

    def _start_send(self, rid: str, held: _Held, blocks: list[int], tag: int) -> None:
        from servelab.cluster.kv_transfer import send_blocks

        future = self.transfers.submit(send_blocks, self.kv, blocks, held.decode_rank, tag=tag,
                                       timeout_s=self.spec.kv_timeout_s, granularity=self.spec.granularity,
                                       group=self.kv_groups[held.decode_rank])  # fmt: skip
        self.in_flight[future] = rid

    def on_outputs(self, outputs: list) -> None:
        for o in outputs:
            if o.finished or not o.new_token_ids:
                self.decode_rank.pop(o.request_id, None)
                self.outbox.append(_wire(o))
                continue
            # the first token, and the request goes on: its decoding belongs to the decode worker
            rid = o.request_id
            seq = o.seq
            dst = self.decode_rank.pop(rid)
            held = self.held[rid] = _Held(dst, self.engine.detach_prefilled(rid))
            offer = ("offer", rid, list(seq.prompt_token_ids), seq.last_token_id, seq.params, o.logprobs, self.layout)
            if not self.send(dst, offer):
                self._fail_held(rid, held, f"decode worker rank {dst} is lost")

    def on_transfer_done(self, rid: str, future: Future) -> None:
        held = self.held.pop(rid)
        self.engine.release_held(held.blocks)  # sent, or failed: either way the blocks are ours again
        exc = future.exception()
        if exc is not None:
            logger.error("request %s: %s", rid, exc)
            self.outbox.append(_error(rid, f"KV transfer to decode worker rank {held.decode_rank} failed: {exc}"))

    def _fail_held(self, rid: str, held: _Held, why: str) -> None:
        self.held.pop(rid, None)
        self.engine.release_held(held.blocks)
        self.outbox.append(_error(rid, why))

    def on_peer_lost(self, src: int, why: str) -> None:
        super().on_peer_lost(src, why)
        sending = set(self.in_flight.values())
        for rid, held in list(self.held.items()):
            if held.decode_rank == src and rid not in sending:  # a send in flight fails by itself
                self._fail_held(rid, held, f"decode worker rank {src} is lost ({why})")
        for rid, dst in list(self.decode_rank.items()):
            if dst == src:
                self.engine.abort(rid)
                self.decode_rank.pop(rid)
                self.outbox.append(_error(rid, f"decode worker rank {src} is lost ({why})"))


class DecodeLoop(_Loop):
    def __init__(self, engine: Any, channel: Any, spec: WorkerSpec, kv_groups: dict[int, Any]):
        super().__init__(engine, channel, spec, kv_groups)
        self.offers: list[_Offer] = []  # in arrival order; the head waits for blocks
        self.receiving: dict[str, bool] = {}  # request -> aborted while its KV is on its way
        self.tags = itertools.count(1)
        # request -> (KV bytes, transfer s, queue s), until its first output carries them
        self.transfer_stats: dict[str, tuple[int, float, float]] = {}

    def on_message(self, src: int, message: tuple) -> None:
        kind, rid = message[0], message[1]
        if kind == "offer":
            _, _, prompt, first_token, params, logprobs, layout = message
            if layout != self.layout:
                self.send(src, ("refuse", rid, f"KV layouts differ: prefill {layout}, decode {self.layout}"))
                return
            self.offers.append(_Offer(src, rid, prompt, first_token, params, logprobs))
        elif kind == "abort":
            offer = next((o for o in self.offers if o.rid == rid), None)
            if offer is not None:
                self.offers.remove(offer)
                self.send(offer.src, ("refuse", rid, None))  # the prefill worker reports the abort
            elif rid in self.receiving:
                self.receiving[rid] = True
            else:
                self.engine.abort(rid)

    def admit(self) -> None:
        from servelab.cluster.kv_transfer import recv_blocks

        while self.offers:
            offer = self.offers[0]
            try:
                seq = self.engine.reserve_prefilled(offer.rid, offer.prompt, offer.first_token, offer.params)
            except Exception as exc:  # can never fit this worker: fail it now rather than hold it forever
                self.offers.pop(0)
                self.send(offer.src, ("refuse", offer.rid, f"{type(exc).__name__}: {exc}"))
                continue
            if seq is None:
                return  # back-pressure: the head waits, and nobody overtakes it
            self.offers.pop(0)
            first_block = seq.num_cached_tokens // self.kv.block_size
            tag = next(self.tags)
            future = self.transfers.submit(_timed, recv_blocks, self.kv, seq.block_table[first_block:], offer.src,
                                           tag=tag, timeout_s=self.spec.kv_timeout_s,
                                           granularity=self.spec.granularity, group=self.kv_groups[offer.src])  # fmt: skip
            self.in_flight[future] = (offer, seq, time.perf_counter() - offer.arrived_s)
            self.receiving[offer.rid] = False
            if not self.send(offer.src, ("go", offer.rid, tag, first_block)):
                pass  # the receive fails by itself on the lost peer

    def on_transfer_done(self, what: Any, future: Future) -> None:
        offer, seq, queue_s = what
        aborted = self.receiving.pop(offer.rid)
        exc = future.exception()
        if exc is not None or aborted:
            self.engine.cancel_prefilled(seq)
            if aborted:
                self.outbox.append(WireOutput(offer.rid, [], "", True, "abort"))
            else:
                logger.error("request %s: %s", offer.rid, exc)
                self.outbox.append(_error(offer.rid, f"KV transfer from prefill worker rank {offer.src} failed: {exc}"))
            return
        num_bytes, seconds = future.result()
        self.engine.start_prefilled(seq, None if not offer.logprobs else offer.logprobs[0])
        self.transfer_stats[offer.rid] = (num_bytes, seconds, queue_s)

    def on_outputs(self, outputs: list) -> None:
        for o in outputs:
            wire = _wire(o)
            stats = self.transfer_stats.pop(o.request_id, None)
            if stats is not None:
                wire.kv_bytes, wire.transfer_s, wire.queue_s = stats
            self.outbox.append(wire)

    def on_peer_lost(self, src: int, why: str) -> None:
        super().on_peer_lost(src, why)
        for offer in [o for o in self.offers if o.src == src]:
            self.offers.remove(offer)
            self.outbox.append(_error(offer.rid, f"prefill worker rank {src} is lost ({why})"))


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    num_bytes = fn(*args, **kwargs)
    return num_bytes, time.perf_counter() - t0
