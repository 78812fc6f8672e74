"""Accelerator catalog: memory, bandwidth, dense tensor-core peaks and interconnect, from the
vendors' public datasheets.

Conventions, so that every entry means the same thing:
- memory_bytes is the marketed capacity in decimal bytes (80 GB = 80e9). The usable figure that
  nvidia-smi reports is slightly larger (81,559 MiB on an H100), so this errs on the safe side.
- peak_flops are *dense* rates. Datasheets print the 2:4-sparsity figure in bold and the dense one
  beside it (or not at all); the dense one is half. Serving never runs structured-sparse weights.
- interconnect_bytes_per_s is one direction of the GPU-to-GPU link (NVLink, Infinity Fabric or
  PCIe), which is what a ring all-reduce is limited by; datasheets quote both directions summed.
- price_per_hour_usd is a rough on-demand cloud price guess (2025) for cost-per-token
  estimates, not a quote; pass your own to the planner.
"""

from __future__ import annotations

from dataclasses import replace

from servelab.errors import InvalidArgument
from servelab.spec.hardware_file import is_hardware_file, load_hardware_file, resolve_path, shipped_files
from servelab.spec.hardware_spec import HardwareSpec
from servelab.spec.kernels import GemmEfficiency, load_fits

TB = 1e12
GB = 1e9
TFLOPS = 1e12


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3, 3.35 TB/s;
    # BF16 1,979 TFLOPS / FP8 3,958 TFLOPS / INT8 3,958 TOPS "with sparsity" -> dense 989.4 /
    # 1,979 / 1,979. NVLink 4: 900 GB/s bidirectional -> 450 GB/s each way.
    "h100-sxm": HardwareSpec(
        name="h100-sxm",
        memory_bytes=80 * GB,
        bandwidth_bytes_per_s=3.35 * TB,
        peak_flops={"bf16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS, "int8": 1978.9 * TFLOPS},
        interconnect_bytes_per_s=450 * GB,
        price_per_hour_usd=3.00,
        description="NVIDIA H100 SXM5 80GB",
        datasheet="the NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100)",
        architecture="hopper",
    ),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s;
    # same Hopper tensor cores as H100 SXM (BF16 1,979 / FP8 3,958 sparse -> 989.4 / 1,979 dense).
    # NVLink 4: 900 GB/s bidirectional.
    "h200": HardwareSpec(
        name="h200",
        memory_bytes=141 * GB,
        bandwidth_bytes_per_s=4.8 * TB,
        peak_flops={"bf16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS, "int8": 1978.9 * TFLOPS},
        interconnect_bytes_per_s=450 * GB,
        price_per_hour_usd=3.80,
        description="NVIDIA H200 SXM 141GB",
        datasheet="the NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200)",
        architecture="hopper",
    ),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), 80GB SXM: HBM2e 2,039 GB/s;
    # BF16 312 TFLOPS dense (624 sparse), INT8 624 TOPS dense; no FP8 tensor cores.
    # NVLink 3: 600 GB/s bidirectional.
    "a100-80gb": HardwareSpec(
        name="a100-80gb",
        memory_bytes=80 * GB,
        bandwidth_bytes_per_s=2.039 * TB,
        peak_flops={"bf16": 312 * TFLOPS, "int8": 624 * TFLOPS},
        interconnect_bytes_per_s=300 * GB,
        price_per_hour_usd=1.80,
        description="NVIDIA A100 SXM4 80GB",
        datasheet="the NVIDIA A100 80GB SXM datasheet (nvidia.com/en-us/data-center/a100)",
        architecture="ampere",
    ),
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): 24 GB GDDR6, 300 GB/s;
    # BF16 242 / FP8 485 / INT8 485 "with sparsity" -> 121 / 242.5 / 242.5 dense.
    # PCIe Gen4 x16: 64 GB/s bidirectional, no NVLink.
    "l4": HardwareSpec(
        name="l4",
        memory_bytes=24 * GB,
        bandwidth_bytes_per_s=0.300 * TB,
        peak_flops={"bf16": 121 * TFLOPS, "fp8": 242.5 * TFLOPS, "int8": 242.5 * TFLOPS},
        interconnect_bytes_per_s=32 * GB,
        price_per_hour_usd=0.80,
        description="NVIDIA L4 24GB (PCIe)",
        datasheet="the NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4)",
        architecture="ada",
    ),
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): 48 GB GDDR6, 864 GB/s;
    # BF16 362.05 / FP8 733 / INT8 733 dense (733 / 1,466 / 1,466 with sparsity).
    # PCIe Gen4 x16: 64 GB/s bidirectional, no NVLink.
    "l40s": HardwareSpec(
        name="l40s",
        memory_bytes=48 * GB,
        bandwidth_bytes_per_s=0.864 * TB,
        peak_flops={"bf16": 362.05 * TFLOPS, "fp8": 733 * TFLOPS, "int8": 733 * TFLOPS},
        interconnect_bytes_per_s=32 * GB,
        price_per_hour_usd=1.50,
        description="NVIDIA L40S 48GB (PCIe)",
        datasheet="the NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s); PCIe Gen4 x16 link",
        architecture="ada",
    ),
    # AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html):
    # 192 GB HBM3, 5.3 TB/s; BF16 1,307.4 TFLOPS, FP8 2,614.9 TFLOPS, INT8 2,614.9 TOPS dense.
    # Infinity Fabric: 7 links, 896 GB/s aggregate bidirectional -> 448 GB/s each way.
    "mi300x": HardwareSpec(
        name="mi300x",
        memory_bytes=192 * GB,
        bandwidth_bytes_per_s=5.3 * TB,
        peak_flops={"bf16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS, "int8": 2614.9 * TFLOPS},
        interconnect_bytes_per_s=448 * GB,
        price_per_hour_usd=2.50,
        description="AMD Instinct MI300X 192GB",
        datasheet="the AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html)",
        architecture="cdna3",
    ),
    # NVIDIA HGX B200 spec (nvidia.com/en-us/data-center/hgx): per GPU 180 GB HBM3e (1.44 TB per
    # 8-GPU board; the launch figure was 192 GB), 8 TB/s; FP16/BF16 4.5 PF, FP8 9 PF, INT8 9 POPS
    # with sparsity -> 2.25 / 4.5 / 4.5 PF dense. NVLink 5: 1.8 TB/s bidirectional.
    "b200": HardwareSpec(
        name="b200",
        memory_bytes=180 * GB,
        bandwidth_bytes_per_s=8.0 * TB,
        peak_flops={"bf16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS, "int8": 4500 * TFLOPS},
        interconnect_bytes_per_s=900 * GB,
        price_per_hour_usd=5.50,
        description="NVIDIA B200 (HGX) 180GB",
        datasheet="NVIDIA's HGX B200 specification (nvidia.com/en-us/data-center/hgx)",
        architecture="blackwell",
    ),
}


# The measured-kernel fits (benchmarks/gpu_kernels_fit.py) complete the datasheet entries.
for _name, _profile in load_fits().items():
    HARDWARE[_name] = replace(HARDWARE[_name], kernels=_profile)
del _name, _profile


def measured_part(hardware: HardwareSpec, compute_dtype: str) -> HardwareSpec | None:
    """The part whose GEMMs were measured for this compute dtype: the part itself, else a catalog
    part of the same architecture (the same SMs run the same kernels: a hardware file of a Hopper
    part takes the H100's), else None."""
    candidates = [hardware] + [
        h for h in HARDWARE.values() if hardware.architecture and h.architecture == hardware.architecture
    ]
    return next((p for p in candidates if p.kernels is not None and p.kernels.for_dtype(compute_dtype)), None)


def measured_gemm(hardware: HardwareSpec, compute_dtype: str) -> GemmEfficiency | None:
    """The GEMM fit measured for this compute dtype on the part or its architecture, else None."""
    part = measured_part(hardware, compute_dtype)
    return None if part is None or part.kernels is None else part.kernels.for_dtype(compute_dtype)


def get_hardware(name: str) -> HardwareSpec:
    """A catalog name, or a path to a JSON or YAML hardware file (see servelab/spec/hardware_file.py)."""
    if is_hardware_file(name):
        return load_hardware_file(name)
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE)}, or a JSON or YAML hardware file "
            f"(shipped: {', '.join(shipped_files())})",
            param="hardware",
        ) from None


def hardware_ref(text: str) -> str:
    """Validate a --hardware value and return what names it across processes: the catalog name, or
    the hardware file's resolved path."""
    spec = get_hardware(text)
    return str(resolve_path(text)) if is_hardware_file(text) else spec.name
