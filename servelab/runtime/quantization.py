"""Opt-in linears for CPU that trade numerics for speed (`--quantization int8` or `bf16`).

int8. Why: decode on a CPU is bound by the bytes of weights it streams, and batched decode and prefill
by the GEMMs. Here each weight is a 7-bit code with a scale and zero point per output channel
(a quarter of the fp32 bytes), each activation row is quantized to int8 on the fly, and the C
kernel in csrc/int8_linear.c (the why of 7 and 8 bits, and of a scale per 64 inputs, is there)
multiplies them with integer multiply-adds. Speed against fp32, fbgemm and torch's own int8
kernels: docs/benchmarks.md, "int8 linears".

What it costs: numerics (each linear's output moves by a percent or two), so the default never
does this. What it keeps: every integer sum is exact and each activation row has its own scales,
so a row's result does not depend on the other rows of the step: greedy output under int8 is the
same whatever else is in the batch.

bf16. Each weight is kept in bf16 and each activation is rounded to bf16. The products are
exact in fp32 and summed in fp32 by csrc/bf16_linear.c: vdpbf16ps on AVX512-BF16, the same
arithmetic elsewhere (the same bits, but for sums under 2^-126, which vdpbf16ps flushes). That
is how bf16 serving engines (vLLM's CPU build, HF transformers in bf16) compute a linear, but
here the residual stream, norms, attention and sampling stay fp32. On AVX512-BF16, prefill's
and batched decode's GEMMs run about twice as fast as the fp32 kernels; bf16 weights are half
of fp32's bytes (against a 4-bit GGUF's blocks they are more). Timings: docs/benchmarks.md,
"bf16 compute". Each row's sums depend on no other row, so it is batch-invariant too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.runtime import native
from servelab.errors import InvalidArgument

PANEL = 16  # outputs a packed panel holds (NP in csrc/int8_linear.c)
GROUP = 64  # inputs one activation scale covers (G there); packed rows are padded to a multiple
MAX_CODE = 127  # weights are 7-bit codes (see csrc/int8_linear.c)


def check_supported(quantization: str) -> native.NativeKernels:
    """The native kernels the quantized linears run on, or a clear error where they cannot load."""
    kernels = native.native_kernels()
    if kernels is None:
        raise InvalidArgument(
            f"quantization {quantization!r} needs servelab's native CPU kernels, unavailable here: {native.load_error}",
            param="quantization",
        )
    return kernels


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (codes uint8 [out, in] in [0, 127], scale fp32 [out], zero point int32 [out])
    with W ~ scale * (codes - zero). The range of each row includes 0, so 0 is exact."""
    w = weight.detach().float()
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scale = (hi - lo) / MAX_CODE
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, zero 0
    zero = torch.round(-lo / scale).clamp(0, MAX_CODE)
    codes = (torch.round(w / scale[:, None]) + zero[:, None]).clamp(0, MAX_CODE)
    return codes.to(torch.uint8), scale.contiguous(), zero.to(torch.int32)


