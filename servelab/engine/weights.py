"""Weight loading: a GGUF file (through the `gguf` package) or an HF model directory (through
`safetensors`), dequantized to the compute dtype and fused for serving (QKV, gate/up).

llama.cpp's converter permutes the rows of Q and K of `llama`-architecture models so that its
interleaved RoPE applies; we undo that permutation so the HF rotate-half convention holds and the
same model code serves both formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from servelab.engine import block_quant, native
from servelab.engine.model import LayerWeights, LlamaModel, ModelConfig
from servelab.errors import InvalidArgument, NotFound
from servelab.spec.dtypes import FLOAT_DTYPES

DTYPE_NAMES = {name: getattr(torch, name) for name in FLOAT_DTYPES}  # spec/dtypes.py names them
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2")
SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any  # servelab.engine.tokenizer.Tokenizer
    spec: Any  # servelab.spec.ModelSpec, or None when the spec package cannot describe it
    name: str
    path: Path


# Why auto is float32 on a CPU, for the log line: every fast path computes in fp32.
CPU_AUTO_DTYPE_REASON = (
    "servelab's CPU kernels (packed GGUF blocks, int8, paged attention) compute in float32; bfloat16 runs "
    "plain PyTorch, 4-5x slower at batch-1 decode even on an AVX-512 BF16 host (--dtype overrides)"
)


def resolve_dtype(name: str | None, device: str = "cpu") -> torch.dtype:
    """The compute dtype: `name`, or auto: float32 on a CPU (CPU_AUTO_DTYPE_REASON), bf16 (else
    fp16) on CUDA."""
    if name is not None:
        if name not in DTYPE_NAMES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}", param="dtype")
        return DTYPE_NAMES[name]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument(f"device={device!r} was asked for but no CUDA device is available", param="device")


def load_model(path: str | Path, *, dtype: torch.dtype, device: str = "cpu") -> LoadedModel:
    """Loads a GGUF file or an HF model directory; raises NotFound / InvalidArgument naming the path."""
    check_device(device)
    p = Path(path)
    if not p.exists():
        raise NotFound(f"model {str(path)!r} does not exist (give a .gguf file or an HF model directory)", param="model")
    if p.is_dir():
        return _load_hf_dir(p, dtype, device)
    return _load_gguf(p, dtype, device)


# ---------------------------------------------------------------------------------------- fusing


def _build_model(
    config: ModelConfig,
    get: Callable[[str], torch.Tensor | None],
    dtype: torch.dtype,
    device: str,
    rope_freq_divisors: torch.Tensor | None = None,
    get_packed: Callable[[str], tuple[int, torch.Tensor] | None] | None = None,
) -> LlamaModel:
    """`get(name)` returns an fp32/fp16 CPU tensor in HF layout for an HF-style name, or None.
    `get_packed(name)`, for GGUF files, returns the same weight's (ggml type, raw rows
    [out, row_bytes] uint8) when it is block-quantized, for block_quant's kernels."""
    kernels = None
    if get_packed is not None and dtype == torch.float32 and device == "cpu":
        kernels = native.native_kernels()

    def linear(names: list[str]) -> torch.Tensor | block_quant.BlockQuantLinear:
        dense = cast(torch.cat([need(n) for n in names], dim=0)) if len(names) > 1 else cast(need(names[0]))
        parts = None
        if kernels is not None:
            found = [get_packed(n) for n in names]
            parts = None if any(p is None for p in found) else found
        return block_quant.pack(dense, parts, kernels)

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise InvalidArgument(f"model weights lack the tensor {name!r}", param="model")
        return t

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        bias = None
        if config.qkv_bias:
            bias = cast(torch.cat([need(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0))
        layers.append(
            LayerWeights(
                input_norm=cast(need(p + "input_layernorm.weight")),
                qkv=linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                qkv_bias=bias,
                o=linear([p + "self_attn.o_proj.weight"]),
                post_norm=cast(need(p + "post_attention_layernorm.weight")),
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=linear([p + "mlp.down_proj.weight"]),
            )
        )
    embed = cast(need("model.embed_tokens.weight"))
    head = None if config.tie_word_embeddings else get("lm_head.weight")
    lm_head = embed if head is None else cast(head)
    head_name = "model.embed_tokens.weight" if head is None else "lm_head.weight"
    head_parts = None if kernels is None or (part := get_packed(head_name)) is None else [part]
    packed_head = block_quant.pack(lm_head, head_parts, kernels)
    return LlamaModel(
        config, embed, layers, cast(need("model.norm.weight")), lm_head, rope_freq_divisors,
        lm_head_packed=packed_head if isinstance(packed_head, block_quant.BlockQuantLinear) else None,
    )


def _spec_from(kind: str, source: Any, **kwargs: Any) -> Any:
    """The roofline's ModelSpec from the same metadata; None if the spec package cannot read it."""
    from servelab.spec import ModelSpec
    try:
        return ModelSpec.from_gguf_metadata(source, **kwargs) if kind == "gguf" else ModelSpec.from_hf_config(source)
    except Exception:  # the engine runs even where the cost model cannot describe the model
        return None


# ---------------------------------------------------------------------------------------- HF


def hf_model_config(cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_HF_TYPES:
        raise InvalidArgument(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_HF_TYPES)})", param="model"
        )
    heads = cfg["num_attention_heads"]
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if model_type == "mistral" and cfg.get("sliding_window"):
        # No sliding-window attention here: beyond the window we would be wrong, so stop at it.
        max_pos = min(max_pos, int(cfg["sliding_window"]))
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise InvalidArgument("attention_bias=true (bias on every attention projection) is not supported", param="model")
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        architecture=model_type,
    )


