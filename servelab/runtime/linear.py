"""The one interface every linear layer of the model has: `y = lin(x)` for x [rows, in].

A linear carries its weight in whatever form it was loaded or quantized to (a dense tensor here;
GGUF blocks in block_quant.BlockQuantLinear; int8 codes or bf16 in quantization's) and its bias,
and picks its own kernel per call. The model holds linear objects and calls them; it never asks
which kind it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from servelab.runtime import native


class Linear(Protocol):
    # every linear is a dataclass: dataclasses.replace makes its variants (a bias folded in, other kernels)
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    bias: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in], as the dense weight is."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes a call with few rows reads (the weight in the form it is read, and the bias)."""
        ...

    def numel(self) -> int:
        """Parameters, the bias included."""
        ...

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32."""
        ...


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(slots=True)
class DenseLinear:
    """A plain weight [out, in] in the compute dtype: torch's GEMM (MKL on CPU, cuBLAS on CUDA)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return _bytes(self.weight) + _bytes(self.bias)

    def numel(self) -> int:
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


# Up to this many rows the transposed head is faster than F.linear (docs/benchmarks.md).
TRANSPOSED_HEAD_MAX_ROWS = 2


@dataclass(slots=True)
class TransposedHead(DenseLinear):
    """An fp32 LM head on the CPU: for the one or two rows of a small decode step, `x @ W^T`
    over a pre-transposed copy streams the head faster than MKL's F.linear; more rows take
    F.linear. Costs one more copy of the head."""

    weight_t: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weight_t = self.weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= TRANSPOSED_HEAD_MAX_ROWS and self.bias is None:
            return x @ self.weight_t
        return F.linear(x, self.weight, self.bias)


HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})  # the weights a HalfLinear holds

# Which path a HalfLinear takes by row count (measured: docs/benchmarks.md, "bf16 storage"): up to
# HALF_GEMV_MAX_ROWS the weight is widened in registers, up to HALF_GEMM_MAX_ROWS once per panel;
# above, widened whole and handed to MKL's F.linear.
HALF_GEMV_MAX_ROWS = 16
HALF_GEMM_MAX_ROWS = 128


@dataclass(slots=True)
class HalfLinear(DenseLinear):
    """A weight [out, in] kept in its checkpoint's bf16 or fp16 under fp32 compute on the CPU:
    csrc/half_linear.c widens it in registers and sums in fp32. Widening a 16-bit float to fp32
    is exact, so this computes what DenseLinear over the widened copy computes (up to the order
    of the fp32 sums) from half the bytes. Many rows (a prefill chunk) widen it whole for MKL."""

    # weight: bf16 or fp16 [out, in], contiguous, CPU (shape, nbytes, numel, dequantize: DenseLinear's)
    kernels: native.NativeKernels = field(kw_only=True)
    # the C kernel at every row count: its two paths sum a row in the same order, whatever the
    # other rows, so the result is batch-invariant (deterministic mode); else MKL for many rows
    invariant: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.shape
        rows = x.numel() // in_features
        if rows > HALF_GEMM_MAX_ROWS and not self.invariant:
            return F.linear(x.float(), self.weight.float(), self.bias)
        flat = x.reshape(rows, in_features).float().contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        rc = self.kernels.half_linear(
            native.KV_FORMATS[self.weight.dtype],
            self.weight.data_ptr(),
            in_features,
            out_features,
            flat.data_ptr(),
            rows,
            None if self.bias is None else self.bias.data_ptr(),
            y.data_ptr(),
            int(rows > HALF_GEMV_MAX_ROWS),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError(
                f"half linear: no memory for the widened panels of a {out_features} x {in_features} weight"
            )
        return y.reshape(*x.shape[:-1], out_features)


def half_linear(weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.NativeKernels | None) -> Linear | None:
    """A HalfLinear over `weight` when it is a bf16 or fp16 CPU tensor and the kernels are there; else None."""
    if kernels is None or weight.dtype not in HALF_DTYPES or weight.device.type != "cpu":
        return None
    if bias is not None:
        bias = bias.float().contiguous()
    return HalfLinear(weight.contiguous(), bias, kernels=kernels)


def lm_head(weight: torch.Tensor, packed: Linear | None) -> Linear:
    """The LM head's linear, chosen once at load: its GGUF blocks or 16-bit weights when it came
    so (they pick their own kernel by row count); a transposed copy for fp32 on the CPU; else
    plain F.linear."""
    if packed is not None:
        return packed
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        return TransposedHead(weight)
    return DenseLinear(weight)


@runtime_checkable
class WrappedLinear(Protocol):
    """A linear that adds communication around the one holding the weight (runtime/parallel/layers.py)."""

    @property
    def inner(self) -> Linear: ...

    def with_inner(self, inner: Linear) -> Linear:
        """The same wrapper around `inner`."""
        ...


def map_weight(fn: Callable[[Linear], Linear], lin: Linear) -> Linear:
    """`fn` applied to the linear that holds the weight, inside any wrapper that adds
    communication around it."""
    return lin.with_inner(map_weight(fn, lin.inner)) if isinstance(lin, WrappedLinear) else fn(lin)
