"""Links between the front end (rank 0) and the engine workers (ranks 1..N) on torch.distributed.

Every process joins one gloo world through a TCP (env://-style) rendezvous at the front end's
address, then one two-rank group per front-end/worker pair: gloo breaks a whole group when one
of its members dies, so a group per pair keeps a dead worker from taking the others' links
with it. A message is a pickled object sent as two tensors, an int64 length header and the uint8
payload, with their own tags, so that other traffic (KV blocks, later) can share the group on
other tags. Nothing waits forever: every send and receive has a timeout, both ends send a
heartbeat at least every HEARTBEAT_S, so a receive that times out after PEER_TIMEOUT_S means the
peer is dead or wedged, and a link that failed once is dead for good (gloo closes the pair).
On CUDA the same calls would run over NCCL for tensors; control messages stay on gloo.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from servelab.errors import InvalidArgument, ServelabError

HEARTBEAT_S = 1.0  # each end sends something at least this often
PEER_TIMEOUT_S = 30.0  # a link silent for this long is dead (a loaded host may stall a process for seconds)
SEND_TIMEOUT_S = 30.0  # a send waits this long for the peer to take it
JOIN_TIMEOUT_S = 300.0  # default: how long the rendezvous waits for every rank
HANG_TIMEOUT_S = 300.0  # default: a worker whose loop finishes no pass for this long is hung (--worker-hang-timeout)
TAG_HEADER = 1
TAG_PAYLOAD = 2
FIRST_DATA_TAG = 16  # tags from here on are free for bulk data (e.g. KV blocks) on the same groups


class ClusterFailed(ServelabError):
    """The workers did not all join or start."""

    http_status = 503
    error_type = "server_overloaded"


class PeerLost(RuntimeError):
    """The peer of a link died, closed it, or said nothing for PEER_TIMEOUT_S."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and as whom a process joins the cluster. Rank 0 is the front end and hosts the
    rendezvous store at master_addr:master_port."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    timeout_s: float = JOIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise InvalidArgument(f"world size must be at least 2 (a front end and a worker), got {self.world_size}",
                                  param="world_size")  # fmt: skip
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"rank must be in [0, {self.world_size - 1}] for world size {self.world_size}, "
                                  f"got {self.rank}", param="rank")  # fmt: skip
        if not 0 < self.master_port < 65536:
            raise InvalidArgument(f"master port must be in [1, 65535], got {self.master_port}", param="master_port")
        if self.timeout_s <= 0:
            raise InvalidArgument(f"join timeout must be positive, got {self.timeout_s}", param="join_timeout")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **given: Any) -> Rendezvous:
        """Values given win; the rest come from torch's standard MASTER_ADDR, MASTER_PORT, RANK and
        WORLD_SIZE variables (what torchrun and cluster launchers set)."""
        env = dict(os.environ if env is None else env)
        names = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "rank": "RANK", "world_size": "WORLD_SIZE"}
        values: dict[str, Any] = {}
        for field, var in names.items():
            value = given.get(field)
            if value is None:
                if var not in env:
                    raise InvalidArgument(f"--{field.replace('_', '-')} is not given and {var} is not set", param=field)
                value = env[var]
                if field != "master_addr":
                    try:
                        value = int(value)
                    except ValueError:
                        raise InvalidArgument(f"{var}={value!r} is not an integer", param=field) from None
            values[field] = value
        if given.get("timeout_s") is not None:
            values["timeout_s"] = given["timeout_s"]
        return cls(**values)


