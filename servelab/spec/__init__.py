"""Model and accelerator specifications: what the cost model reasons about. No heavy imports."""

from servelab.spec.dtypes import KV_DTYPES, WEIGHT_DTYPES, DType, kv_dtype, weight_dtype
from servelab.spec.gguf_reader import gguf_metadata
from servelab.spec.hardware import HARDWARE, HardwareSpec, get_hardware
from servelab.spec.model import MODELS, ModelSpec, get_model

__all__ = [
    "DType",
    "HARDWARE",
    "HardwareSpec",
    "KV_DTYPES",
    "MODELS",
    "ModelSpec",
    "WEIGHT_DTYPES",
    "get_hardware",
    "get_model",
    "gguf_metadata",
    "kv_dtype",
    "weight_dtype",
]
