"""Opt-in int8 linears for CPU (`EngineArgs(quantization="int8")`, `--quantization int8`).

Why: decode on a CPU is bound by the bytes of weights it streams, and batched decode and prefill
by the GEMMs. fbgemm's dynamic-quantized linear keeps each weight as int8 with one scale per
output channel (a quarter of the fp32 bytes) and quantizes the activations per tensor on the
fly, then multiplies in int8 with AVX2 kernels. Measured on this AVX2 host (1 thread, all 121
SmolLM2-135M matrices, weights streamed from DRAM): batch 1 54 -> 25 ms, 32 rows 306 -> 154 ms,
512 rows (one layer) 95 -> 53 ms. `torch._weight_int8pack_mm` (int8 weights, fp32 activations)
would keep the activations exact but has no AVX2 kernel: 4x *slower* than fp32 here.

What it costs: numerics. Each linear's output moves by ~1-2% relative (7-bit activations,
`reduce_range`, because AVX2's int8 multiply-add saturates int16 sums), and since the activation
scale is per tensor, a row's result depends on the other rows in the step: int8 output is not
batch-invariant, unlike the default fp32 path. Hence opt-in, and benchmarked separately.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from servelab.errors import InvalidArgument

QUANTIZATIONS = ("int8",)


def check_int8_supported() -> None:
    engines = torch.backends.quantized.supported_engines
    if not {"x86", "fbgemm"} & set(engines):
        raise InvalidArgument(
            f"quantization 'int8' needs torch's x86/fbgemm quantized engine, which this build lacks "
            f"(supported engines: {', '.join(engines)})",
            param="quantization",
        )


@dataclass(slots=True)
class Int8Linear:
    """y = x @ W^T + b with W stored as packed int8 (per output channel scales)."""

    packed: torch.ScriptObject
    shape: tuple[int, int]  # [out, in] as the fp32 weight was
    has_bias: bool = False

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.detach().float().contiguous()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch flags quantized tensor creation as deprecated; the kernels remain
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
        return cls(packed, (w.shape[0], w.shape[1]), bias is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)

    def numel(self) -> int:
        """Parameters, the packed bias included."""
        return self.shape[0] * (self.shape[1] + self.has_bias)

    @property
    def nbytes(self) -> int:
        out, n_in = self.shape
        return out * n_in + 8 * out + 4 * out * self.has_bias  # int8 weights, fp64 scales, fp32 bias
