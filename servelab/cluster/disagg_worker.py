"""Prefill and decode workers (`servelab serve --disagg P:D`): cluster/worker_loop.py's step loop,
plus a link to each peer of the other pool and a thread that moves KV blocks.

A request's journey:
1. The front end sends it to a prefill worker, naming the decode worker its router chose. The
   prompt runs there, chunked as usual, and samples the first token. A request that ends on it
   (EOS, max_tokens=1, a stop string) ends there.
2. Otherwise the prefill worker detaches it, holding its KV blocks, and sends the decode worker
   an Offer (prompt, first token, sampling parameters, KV layout).
3. The decode worker queues offers in order and reserves blocks for the head one when its pool
   and sequence budget allow. Back-pressure: a busy decode pool leaves the prefill worker holding
   finished prefills, whose blocks fill its pool, so it admits no more; nothing is dropped.
   Prompt blocks the decode worker already caches are not sent. It answers Go with a tag and
   posts the receives; the prefill worker sends (cluster/kv_transfer.py), then frees its hold.
4. The decode worker writes the blocks, starts the sequence as prefilled and streams every token
   from the first on (TTFT includes the transfer, as in `sim --disagg`).
A transfer that fails frees the hold on one side and the reservation on the other, and ends
the request with an error; so does a lost peer. An abort goes to both workers; a request
between them ends once the decode side has answered, so no transfer is ever left half-posted.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from servelab.cluster import kv_transfer
from servelab.cluster import messages as m
from servelab.cluster.channel import FIRST_DATA_TAG, Link, PeerLost, Rendezvous, pair_link
from servelab.cluster.disagg_config import DisaggConfig
from servelab.cluster.kv_transfer import KVLayout, join_transfer_groups
from servelab.cluster.worker_loop import WorkerLoop
from servelab.core.sequence import FinishReason
from servelab.engine.outputs import EngineOutput

if TYPE_CHECKING:
    from servelab.core.sequence import SamplingParams
    from servelab.engine.grammar_workers import GrammarWorkers
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger("servelab.cluster")

ABORTS_REMEMBERED = 4096  # a decode worker's memory of aborts for requests it has not seen yet
PEER_IDLE_S = 30 * 86400.0  # a peer link may be quiet for as long as the cluster idles; a dead peer shows at once


# ---- between a prefill and a decode worker --------------------------------------------------------


@dataclass(slots=True)
class Offer:
    """Prefill -> decode: a prefilled request whose KV is held for it."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: Any
    first_logprobs: Any
    age_s: float  # since the request's arrival at the front end
    first_scheduled_offset_s: float  # from arrival to its first step on the prefill worker
    prompt_logprobs: list  # when the request asked for them, scored by the prefill
    layout: KVLayout


@dataclass(slots=True)
class Go:
    """Decode -> prefill: blocks are reserved and the receives posted; send from block `first_block`."""

    request_id: str
    tag: int
    first_block: int


@dataclass(slots=True)
class Refuse:
    """Decode -> prefill: drop the hold; `error` ends the request (None: it was aborted)."""

    request_id: str
    error: str | None


# ---- commands on a worker's queue (besides the front end's) ---------------------------------------


@dataclass(slots=True)
class _FromPeer:
    src: int
    message: Any


@dataclass(slots=True)
class _PeerGone:
    src: int
    why: str


class _Bye:
    """A worker that leaves: the last message on a peer link."""


@dataclass(slots=True)
class _PeerBack:
    """A restarted peer's new link, formed off the step loop (m.LinkPeer)."""

    link: Link


@dataclass(slots=True)
class _Unprepared:
    """An offer whose logits processors could not be prepared (e.g. its grammar did not compile
    within the timeout): refused, so that the prefill worker ends the request."""

    src: int
    request_id: str
    error: BaseException


@dataclass(slots=True)
class _Started:
    """A transfer the receiving thread started: the step loop follows it from here."""

    key: Any
    future: Future


class _Wake:
    """A transfer finished: look at it."""


@dataclass(slots=True)
class _Held:
    decode_rank: int
    blocks: list[int]
    aborted: bool = False
    sending: bool = False  # its send has started: it ends with the send, whatever else happens


@dataclass(slots=True)
class _Pending:
    src: int
    offer: Offer
    arrived_s: float = field(default_factory=time.perf_counter)


