"""ggml's tensor types, as its `type_traits` table names them: the one table of GGUF block formats.

A GGUF tensor's header stores its type id; the type fixes how many weights a block holds and how
many bytes the block takes, scales included. The GGUF reader sizes tensors from this table, the
cost model prices `--dtype q4_1` from it, and the engine's block kernels (runtime/block_quant.py)
take the formats that carry a kernel code. Pure Python: no numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kernel(Enum):
    """Which of our CPU block kernels (runtime/csrc/block_quant_linear.c) multiply a format."""

    NONE = "none"  # dequantized to the compute dtype at load
    PANEL = "panel"  # the panel kernel only (any row count up to block_quant.max_rows)
    PANEL_AND_ROWS = "panel+rows"  # also the in-register kernel for steps of a few rows


@dataclass(frozen=True, slots=True)
class GGMLType:
    name: str  # ggml's name, upper case: "Q4_K"
    type_id: int  # enum ggml_type, as a GGUF tensor header stores it
    block_weights: int  # weights per block (1 for plain floats and integers)
    block_bytes: int  # bytes per block, scales and minimums included
    # The format code our C kernels use for it (the enum in block_quant_linear.c), or None.
    kernel_code: int | None = None
    kernel: Kernel = Kernel.NONE
    # A llama.cpp weight format the cost model prices as a `--dtype` (block formats ggml uses
    # for weights; Q8_1 and Q8_K hold activations only, the IQ and TQ families are not priced).
    weight_format: bool = False

    @property
    def is_block_format(self) -> bool:
        return self.block_weights > 1

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_weights

    def row_bytes(self, row_weights: int) -> int:
        """Bytes of `row_weights` weights in this type; rows are whole blocks."""
        if row_weights % self.block_weights:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_weights} weights, not {row_weights}")
        return row_weights // self.block_weights * self.block_bytes


_K = Kernel
# ggml.h's enum ggml_type and ggml.c's type_traits (block sizes from ggml-common.h's structs).
# Ids 4, 5, 31-33 and 36-38 belong to formats ggml has removed.
GGML_TYPES: tuple[GGMLType, ...] = (
    GGMLType("F32", 0, 1, 4, kernel_code=5, kernel=_K.PANEL),  # the panel kernel in deterministic mode
    GGMLType("F16", 1, 1, 2),
    GGMLType("Q4_0", 2, 32, 18, kernel_code=1, kernel=_K.PANEL_AND_ROWS, weight_format=True),
    GGMLType("Q4_1", 3, 32, 20, kernel_code=2, kernel=_K.PANEL_AND_ROWS, weight_format=True),
    GGMLType("Q5_0", 6, 32, 22, weight_format=True),
    GGMLType("Q5_1", 7, 32, 24, weight_format=True),
    GGMLType("Q8_0", 8, 32, 34, kernel_code=0, kernel=_K.PANEL_AND_ROWS, weight_format=True),
    GGMLType("Q8_1", 9, 32, 36),
    GGMLType("Q2_K", 10, 256, 84, weight_format=True),
    GGMLType("Q3_K", 11, 256, 110, weight_format=True),
    GGMLType("Q4_K", 12, 256, 144, kernel_code=3, kernel=_K.PANEL, weight_format=True),
    GGMLType("Q5_K", 13, 256, 176, weight_format=True),
    GGMLType("Q6_K", 14, 256, 210, kernel_code=4, kernel=_K.PANEL, weight_format=True),
    GGMLType("Q8_K", 15, 256, 292),
    GGMLType("IQ2_XXS", 16, 256, 66),
    GGMLType("IQ2_XS", 17, 256, 74),
    GGMLType("IQ3_XXS", 18, 256, 98),
    GGMLType("IQ1_S", 19, 256, 50),
    GGMLType("IQ4_NL", 20, 32, 18),
    GGMLType("IQ3_S", 21, 256, 110),
    GGMLType("IQ2_S", 22, 256, 82),
    GGMLType("IQ4_XS", 23, 256, 136),
    GGMLType("I8", 24, 1, 1),
    GGMLType("I16", 25, 1, 2),
    GGMLType("I32", 26, 1, 4),
    GGMLType("I64", 27, 1, 8),
    GGMLType("F64", 28, 1, 8),
    GGMLType("IQ1_M", 29, 256, 56),
    GGMLType("BF16", 30, 1, 2),
    GGMLType("TQ1_0", 34, 256, 54),
    GGMLType("TQ2_0", 35, 256, 66),
    GGMLType("MXFP4", 39, 32, 17),
    GGMLType("NVFP4", 40, 64, 36),
    GGMLType("Q1_0", 41, 128, 18),
)

GGML_TYPE_BY_ID: dict[int, GGMLType] = {t.type_id: t for t in GGML_TYPES}
GGML_TYPE_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES}
