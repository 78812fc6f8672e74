"""A request's KV blocks from a prefill worker's paged cache into a decode worker's, with
torch.distributed point-to-point sends (gloo on CPU).

Two granularities: `block` sends one tensor per block (every layer's K and V, a contiguous
slice per layer), `layer` one tensor per layer (K and V of every block of the request, gathered
by slot). Every send is posted before the first wait, so gathering the next piece overlaps the
wire; the receiver posts every receive up front and writes each piece into its cache as it
lands. docs/disaggregation.md measures both: block took 0.5-0.9x layer's time here.

Every wait has a deadline: a peer that died fails the transfer at once (gloo sees the closed
connection), one that stopped answering fails it after `timeout_s`. A timeout makes gloo close
every connection of that process group, so each prefill/decode pair gets a group of its own
(pair_groups): a stuck peer takes down only its own pair's transfers, not its other peers'.

Under tensor parallelism the caches are TensorParallelKV (runtime/parallel/kv_shards.py): rank 0
of each worker gathers its ranks' heads into each piece and scatters them on arrival.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from servelab.cluster.disagg_config import DEFAULT_KV_TRANSFER_TIMEOUT_S, GRANULARITIES, DisaggConfig
from servelab.runtime.kv_cache import PagedKVCache
from servelab.errors import InvalidArgument

if TYPE_CHECKING:
    from servelab.runtime.parallel.kv_shards import TensorParallelKV


class KVTransferError(RuntimeError):
    """A request's KV did not cross: its peer died, timed out, or the layouts differ."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What both ends must agree on for blocks to mean the same thing."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, kv: PagedKVCache | TensorParallelKV) -> KVLayout:
        _, layers, kv_heads, _, head_dim = kv.block_shape()  # under TP, every rank's heads
        return cls(layers, kv_heads, head_dim, kv.block_size, str(kv.dtype).removeprefix("torch."))


def pair_groups(prefill_ranks: list[int], decode_ranks: list[int], timeout_s: float) -> dict[int, Any]:
    """One gloo group per (prefill, decode) pair, for its KV transfers. Every rank of the world
    calls it, in the same order (new_group is collective); returns this rank's peers' groups."""
    me = dist.get_rank()
    groups = {}
    for p in prefill_ranks:
        for d in decode_ranks:
            group = dist.new_group([p, d], backend="gloo", timeout=timedelta(seconds=timeout_s))
            if me in (p, d):
                groups[d if me == p else p] = group
    return groups


def join_transfer_groups(disagg: DisaggConfig) -> dict[int, Any]:
    """Every rank calls it once, the front end too: this rank's peers' groups."""
    return pair_groups(disagg.prefill_ranks, disagg.decode_ranks, disagg.kv_timeout_s)


def _isend(tensor: torch.Tensor, dst: int, tag: int, group: Any, group_peer: int | None) -> Any:
    if group_peer is not None:  # torch.distributed's functions only know the world's groups
        return group.send([tensor], group_peer, tag)
    return dist.isend(tensor, dst, group=group, tag=tag)


def _irecv(tensor: torch.Tensor, src: int, tag: int, group: Any, group_peer: int | None) -> Any:
    if group_peer is not None:
        return group.recv([tensor], group_peer, tag)
    return dist.irecv(tensor, src, group=group, tag=tag)


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise InvalidArgument(
            f"KV transfer granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}",
            param="granularity",
        )


def _wait_all(works: list[tuple[Any, torch.Tensor]], deadline: float, on_arrival: Any, what: str) -> None:
    for i, (work, tensor) in enumerate(works):
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("deadline passed")
            work.wait(timedelta(seconds=left))
        except Exception as exc:  # gloo raises RuntimeError for timeouts and closed connections alike
            raise KVTransferError(f"{what}: piece {i + 1} of {len(works)} did not cross ({exc})") from exc
        if on_arrival is not None:
            on_arrival(i, tensor)


def send_blocks(
    kv: PagedKVCache | TensorParallelKV, block_ids: list[int], dst: int, *, tag: int, timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S,
    granularity: str = GRANULARITIES[0], group: Any = None, group_peer: int | None = None,
) -> int:  # fmt: skip
    """Sends the KV of `block_ids` to rank `dst`, whose recv_blocks waits with the same tag and
    granularity. Returns the bytes sent; raises KVTransferError past the deadline. `group_peer`:
    `dst`'s rank in `group` when the group was formed outside the world (channel.pair_link)."""
    _check_granularity(granularity)
    if not block_ids:
        return 0
    deadline = time.monotonic() + timeout_s
    works = []
    if granularity == "layer":
        slots = kv.block_slots(block_ids)
        pieces = (kv.export_layer(layer, slots) for layer in range(kv.num_layers))
    else:
        pieces = (kv.export_block(block) for block in block_ids)
    try:
        for piece in pieces:
            works.append((_isend(piece, dst, tag, group, group_peer), piece))
    except Exception as exc:
        raise KVTransferError(f"KV send to rank {dst} could not start ({exc})") from exc
    _wait_all(works, deadline, None, f"KV send of {len(block_ids)} blocks to rank {dst}")
    return sum(t.nbytes for _, t in works)


def recv_blocks(
    kv: PagedKVCache | TensorParallelKV, block_ids: list[int], src: int, *, tag: int, timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S,
    granularity: str = GRANULARITIES[0], group: Any = None, group_peer: int | None = None,
) -> int:  # fmt: skip
    """Receives send_blocks' KV into this cache's `block_ids` (reserved by the caller). Returns
    the bytes received; raises KVTransferError past the deadline, with some blocks perhaps
    written: the caller frees them."""
    _check_granularity(granularity)
    if not block_ids:
        return 0
    deadline = time.monotonic() + timeout_s
    if granularity == "layer":
        slots = kv.block_slots(block_ids)
        shapes = [kv.layer_shape(len(block_ids))] * kv.num_layers

        def write(i: int, piece: torch.Tensor) -> None:
            kv.import_layer(i, slots, piece)
    else:
        shapes = [kv.block_shape()] * len(block_ids)

        def write(i: int, piece: torch.Tensor) -> None:
            kv.import_block(block_ids[i], piece)

    works = []
    try:
        for shape in shapes:
            piece = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            works.append((_irecv(piece, src, tag, group, group_peer), piece))
    except Exception as exc:
        raise KVTransferError(f"KV receive from rank {src} could not start ({exc})") from exc
    _wait_all(works, deadline, write, f"KV receive of {len(block_ids)} blocks from rank {src}")
    return sum(t.nbytes for _, t in works)
