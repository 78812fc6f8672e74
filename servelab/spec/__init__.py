"""Model and accelerator specifications: what the cost model reasons about. No heavy imports."""

import os
from typing import Any

from servelab.spec.dtypes import KV_DTYPES, WEIGHT_DTYPES, DType, kv_dtype, weight_dtype
from servelab.spec.hardware import HARDWARE, HardwareSpec, get_hardware
from servelab.spec.model import MODELS, ModelSpec, get_model


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of a GGUF file (lazy: the gguf package pulls in numpy)."""
    from servelab.spec.gguf_meta import gguf_metadata as _gguf_metadata

    return _gguf_metadata(path)


__all__ = [
    "DType", "HARDWARE", "HardwareSpec", "KV_DTYPES", "MODELS", "ModelSpec", "WEIGHT_DTYPES",
    "get_hardware", "get_model", "gguf_metadata", "kv_dtype", "weight_dtype",
]