class Link:
    """Messages to and from one peer over the pair's own process group. `send` is safe from
    several threads; one thread at a time may `recv`."""

    def __init__(self, peer: int, group: Any, group_peer: int | None = None):
        self.peer = peer
        self.group = group
        # A pair formed outside the world (`pair_link`) is addressed by its own ranks, through the
        # group itself: torch.distributed's functions only know the world's groups.
        self.group_peer = group_peer
        self._send_lock = threading.Lock()
        self.failure: str | None = None

    def _isend(self, tensor: Any, tag: int) -> Any:
        import torch.distributed as dist

        if self.group_peer is not None:
            return self.group.send([tensor], self.group_peer, tag)
        return dist.isend(tensor, dst=self.peer, group=self.group, tag=tag)

    def _irecv(self, tensor: Any, tag: int) -> Any:
        import torch.distributed as dist

        if self.group_peer is not None:
            return self.group.recv([tensor], self.group_peer, tag)
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=tag)

    def send(self, message: Any, timeout_s: float = SEND_TIMEOUT_S) -> None:
        import torch

        payload = bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        header = torch.tensor([len(payload)], dtype=torch.int64)
        body = torch.frombuffer(payload, dtype=torch.uint8)
        timeout = timedelta(seconds=timeout_s)
        with self._send_lock:
            self._check()
            try:
                self._isend(header, TAG_HEADER).wait(timeout)
                self._isend(body, TAG_PAYLOAD).wait(timeout)
            except (RuntimeError, ValueError) as exc:
                raise self._lost(exc) from exc

    def recv(self, timeout_s: float = PEER_TIMEOUT_S) -> Any:
        import torch

        self._check()
        timeout = timedelta(seconds=timeout_s)
        try:
            header = torch.empty(1, dtype=torch.int64)
            self._irecv(header, TAG_HEADER).wait(timeout)
            body = torch.empty(int(header.item()), dtype=torch.uint8)
            self._irecv(body, TAG_PAYLOAD).wait(timeout)
        except (RuntimeError, ValueError) as exc:  # ValueError: the group was destroyed meanwhile
            raise self._lost(exc) from exc
        return pickle.loads(body.numpy().tobytes())

    def _check(self) -> None:
        if self.failure is not None:
            raise PeerLost(self.failure)

    def _lost(self, exc: BaseException) -> PeerLost:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        lowered = text.lower()
        if "timed out" in lowered or "timeout" in lowered:
            why = "no message within the timeout"
        elif any(word in lowered for word in ("closed", "reset", "read error", "broken pipe")):
            why = "connection lost (the process exited or crashed)"
        else:
            why = text
        self.failure = self.failure or f"rank {self.peer}: {why}"
        return PeerLost(self.failure)


def star_pairs(world_size: int) -> list[tuple[int, int]]:
    """The front end's link to each worker: (0, 1), (0, 2) ... (0, N)."""
    return [(0, rank) for rank in range(1, world_size)]


def join(rdv: Rendezvous, pairs: Iterable[tuple[int, int]] | None = None) -> dict[int, Link]:
    """Joins the world and returns this rank's links by peer rank. `pairs` (the same list on every
    rank, in the same order) says which ranks get a link; default: the star around rank 0. A
    worker-to-worker pair (prefill to decode, for KV transfer) is one more entry."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise InvalidArgument("this process already belongs to a torch.distributed group: one cluster per process")
    # env:// rather than tcp://: under torchrun, rank 0 then uses the store torchrun's agent
    # already serves on that port (TORCHELASTIC_USE_AGENT_STORE) instead of failing to bind it
    os.environ["MASTER_ADDR"] = rdv.master_addr
    os.environ["MASTER_PORT"] = str(rdv.master_port)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rdv.rank, world_size=rdv.world_size,
        timeout=timedelta(seconds=rdv.timeout_s),
    )  # fmt: skip
    links = {}
    for a, b in star_pairs(rdv.world_size) if pairs is None else pairs:
        group = dist.new_group([a, b], backend="gloo", timeout=timedelta(seconds=PEER_TIMEOUT_S))
        if rdv.rank in (a, b):
            peer = b if rdv.rank == a else a
            links[peer] = Link(peer, group)
    return links


def pair_link(rdv: Rendezvous, name: str, peer: int) -> Link:
    """A link between two processes one of which came after the world formed (a restarted
    worker, linking to the front end or to its disaggregated peers): the world cannot take a new
    member, so the two form a two-rank gloo group of their own through the rendezvous store,
    under `name` (unique per pair and attempt). Both sides call it, each with the other's rank;
    it returns once both have, or raises PeerLost after `rdv.timeout_s`."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rdv.timeout_s)
    try:
        store = dist.TCPStore(rdv.master_addr, rdv.master_port, is_master=False, timeout=timeout)
        me = 0 if rdv.rank < peer else 1
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), me, 2, timedelta(seconds=PEER_TIMEOUT_S))
    except (RuntimeError, ValueError) as exc:  # DistStoreError and kin: the peer never came
        raise PeerLost(f"rank {peer}: did not link within {rdv.timeout_s:g} s ({str(exc).splitlines()[0]})") from exc
    return Link(peer, group, group_peer=1 - me)


def leave() -> None:
    """Leaves the process groups (no collective: safe when peers are gone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer died may refuse; the process is ending anyway
            pass