def _load_hf_dir(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors import safe_open

    from servelab.engine.tokenizer import Tokenizer

    config_path = path / "config.json"
    if not config_path.exists():
        raise NotFound(f"model directory {str(path)!r} has no config.json", param="model")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"model directory {str(path)!r} has no *.safetensors weights", param="model")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{str(config_path)!r} is not valid JSON: {exc}", param="model") from exc
    config = hf_model_config(cfg)

    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str) -> torch.Tensor | None:
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    model = _build_model(config, get, dtype, device)
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(model, config, tokenizer, _spec_from("hf", cfg, name=path.name), path.name, path)


# ---------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: per head, rows (0, half, 1, half+1, ...) back to halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (input) dimension
    tensor_type: int
    data: np.ndarray  # raw bytes [rows, row_bytes] (uint8), a view into the memory-mapped file


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Metadata and tensors (memory-mapped, not copied) of a GGUF file.

    gguf.GGUFReader wraps each of the ~100k vocabulary strings in a numpy view, which takes
    seconds per open; we read the metadata with the tokenizer module's struct reader and walk
    the tensor table ourselves.
    """
    import mmap
    import struct

    import gguf

    from servelab.engine.tokenizer import read_gguf_metadata

    metadata = read_gguf_metadata(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        pos = _skip_gguf_kv(buf, 24, kv_count)
        infos = []
        for _ in range(tensor_count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            name = buf[pos + 8 : pos + 8 + n].decode("utf-8")
            pos += 8 + n
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        file_size = len(buf)
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, ttype, offset in infos:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        row_bytes = dims[0] // block * type_bytes
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        begin = data_start + offset
        if begin + rows * row_bytes > file_size:
            raise InvalidArgument(f"model file {str(path)!r} is truncated: tensor {name!r} runs past its end", param="model")
        tensors[name] = GGUFTensor(name, dims, ttype, raw[begin : begin + rows * row_bytes].reshape(rows, row_bytes))
    return metadata, tensors


def _skip_gguf_kv(buf, pos: int, count: int) -> int:
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos = _skip_gguf_value(buf, pos + 4, vtype, sizes)
    return pos


def _skip_gguf_value(buf, pos: int, vtype: int, sizes: dict[int, int]) -> int:
    import struct

    if vtype in sizes:
        return pos + sizes[vtype]
    if vtype == 8:  # string
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == 9:  # array
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in sizes:
            return pos + count * sizes[etype]
        for _ in range(count):
            pos = _skip_gguf_value(buf, pos, etype, sizes)
        return pos
    raise InvalidArgument(f"unknown GGUF metadata value type {vtype}", param="model")


def gguf_model_config(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """`tensor_shapes` are row-major ([out, in]) shapes by GGUF tensor name."""
    arch = metadata.get("general.architecture", "llama")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise InvalidArgument(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})", param="model"
        )

    def field(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    kv_heads = int(field("attention.head_count_kv", heads))
    head_dim = int(field("attention.key_length", 0) or field("rope.dimension_count", 0) or hidden // heads)
    vocab = field("vocab_size") or tensor_shapes["token_embd.weight"][0]
    scaling = None
    scaling_type = field("rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise InvalidArgument(f"GGUF rope scaling {scaling_type!r} is not supported", param="model")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        architecture=arch,
    )


def dequantize_gguf_tensor(t: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as an fp32 CPU tensor in row-major [out, in] (ggml's shape reversed)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    shape = tuple(reversed(t.shape))
    fast = _FAST_DEQUANT.get(qtype.name)
    if fast is not None:
        return fast(torch.from_numpy(np.array(t.data, copy=True))).reshape(shape)
    if qtype == gguf.GGMLQuantizationType.F32:
        arr = t.data.view(np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        arr = t.data.view(np.float16).astype(np.float32)
    else:
        try:
            arr = gguf.quants.dequantize(t.data, qtype)
        except NotImplementedError as exc:
            raise InvalidArgument(
                f"GGUF tensor {t.name!r} has quantization {qtype.name}, which gguf cannot dequantize", param="model"
            ) from exc
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


# The gguf package dequantizes in numpy, block group by block group: ~10 s for SmolLM2's Q4_1.
# The common legacy formats in torch take a fraction of a second; the rest go through gguf.
def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()  # [n, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def _dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 34)
    return _scale(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 18)
    return _scale(b, 0) * (_nibbles(b[:, 2:]) - 8.0)


def _dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 20)
    return _scale(b, 0) * _nibbles(b[:, 4:]) + _scale(b, 2)


def _dequant_f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32)


def _dequant_f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _dequant_bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.bfloat16).float()


_FAST_DEQUANT = {
    "F32": _dequant_f32,
    "F16": _dequant_f16,
    "BF16": _dequant_bf16,
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}


def check_gguf_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise NotFound(f"cannot read model file {str(path)!r}: {exc}", param="model") from exc
    if magic != b"GGUF":
        raise InvalidArgument(
            f"model file {str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "give a .gguf file or an HF model directory",
            param="model",
        )


def _load_gguf(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from servelab.engine.tokenizer import Tokenizer

    check_gguf_magic(path)
    try:
        metadata, tensors = read_gguf_tensors(path)
    except (InvalidArgument, NotFound):
        raise
    except Exception as exc:  # truncated or corrupt: name the file, not a struct traceback
        raise InvalidArgument(f"model file {str(path)!r} is a corrupt or truncated GGUF file: {exc}", param="model") from exc
    shapes = {name: tuple(reversed(t.shape)) for name, t in tensors.items()}
    config = gguf_model_config(metadata, shapes)
    by_hf = {hf: t for name, t in tensors.items() if (hf := _hf_name(name)) is not None}
    permuted = config.architecture in ("llama", "mistral")

    def get(name: str) -> torch.Tensor | None:
        t = by_hf.get(name)
        if t is None:
            return None
        w = dequantize_gguf_tensor(t)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        return w

    def get_packed(name: str) -> tuple[int, torch.Tensor] | None:
        t = by_hf.get(name)
        if t is None or t.tensor_type not in block_quant.GGUF_BLOCK_FORMATS:
            return None
        rows = torch.from_numpy(np.array(t.data, copy=True)).reshape(t.shape[-1], -1)  # [out, row_bytes]
        if permuted and name.endswith("q_proj.weight"):
            rows = unpermute_rope_rows(rows, config.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            rows = unpermute_rope_rows(rows, config.num_kv_heads)
        return t.tensor_type, rows

    divisors = None
    if "rope_freqs.weight" in tensors:  # llama 3.1's scaling, stored as per-dimension divisors
        divisors = dequantize_gguf_tensor(tensors["rope_freqs.weight"]).reshape(-1)
    model = _build_model(config, get, dtype, device, divisors, get_packed)
    tokenizer = Tokenizer.from_gguf(metadata)
    name = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    spec = _spec_from("gguf", metadata, name=name, tie_embeddings=config.tie_word_embeddings)
    return LoadedModel(model, config, tokenizer, spec, name, path)