def disagg_loop(engine: LLMEngine, link: Link, config: m.WorkerConfig, rdv: Rendezvous,
                grammars: GrammarWorkers | None = None, peers: dict[int, Link] | None = None) -> WorkerLoop:  # fmt: skip
    """The loop of a prefill or decode worker, over the world's transfer groups (formed here)
    or, for a restarted worker, the pair links it formed with its peers."""
    disagg: DisaggConfig = config.disagg
    if peers is None:
        groups = join_transfer_groups(disagg)
        peers = {peer: Link(peer, group) for peer, group in groups.items()}
    cls = PrefillLoop if config.role == "prefill" else DecodeLoop
    return cls(engine, link, disagg, peers, grammars, rdv)


def _transfer_view(engine: LLMEngine) -> Any:
    """The cache the KV transfers read and write: under tensor parallelism, every rank's heads."""
    from servelab.engine.model_executor import ModelExecutor
    from servelab.runtime.parallel.group import TensorParallelModel

    executor = engine.executor
    if not isinstance(executor, ModelExecutor):
        raise TypeError(
            f"a disaggregated worker moves a real model's KV cache; its engine runs {type(executor).__name__}"
        )
    kv = executor.kv_cache
    model = executor.model
    if not isinstance(model, TensorParallelModel):
        return kv
    from servelab.runtime.parallel.kv_shards import TensorParallelKV

    return TensorParallelKV(kv, model.group)


