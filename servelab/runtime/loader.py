"""Loading a model: find its files, read its description (spec.ModelSpec) and tensors, and hand
them to weight_layout to build the model. A GGUF file goes through the one GGUF reader
(spec/gguf_reader.py), its tensors memory-mapped; an HF directory through `safetensors`. The
model only: the engine loads the tokenizer from the same path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from servelab.runtime import moe
from servelab.runtime.linear import HalfLinear
from servelab.runtime.model import LlamaModel
from servelab.runtime.rope import Rope
from servelab.runtime.weight_layout import (
    GGUFTensor,
    TensorGetter,
    build_model,
    dequantize_gguf_tensor,
    fused_rows,
    gemma_norm_multipliers,
    gguf_getters,
    split_fused_gguf,
)
from servelab.errors import InvalidArgument, NotFound
from servelab.spec.gguf_reader import GGUFFile, read_gguf
from servelab.spec.model import ENGINE_ARCHITECTURES, QKV_BIAS_ARCHS, ModelSpec

# HF model_type / GGUF general.architecture values the engine runs (Qwen2.5 is "qwen2"; Phi-4 "phi3";
# llama.cpp files Mixtral as "llama")
SUPPORTED_ARCHITECTURES = ENGINE_ARCHITECTURES

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaModel
    spec: ModelSpec  # the one description of the model, the engine's and the cost model's
    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """What the engine's flags change in a loaded model; every tensor-parallel rank applies the same."""

    quantization: str | None = None
    deterministic: bool = False
    # GGUF-block linears take int8 dot products from this many rows (None: exact fp32 everywhere)
    q8_min_rows: int | None = None

    def apply(self, model: LlamaModel) -> None:
        if self.quantization is not None:
            model.quantize(self.quantization)
        if self.deterministic:
            model.make_batch_invariant()
        elif self.q8_min_rows is not None and self.quantization is None:
            model.use_q8(self.q8_min_rows)


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument(f"device={device!r} was asked for but no CUDA device is available", param="device")


def load_model(
    path: str | Path, *, dtype: torch.dtype, device: str = "cpu", tp_rank: int = 0, tp_size: int = 1
) -> LoadedModel:
    """Loads a GGUF file or an HF model directory; raises NotFound / InvalidArgument naming the path.
    With `tp_size` > 1, only rank `tp_rank`'s shard (runtime/parallel/sharding.py): the model is
    that rank's, `spec` still the whole model's."""
    check_device(device)
    p = Path(path)
    if not p.exists():
        raise NotFound(
            f"model {str(path)!r} does not exist (give a .gguf file or an HF model directory)", param="model"
        )
    if p.is_dir():
        return _load_hf_dir(p, dtype, device, tp_rank, tp_size)
    return _load_gguf(p, dtype, device, tp_rank, tp_size)


def _shard(spec: ModelSpec, tp_rank: int, tp_size: int):
    if tp_size == 1:
        return None
    from servelab.runtime.parallel.sharding import Shard

    return Shard(spec, tp_rank, tp_size)


def servable_context(spec: ModelSpec) -> int:
    """The longest context the engine serves this model at: all of it. Sliding-window layers
    attend over their window (runtime/ops.py) and keep the whole context in the KV cache."""
    return spec.max_context


def check_servable(spec: ModelSpec) -> None:
    """What the spec can describe but the engine cannot run, refused before any weight is read."""
    if spec.architecture not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgument(
            f"model {spec.name!r}: architecture {spec.architecture!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})", param="model",
        )  # fmt: skip
    if spec.qkv_bias and spec.architecture not in QKV_BIAS_ARCHS:
        raise InvalidArgument(
            "attention_bias=true (bias on every attention projection) is not supported", param="model"
        )
    Rope.from_spec(spec)  # raises on a RoPE scaling the model does not implement


# ---------------------------------------------------------------------------------------- HF


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str, tp_rank: int, tp_size: int) -> LoadedModel:
    from safetensors import safe_open

    if not (path / "config.json").exists():
        raise NotFound(f"model directory {str(path)!r} has no config.json", param="model")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"model directory {str(path)!r} has no *.safetensors weights", param="model")
    spec = ModelSpec.from_hf_config(path, name=path.name)
    check_servable(spec)

    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    where.update(_language_model_names(where))

    def tensor(name: str) -> torch.Tensor | None:
        h = where.get(name)
        if h is not None:
            return h.get_tensor(name)
        if (alias := moe.mixtral_name(name)) is not None and alias in where:
            return where[alias].get_tensor(alias)
        fused = fused_rows(spec, name)
        if fused is None or fused[0] not in where:
            return None
        source, start, rows = fused
        return where[source].get_slice(source)[start : start + rows]

    get: TensorGetter = tensor
    if (shard := _shard(spec, tp_rank, tp_size)) is not None:
        from servelab.runtime.parallel.shard_loading import safetensors_getter

        get = safetensors_getter(where, shard, lambda name: fused_rows(spec, name) or _mixtral_rows(where, name))
    if spec.gemma_block:
        get = gemma_norm_multipliers(get)
    model = build_model(spec if shard is None else shard.local_spec(), get, dtype, device)
    _log_half_storage(model)
    return LoadedModel(model, spec, path.name, path)


