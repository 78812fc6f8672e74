"""A tensor-parallel engine's KV cache as one whole, for moving a request's KV to another
engine (cluster/kv_transfer.py, `serve --disagg P:D --tensor-parallel-size T`).

Each rank holds its own KV heads. Rank 0 gathers every rank's piece of a block (or a layer) and
concatenates them along the heads, in rank order, so the piece on the wire is what a cache of
all T ranks' heads would export; importing splits it the same way and scatters each rank its
own. Both ends must run the same T (and so the same split); KVLayout carries the concatenated
head count, so a mismatch is refused before anything moves. The commands travel on their own
groups (Groups.kv_control, Groups.kv), so a transfer thread never interleaves with the step
broadcast; a rank serves them on a thread of its own (serve_kv), beside its forward loop. The
blocks being moved belong to no running sequence, so neither side's steps touch them meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from servelab.runtime.parallel.group import broadcast_object, receive_object

HEADS_DIM = {"block": 2, "layer": 1}  # where the heads are in export_block's / export_layer's piece


class TensorParallelKV:
    """Rank 0's cache plus the group's: what kv_transfer's send_blocks and recv_blocks take."""

    def __init__(self, kv: Any, group: Any):
        self.kv = kv  # rank 0's PagedKVCache
        self.group = group  # runtime.parallel.group.TensorParallelGroup
        self.num_layers = kv.num_layers
        self.block_size = kv.block_size
        self.dtype = kv.dtype
        self.device = kv.device

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv.block_slots(block_ids)  # the same block ids and size on every rank

    def block_shape(self) -> tuple[int, ...]:
        return _whole(self.kv.block_shape(), "block", self.group.size)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return _whole(self.kv.layer_shape(num_blocks), "layer", self.group.size)

    def export_block(self, block: int) -> torch.Tensor:
        return self._export(("block", block), self.kv.export_block(block))

    def export_layer(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self._export(("layer", layer, slots), self.kv.export_layer(layer, slots))

    def import_block(self, block: int, piece: torch.Tensor) -> None:
        self.kv.import_block(block, self._import(("block", block), piece))

    def import_layer(self, layer: int, slots: torch.Tensor, piece: torch.Tensor) -> None:
        self.kv.import_layer(layer, slots, self._import(("layer", layer, slots), piece))

    def _export(self, what: tuple, local: torch.Tensor) -> torch.Tensor:
        with self.group.kv_lock:
            groups = self.group.kv_groups()
            broadcast_object(groups.kv_control, ("export", *what))
            parts = [torch.empty_like(local) for _ in range(self.group.size)]
            groups.kv.gather([parts], [local.contiguous()], _root(dist.GatherOptions())).wait()
        return torch.cat(parts, dim=HEADS_DIM[what[0]])

    def _import(self, what: tuple, piece: torch.Tensor) -> torch.Tensor:
        parts = [p.contiguous() for p in piece.chunk(self.group.size, dim=HEADS_DIM[what[0]])]
        with self.group.kv_lock:
            groups = self.group.kv_groups()
            broadcast_object(groups.kv_control, ("import", *what))
            mine = torch.empty_like(parts[0])
            groups.kv.scatter([mine], [parts], _root(dist.ScatterOptions())).wait()
        return mine


def serve_kv(groups: Any, kv: Any, command: tuple | None) -> None:
    """A rank's side of TensorParallelKV from `command` on, until rank 0 sends None (or a group fails)."""
    while command is not None:
        direction, kind, *where = command
        if direction == "export":
            piece = kv.export_block(*where) if kind == "block" else kv.export_layer(*where)
            groups.kv.gather([], [piece.contiguous()], _root(dist.GatherOptions())).wait()
        else:
            shape = kv.block_shape() if kind == "block" else kv.layer_shape(len(where[1]) // kv.block_size)
            mine = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            groups.kv.scatter([mine], [], _root(dist.ScatterOptions())).wait()
            if kind == "block":
                kv.import_block(where[0], mine)
            else:
                kv.import_layer(where[0], where[1], mine)
        command = receive_object(groups.kv_control)


def _whole(shape: tuple[int, ...], kind: str, size: int) -> tuple[int, ...]:
    dim = HEADS_DIM[kind]
    return (*shape[:dim], shape[dim] * size, *shape[dim + 1 :])


def _root(options: Any) -> Any:
    options.rootRank = 0
    return options
