"""What one accelerator offers the cost model: memory, bandwidth, peak rates, interconnect, price.
The catalog of them is servelab/spec/hardware.py; a hardware file describes one more
(servelab/spec/hardware_file.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.spec.kernels import KernelProfile


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    # dense FLOP/s per compute dtype: "bf16", "fp8", "int8" (int8 in OP/s)
    peak_flops: dict[str, float] = field(hash=False)
    # None: no device-to-device link (a CPU host), so tensor parallelism is refused.
    interconnect_bytes_per_s: float | None = None
    price_per_hour_usd: float | None = None
    description: str = ""
    # Where memory, bandwidth, peaks and link come from (a datasheet, or the hardware file).
    datasheet: str = field(default="", compare=False)
    # The SM (or CU) generation: parts that share it run the same kernels ("hopper", "ampere", ...).
    architecture: str = ""
    # Measured GEMM, attention and collective fits with their provenance (kernel_fits.json); None:
    # the cost model extrapolates from its end-to-end defaults.
    kernels: KernelProfile | None = field(default=None, hash=False, compare=False)

    @property
    def provenance(self) -> str:
        """Where the cost model's parameters for this part come from."""
        k = self.kernels
        figures = f"memory, bandwidth, peaks and link from {self.datasheet or 'no stated source'}"
        if k is None:
            return (
                "extrapolated: datasheet peaks at the end-to-end Efficiency defaults fitted on A100 and H100 runs "
                f"(docs/fidelity.md); {figures}"
            )
        parts = [
            f"measured kernels: GEMMs ({', '.join(k.gemm)}) from {k.source} ({k.ref})",
            f"attention {k.attention_source}",
        ]
        if k.collectives is not None:
            parts.append(f"collectives from {k.collectives.source} ({k.collectives.ref})")
        if k.steps is not None:
            sharpness = ", ".join(f"{dtype} {p:g}" for dtype, p in k.steps.sharpness.items())
            parts.append(f"end-to-end overlap sharpness ({sharpness}) fitted on {k.steps.source} ({k.steps.ref})")
        return "; ".join([*parts, figures])

    def peak_flops_per_s(self, compute_dtype: str = "bf16") -> float:
        """The matmul rate for a compute dtype. Hardware without FP8/INT8 tensor cores (A100 has no
        FP8) runs such weights weight-only: dequantized to BF16, at the BF16 rate. Without an fp32
        entry, fp32 matmuls run on TF32 tensor cores: half the dense BF16 rate on every catalog part."""
        if compute_dtype in self.peak_flops:
            return self.peak_flops[compute_dtype]
        return self.peak_flops["bf16"] / 2 if compute_dtype == "fp32" else self.peak_flops["bf16"]

    def ridge_flops_per_byte(self, compute_dtype: str = "bf16") -> float:
        """Arithmetic intensity above which a kernel is compute-bound at peak rates."""
        return self.peak_flops_per_s(compute_dtype) / self.bandwidth_bytes_per_s