@dataclass(slots=True)
class Int8Linear:
    """y = x @ W^T + b, W as 7-bit codes packed in panels for csrc/int8_linear.c."""

    packed: torch.Tensor  # uint8 [out_pad / 16, kp / 4, 16, 4] (see the C file)
    scale: torch.Tensor  # fp32 [out_pad]; padding rows 0
    zero: torch.Tensor  # int32 [out_pad]
    bias: torch.Tensor | None  # fp32 [out]
    shape: tuple[int, int]  # [out, in] as the fp32 weight was
    kernels: native.NativeKernels

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        kernels = check_supported("int8")
        out_features, in_features = weight.shape
        codes, scale, zero = quantize_weight(weight)
        out_pad, kp = -(-out_features // PANEL) * PANEL, -(-in_features // GROUP) * GROUP
        padded = torch.zeros(out_pad, kp, dtype=torch.uint8)
        padded[:out_features, :in_features] = codes
        packed = padded.view(out_pad // PANEL, PANEL, kp // 4, 4).transpose(1, 2).contiguous()
        pad = out_pad - out_features
        scale = torch.cat([scale, scale.new_zeros(pad)])
        zero = torch.cat([zero, zero.new_zeros(pad)])
        b = None if bias is None else bias.detach().float().contiguous()
        return cls(packed, scale, zero, b, (out_features, in_features), kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.shape
        if x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"int8 linear takes [rows, {in_features}], got {tuple(x.shape)}")
        x = x.float().contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, out_features, dtype=torch.float32)
        if rows == 0:
            return y
        rc = self.kernels.int8_linear(
            self.packed.data_ptr(),
            self.scale.data_ptr(),
            self.zero.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            in_features,
            self.packed.shape[1] * 4,
            out_features,
            x.data_ptr(),
            rows,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError(f"int8 linear: no memory for {rows} x {in_features} quantized activations")
        return y

    def dequantize(self) -> torch.Tensor:
        """The W [out, in] fp32 the codes stand for (for tests and accuracy checks)."""
        out_features, in_features = self.shape
        codes = self.packed.transpose(1, 2).reshape(-1, self.packed.shape[1] * 4)[:out_features, :in_features]
        return self.scale[:out_features, None] * (codes.float() - self.zero[:out_features, None].float())

    def numel(self) -> int:
        """Parameters, the bias included."""
        return self.shape[0] * (self.shape[1] + (self.bias is not None))

    @property
    def nbytes(self) -> int:
        """Bytes a call reads: the codes, scales and zero points (and the bias)."""
        n = self.packed.numel() + 4 * self.scale.numel() + 4 * self.zero.numel()
        return n + (0 if self.bias is None else 4 * self.bias.numel())


BF16_PANEL = 64  # outputs a packed bf16 panel holds (NPO in csrc/bf16_linear.c)


@dataclass(slots=True)
class Bf16Linear:
    """y = x @ W^T + b in bf16 arithmetic with fp32 sums (csrc/bf16_linear.c; the module's doc)."""

    packed: torch.Tensor  # bf16 [out_pad / 64, in_pad / 2, 64, 2] (see the C file), zero-padded
    bias: torch.Tensor | None  # fp32 [out]
    shape: tuple[int, int]  # [out, in]
    kernels: native.NativeKernels

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Bf16Linear:
        kernels = check_supported("bf16")
        out_features, in_features = weight.shape
        w = weight.detach().to(torch.bfloat16)
        # vdpbf16ps reads a subnormal as zero; zeroing them here keeps every ISA level's bits equal
        w = torch.where(w.abs() < torch.finfo(torch.bfloat16).tiny, w * 0, w)
        out_pad, in_pad = -(-out_features // BF16_PANEL) * BF16_PANEL, in_features + in_features % 2
        padded = torch.zeros(out_pad, in_pad, dtype=torch.bfloat16)
        padded[:out_features, :in_features] = w
        packed = padded.view(out_pad // BF16_PANEL, BF16_PANEL, in_pad // 2, 2).transpose(1, 2).contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        return cls(packed, b, (out_features, in_features), kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.shape
        if x.shape[-1] != in_features:
            raise ValueError(f"bf16 linear takes [..., {in_features}], got {tuple(x.shape)}")
        rows = x.numel() // in_features
        flat = x.reshape(rows, in_features).float().contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        rc = self.kernels.bf16_linear(
            self.packed.data_ptr(),
            in_features,
            out_features,
            flat.data_ptr(),
            rows,
            None if self.bias is None else self.bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError(f"bf16 linear: no memory for {rows} x {in_features} rounded activations")
        return y.reshape(*x.shape[:-1], out_features)

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] bf16, as the packed panels hold it."""
        out_features, in_features = self.shape
        return self.packed.transpose(1, 2).reshape(-1, self.packed.shape[1] * 2)[:out_features, :in_features]

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def numel(self) -> int:
        return self.shape[0] * (self.shape[1] + (self.bias is not None))

    @property
    def nbytes(self) -> int:
        """Bytes a call reads: the packed weight (and the bias)."""
        return 2 * self.packed.numel() + (0 if self.bias is None else 4 * self.bias.numel())


# --quantization's choices -> the linear each weight becomes
LINEARS: dict[str, type[Int8Linear] | type[Bf16Linear]] = {"int8": Int8Linear, "bf16": Bf16Linear}
# Their classes: each one kernel at every row count, a row's sums its own (batch-invariant)
QUANTIZED = (Int8Linear, Bf16Linear)