class _Renamed:
    """A safetensors handle read under other names than the file's."""

    def __init__(self, handle: Any, names: dict[str, str]):
        self.handle, self.names = handle, names  # our name -> the file's

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.names[name])

    def get_slice(self, name: str) -> Any:
        return self.handle.get_slice(self.names[name])


def _language_model_names(where: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's (Gemma 3's) language-model tensors under the names a text model's
    have: `model.language_model.X` (transformers >= 4.52) or `language_model.model.X` as `model.X`,
    `language_model.lm_head.weight` as `lm_head.weight`. The vision tower's go unread: the engine
    serves text."""
    names = {}
    for name in where:
        if name.startswith("model.language_model."):
            names["model." + name.removeprefix("model.language_model.")] = name
        elif name.startswith("language_model."):
            names[name.removeprefix("language_model.")] = name
    return {ours: _Renamed(where[theirs], {ours: theirs}) for ours, theirs in names.items() if ours not in where}


def _mixtral_rows(where: dict, name: str) -> tuple[str, int, int] | None:
    """Mixtral's checkpoint tensor holding a MoE tensor `name` whole (moe.mixtral_name), as
    (name, first row, rows); None where the checkpoint has no such tensor."""
    alias = moe.mixtral_name(name)
    if alias is None or alias not in where:
        return None
    return alias, 0, where[alias].get_slice(alias).get_shape()[0]


def _log_half_storage(model: LlamaModel) -> None:
    """One line when the checkpoint's 16-bit linears were kept as they are (weights.keeps_half_storage)."""
    kept = [w for layer in model.layers for w in layer.linears() if isinstance(w, HalfLinear)]
    if isinstance(model.lm_head, HalfLinear):
        kept.append(model.lm_head)
    if kept:
        logger.info(
            "weights: %d linears kept in their checkpoint's %s (%.1f MB), widened to float32 in registers: exact, "
            "half the bytes of an fp32 copy (SERVELAB_HALF_WEIGHTS=0 widens them at load)",
            len(kept),
            str(kept[0].weight.dtype).removeprefix("torch."),
            sum(w.nbytes for w in kept) / 1e6,
        )


# ---------------------------------------------------------------------------------------- GGUF


def read_gguf_tensors(path: Path) -> tuple[GGUFFile, dict[str, GGUFTensor]]:
    """The file's header, and its tensors as views into the memory-mapped file (not copied)."""
    gguf = read_gguf(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {
        name: GGUFTensor(
            name, t.shape, t.ggml_type.type_id, raw[t.offset : t.offset + t.nbytes].reshape(t.num_rows, -1)
        )
        for name, t in gguf.tensors.items()
    }
    return gguf, tensors


def _load_gguf(path: Path, dtype: torch.dtype, device: str, tp_rank: int, tp_size: int) -> LoadedModel:
    gguf, tensors = read_gguf_tensors(path)
    name = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    spec = ModelSpec.from_gguf_metadata(
        gguf.metadata, name=name, tensor_shapes={n: t.shape for n, t in gguf.tensors.items()}
    )
    if spec.rope_scaling is not None and spec.rope_scaling.get("rope_type") == "longrope":
        factors = {f"{kind}_factor": tensors.get(f"rope_factors_{kind}.weight") for kind in ("short", "long")}
        if None in factors.values():
            raise InvalidArgument(
                f"GGUF file {str(path)!r} has LongRoPE but lacks rope_factors_short.weight or rope_factors_long.weight",
                param="model",
            )
        lists = {key: dequantize_gguf_tensor(t).reshape(-1).tolist() for key, t in factors.items() if t is not None}
        spec = replace(spec, rope_scaling={**spec.rope_scaling, **lists})
    check_servable(spec)
    tensors = split_fused_gguf(spec, tensors)
    model_spec = spec
    if (shard := _shard(spec, tp_rank, tp_size)) is not None:
        from servelab.runtime.parallel.shard_loading import shard_gguf_tensors

        tensors, model_spec = shard_gguf_tensors(tensors, shard), shard.local_spec()
    get, get_packed = gguf_getters(model_spec, tensors)
    divisors = None
    if "rope_freqs.weight" in tensors:  # llama 3.1's scaling, stored as per-dimension divisors
        divisors = dequantize_gguf_tensor(tensors["rope_freqs.weight"]).reshape(-1)
    model = build_model(model_spec, get, dtype, device, divisors, get_packed)
    _log_half_storage(model)
    return LoadedModel(model, spec, name, path)