class _DisaggLoop(WorkerLoop):
    def __init__(self, engine: LLMEngine, link: Link, disagg: DisaggConfig, peers: dict[int, Link],
                 grammars: GrammarWorkers | None = None, rdv: Rendezvous | None = None):  # fmt: skip
        super().__init__(engine, link, grammars)
        self.disagg = disagg
        self.peers = peers  # by rank; a restarted peer's link replaces its predecessor's
        self.rdv = rdv  # where pair links to restarted peers are formed
        self.receivers: list[threading.Thread] = []
        self.kv = _transfer_view(engine)
        self.layout = KVLayout.of(self.kv)
        self.transfers = ThreadPoolExecutor(1, thread_name_prefix="servelab-kv")  # one at a time: they share the link
        self.in_flight: dict[Future, Any] = {}

    def run(self) -> int:
        for peer in list(self.peers.values()):
            self._start_receiver(peer)
        try:
            code = super().run()
        finally:
            self.transfers.shutdown(wait=False, cancel_futures=True)
        # Leaving a process group while a thread waits in it aborts the process: each peer is told
        # goodbye, which ends its receiver for us, and ours end on theirs (or on their exit).
        for peer in self.peers.values():
            try:
                peer.send(_Bye(), timeout_s=2.0)
            except PeerLost:
                pass
        for thread in self.receivers:
            thread.join(timeout=5.0)
        if any(thread.is_alive() for thread in self.receivers):
            logger.warning("servelab worker: a peer did not say goodbye; exiting without leaving the groups")
            logging.shutdown()
            os._exit(code)
        return code

    def _start_receiver(self, peer: Link) -> None:
        thread = threading.Thread(
            target=self._receive_peer, args=(peer,), name=f"servelab-peer{peer.peer}", daemon=True
        )
        self.receivers.append(thread)
        thread.start()

    def _relink(self, command: m.LinkPeer) -> None:
        """Forms the pair link with a restarted peer (blocks until it comes), on a thread of its own."""
        assert self.rdv is not None, "disagg_loop gives every worker the rendezvous its restarted peers link at"
        try:
            link = pair_link(self.rdv, command.name, command.rank)
        except PeerLost as exc:
            logger.error("servelab worker: could not link to restarted peer rank %d (%s)", command.rank, exc)
            return
        self.commands.put(_PeerBack(link))

    def _receive_peer(self, peer: Link) -> None:
        while True:
            try:
                message = peer.recv(timeout_s=PEER_IDLE_S)
            except PeerLost as exc:
                if not self.stopping.is_set():
                    self.commands.put(_PeerGone(peer.peer, str(exc)))
                return
            if isinstance(message, _Bye):
                return
            if not self._on_peer_at_once(peer.peer, message):
                self.arrivals.put(_FromPeer(peer.peer, message))  # through the preparer, in order

    def _on_peer_at_once(self, src: int, message: Any) -> bool:
        """A peer's message that cannot wait for the step loop, handled on its receiving thread."""
        return False

    def _to_peer(self, rank: int, message: Any) -> bool:
        try:
            if rank not in self.peers:
                raise PeerLost(f"rank {rank}: no link to it")
            self.peers[rank].send(message)
            return True
        except PeerLost as exc:
            self.commands.put(_PeerGone(rank, str(exc)))
            return False

    def _start_transfer(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        future = self.transfers.submit(_timed, fn, *args, **kwargs)
        future.add_done_callback(lambda _: self.commands.put(_Wake()))  # an idle loop sleeps on commands
        return future

    def _fail(self, request_ids: list[str], why: str) -> None:
        if request_ids:
            self._send(m.RequestsFailed(request_ids, m.WireError("", why), in_step=False))

    def _final(self, request_id: str, reason: str) -> None:
        """A request's last output, sent for one that ended outside the engine."""
        self._send(m.Outputs([EngineOutput(request_id, [], "", True, FinishReason(reason))], 0, self.stats))

    def _on_command(self, command: Any) -> None:
        if isinstance(command, _FromPeer):
            self._on_peer(command.src, command.message)
        elif isinstance(command, m.LinkPeer):
            threading.Thread(target=self._relink, args=(command,), name=f"servelab-relink{command.rank}",
                             daemon=True).start()  # fmt: skip
        elif isinstance(command, _PeerBack):
            self.peers[command.link.peer] = command.link
            self._start_receiver(command.link)
            logger.info("servelab worker: linked to restarted peer rank %d", command.link.peer)
        elif isinstance(command, _PeerGone):
            logger.error("servelab worker: peer rank %d lost (%s)", command.src, command.why)
            self._on_peer_gone(command.src, command.why)
        elif isinstance(command, _Started):
            self.in_flight[command.future] = command.key
        elif not isinstance(command, _Wake):
            super()._on_command(command)

    def _after_step(self) -> None:
        for future in [f for f in self.in_flight if f.done()]:
            self._on_transfer_done(self.in_flight.pop(future), future)

    def _on_peer(self, src: int, message: Any) -> None: ...
    def _on_peer_gone(self, src: int, why: str) -> None: ...
    def _on_transfer_done(self, key: Any, future: Future) -> None: ...


class PrefillLoop(_DisaggLoop):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.decode_rank: dict[str, int] = {}  # requests in the engine -> their decode worker
        self.held: dict[str, _Held] = {}  # prefilled, waiting for (or in) their transfer

    def _admit(self, command: m.AddRequests) -> None:
        assert command.decode_rank is not None, "the front end names each prefill request's decode worker"
        for r in command.requests:
            self.decode_rank[r.request_id] = command.decode_rank
        super()._admit(command)
        for r in command.requests:
            if r.request_id not in self.live:  # refused
                self.decode_rank.pop(r.request_id, None)

    def _take_outputs(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        kept = []
        for out in outputs:
            rid = out.request_id
            if out.finished or not out.new_token_ids or rid not in self.decode_rank:
                if out.finished:
                    self.decode_rank.pop(rid, None)
                kept.append(out)
                continue
            # the first token, and the request goes on: its decoding is the decode worker's
            seq = self.engine.sequence(rid)
            assert seq is not None  # an unfinished output's request is in the engine
            dst = self.decode_rank.pop(rid)
            arrival = seq.arrival_s
            age_s = time.perf_counter() - arrival
            scheduled = (seq.first_scheduled_s or arrival) - arrival
            self.held[rid] = _Held(dst, self.engine.detach_prefilled(rid))
            self.live.discard(rid)
            offer = Offer(rid, list(seq.prompt_token_ids), seq.last_token_id, seq.params, out.logprobs, age_s, scheduled,
                          list(seq.prompt_logprobs), self.layout)  # fmt: skip
            if not self._to_peer(dst, offer):
                self._drop_held(rid, f"decode worker {dst} is lost")
        return kept

    def _drop_held(self, rid: str, error: str | None) -> None:
        held = self.held.pop(rid)
        self.engine.release_held(held.blocks)
        self.stats = self.engine.stats()
        if held.aborted:
            self._final(rid, "abort")
        elif error is not None:
            self._fail([rid], error)

    def _abort_one(self, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is not None:
            held.aborted = True  # ends when the decode worker answers: a Go must still be served
        else:
            self.decode_rank.pop(request_id, None)
            super()._abort_one(request_id)

    def _on_peer_at_once(self, src: int, message: Any) -> bool:
        """A Go starts its send at once: the step loop may be in a long prefill step, while the
        decode worker waits with its receives posted (on this 2-core host that wait was ~3 s of a
        3.5 s mean transfer, docs/disaggregation.md). The held blocks are the send's alone."""
        held = self.held.get(message.request_id) if isinstance(message, Go) else None
        if held is None:
            return False
        held.sending = True
        future = self._start_transfer(kv_transfer.send_blocks, self.kv, held.blocks[message.first_block :], src, tag=message.tag,
                                      timeout_s=self.disagg.kv_timeout_s, granularity=self.disagg.granularity,
                                      group=self.peers[src].group, group_peer=self.peers[src].group_peer)  # fmt: skip
        self.commands.put(_Started(message.request_id, future))
        return True

    def _on_peer(self, src: int, message: Any) -> None:
        if message.request_id not in self.held:
            logger.warning("servelab worker: %s for unknown request %s", type(message).__name__, message.request_id)
        elif isinstance(message, Refuse):
            self._drop_held(message.request_id, message.error)

    def _on_transfer_done(self, rid: str, future: Future) -> None:
        exc = future.exception()
        if exc is None:
            self.held[rid].aborted = False  # sent: the decode worker ends it, aborted or not
        self._drop_held(
            rid, None if exc is None else f"KV transfer to decode worker {self.held[rid].decode_rank} failed: {exc}"
        )

    def _on_peer_gone(self, src: int, why: str) -> None:
        for rid in [
            r for r, h in self.held.items() if h.decode_rank == src and not h.sending
        ]:  # those fail by themselves
            self._drop_held(rid, f"decode worker {src} is lost ({why})")
        doomed = [rid for rid, dst in self.decode_rank.items() if dst == src]
        for rid in doomed:
            super()._abort_one(rid)
            self.decode_rank.pop(rid)
        self._fail(doomed, f"decode worker {src} is lost ({why})")


class DecodeLoop(_DisaggLoop):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.offers: deque[_Pending] = deque()  # in arrival order; the head waits for blocks
        self.receiving: dict[str, bool] = {}  # request -> aborted while its KV is on its way
        # aborts that may have overtaken their offer; most never see one (the request ended on
        # the prefill side), so only the latest are kept: an offer trails its abort by moments
        self.aborted_early: OrderedDict[str, None] = OrderedDict()
        self.tags = itertools.count(FIRST_DATA_TAG)
        self.transfer_records: dict[str, m.KVTransferRecord] = {}  # until the first output carries it

    # An offered request's grammar is compiled here too (it does not cross the link), by the
    # preparer, off the step loop; one that fails is refused at once.
    def _params_to_prepare(self, item: Any) -> list[SamplingParams]:
        if isinstance(item, _FromPeer) and isinstance(item.message, Offer) and item.message.params.edits_logits:
            return [item.message.params]
        return super()._params_to_prepare(item)

    def _request_ids(self, item: Any) -> list[str]:
        if isinstance(item, _FromPeer) and isinstance(item.message, Offer):
            return [item.message.request_id]
        return super()._request_ids(item)

    def _unprepared(self, item: Any, error: BaseException) -> Any:
        if isinstance(item, _FromPeer):
            return _Unprepared(item.src, item.message.request_id, error)
        return super()._unprepared(item, error)

    def _on_command(self, command: Any) -> None:
        if isinstance(command, _Unprepared):
            self.aborted_early.pop(command.request_id, None)
            message = getattr(command.error, "message", None) or str(command.error)
            self._to_peer(command.src, Refuse(command.request_id, f"decode worker could not prepare it: {message}"))
        else:
            super()._on_command(command)

    def _on_peer(self, src: int, message: Any) -> None:
        if not isinstance(message, Offer):
            logger.warning("servelab worker: unexpected %s from rank %d", type(message).__name__, src)
        elif message.request_id in self.aborted_early:
            del self.aborted_early[message.request_id]
            self._to_peer(src, Refuse(message.request_id, None))
        elif message.layout != self.layout:
            self._to_peer(
                src, Refuse(message.request_id, f"KV layouts differ: prefill {message.layout}, decode {self.layout}")
            )
        else:
            self.offers.append(_Pending(src, message))

    def _abort_one(self, request_id: str) -> None:
        pending = next((p for p in self.offers if p.offer.request_id == request_id), None)
        if pending is not None:
            self.offers.remove(pending)
            self._to_peer(pending.src, Refuse(request_id, None))  # the prefill worker ends it
        elif request_id in self.receiving:
            self.receiving[request_id] = True
        elif request_id in self.live:
            super()._abort_one(request_id)
        else:
            self.aborted_early[request_id] = None
            if len(self.aborted_early) > ABORTS_REMEMBERED:
                self.aborted_early.popitem(last=False)

    def _after_step(self) -> None:
        super()._after_step()
        self._reserve()

    def _reserve(self) -> None:
        while self.offers:
            pending = self.offers[0]
            offer = pending.offer
            try:
                seq = self.engine.reserve_prefilled(offer.request_id, offer.prompt_token_ids, offer.first_token_id,
                                                    offer.params, arrival_s=pending.arrived_s - offer.age_s)  # fmt: skip
            except Exception as exc:  # can never fit here: end it now rather than hold it forever
                self.offers.popleft()
                self._to_peer(pending.src, Refuse(offer.request_id, f"decode worker: {exc}"))
                continue
            if seq is None:
                return  # back-pressure: the head waits, and nobody overtakes it
            self.offers.popleft()
            first_block = seq.num_cached_tokens // self.kv.block_size
            tag = next(self.tags)
            self.receiving[offer.request_id] = False
            queue_s = time.perf_counter() - pending.arrived_s
            future = self._start_transfer(kv_transfer.recv_blocks, self.kv, seq.block_table[first_block:], pending.src, tag=tag,
                                          timeout_s=self.disagg.kv_timeout_s, granularity=self.disagg.granularity,
                                          group=self.peers[pending.src].group,
                                          group_peer=self.peers[pending.src].group_peer)  # fmt: skip
            self.in_flight[future] = (pending, seq, queue_s)
            self.stats = self.engine.stats()
            self._to_peer(pending.src, Go(offer.request_id, tag, first_block))  # if lost, the receive fails by itself

    def _on_transfer_done(self, key: Any, future: Future) -> None:
        pending, seq, queue_s = key
        offer = pending.offer
        rid = offer.request_id
        aborted = self.receiving.pop(rid)
        exc = future.exception()
        if exc is not None or aborted:
            self.engine.cancel_prefilled(seq)
            self.stats = self.engine.stats()
            if aborted:
                self._final(rid, "abort")
            else:
                self._fail([rid], f"KV transfer from prefill worker {pending.src} failed: {exc}")
            return
        num_bytes, transfer_s = future.result()
        seq.prompt_logprobs = offer.prompt_logprobs  # the first output carries them to the front end
        seq.first_scheduled_s = seq.arrival_s + offer.first_scheduled_offset_s  # its queueing was the prefill side's
        try:
            self.engine.start_prefilled(seq, offer.first_logprobs[0] if offer.first_logprobs else None)
        except Exception as exc:  # e.g. a grammar this worker cannot compile: end only this request
            self.engine.cancel_prefilled(seq)
            self.stats = self.engine.stats()
            self._fail([rid], f"decode worker could not start the request: {exc}")
            return
        self.live.add(rid)
        self.transfer_records[rid] = m.KVTransferRecord(num_bytes, transfer_s, queue_s)

    def _kv_transfers(self, outputs: list[EngineOutput]) -> list[m.KVTransferRecord]:
        records = (self.transfer_records.pop(out.request_id, None) for out in outputs)
        return [r for r in records if r is not None]

    def _on_peer_gone(self, src: int, why: str) -> None:
        lost = [p for p in self.offers if p.src == src]
        for p in lost:
            self.offers.remove(p)
        self._fail([p.offer.request_id for p in lost], f"prefill worker {src} is lost ({why})")


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    num_bytes = fn(*args, **kwargs)
    return num_bytes, time.perf_counter() - t0
