"""Storage dtypes for weights and the KV cache: bytes per element, and which tensor-core rate a
weight dtype computes at."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    bytes_per_element: float
    # Key into HardwareSpec.peak_flops: the matmul rate this storage format runs at.
    compute_dtype: str


WEIGHT_DTYPES: dict[str, DType] = {
    "bf16": DType("bf16", 2.0, "bf16"),
    # FP16 and BF16 tensor-core rates are equal on every accelerator in the catalog.
    "fp16": DType("fp16", 2.0, "bf16"),
    # W8A8: activations are quantized too, so the matmuls run at the FP8 / INT8 rate.
    "fp8": DType("fp8", 1.0, "fp8"),
    "int8": DType("int8", 1.0, "int8"),
    # Weight-only INT4 (AWQ/GPTQ-style): dequantized to BF16 inside the kernel, so it saves bytes
    # but computes at the BF16 rate. Group scales (~3% more bytes) are ignored.
    "int4": DType("int4", 0.5, "bf16"),
}

KV_DTYPES: dict[str, DType] = {
    "bf16": DType("bf16", 2.0, "bf16"),
    "fp16": DType("fp16", 2.0, "bf16"),
    "fp8": DType("fp8", 1.0, "fp8"),
}

# Activations stay in 16-bit whatever the weight format.
ACTIVATION_BYTES = 2.0


def weight_dtype(name: str) -> DType:
    try:
        return WEIGHT_DTYPES[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown weight dtype {name!r}; choose one of: {', '.join(WEIGHT_DTYPES)}", param="dtype"
        ) from None


def kv_dtype(name: str) -> DType:
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown KV-cache dtype {name!r}; choose one of: {', '.join(KV_DTYPES)}", param="kv_dtype"
        ) from None
