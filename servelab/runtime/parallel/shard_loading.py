"""Reading only a rank's shard of each weight (sharding.Shard), so no rank holds the whole model.

safetensors: `get_slice` reads the rows or columns asked for. GGUF: a weight's raw blocks are
rows of whole blocks, so a row slice is a slice of the memory map and a column slice is a slice
of each row's bytes, both before dequantization; a column range that splits a block (a K-quant's
256 weights against a slice of 192) is cut after dequantizing that one tensor instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from servelab.runtime.parallel.sharding import Shard, Slice
from servelab.runtime.weight_layout import GGUFTensor, TensorGetter, dequantize_gguf_tensor, hf_name
from servelab.spec.ggml_types import GGML_TYPE_BY_ID, GGML_TYPE_BY_NAME


def safetensors_getter(
    where: dict[str, Any], shard: Shard, fused: Callable[[str], tuple[str, int, int] | None] = lambda name: None
) -> TensorGetter:
    """`build_model`'s getter over safetensors handles (name -> handle) that reads `shard`'s
    slices; `fused(name)`: where a checkpoint that fuses `name` with others keeps its rows
    (weight_layout.fused_rows), whose shard is a row range of the fused tensor."""

    def get(name: str):
        source, first = name, 0
        if name not in where and (found := fused(name)) is not None and found[0] in where:
            source, first, _ = found
        h = where.get(source)
        if h is None:
            return None
        part = shard.slice_of(name)
        if part is None:
            return h.get_tensor(source)
        view = h.get_slice(source)
        if part.dim == 0:
            return view[first + part.start : first + part.stop]
        return view[:, part.start : part.stop]  # row-parallel: o_proj and down_proj, never fused

    return get


def shard_gguf_tensors(tensors: dict[str, GGUFTensor], shard: Shard) -> dict[str, GGUFTensor]:
    """The file's tensors (GGUF names) cut to `shard`'s slices; still views of the memory map
    where the slice falls on block boundaries."""
    out = {}
    for name, t in tensors.items():
        hf = hf_name(name)
        part = None if hf is None else shard.slice_of(hf)
        out[name] = t if part is None else _slice_gguf(t, part)
    return out


def _slice_gguf(t: GGUFTensor, part: Slice) -> GGUFTensor:
    # ggml's shape is reversed: shape[0] is a row's length (the HF columns), shape[1] the rows
    if part.dim == 0 and len(t.shape) > 1:
        shape = (t.shape[0], part.stop - part.start, *t.shape[2:])
        return GGUFTensor(t.name, shape, t.tensor_type, t.data[part.start : part.stop])
    # a column slice, or any slice of a 1-D tensor (one row)
    kind = GGML_TYPE_BY_ID[t.tensor_type]
    if part.start % kind.block_weights or part.stop % kind.block_weights:
        dense = dequantize_gguf_tensor(t)
        cut = dense[..., part.start : part.stop].contiguous().numpy()
        return GGUFTensor(t.name, (cut.shape[-1], *t.shape[1:]), GGML_TYPE_BY_NAME["F32"].type_id,
                          cut.view(np.uint8).reshape(t.data.shape[0], -1))  # fmt: skip
    b0, b1 = kind.row_bytes(part.start), kind.row_bytes(part.stop)
    return GGUFTensor(t.name, (part.stop - part.start, *t.shape[1:]), t.tensor_type, t.data[:, b0:b1])
