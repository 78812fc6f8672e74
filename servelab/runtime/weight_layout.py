"""Weights into the model's layout: HF and GGUF tensor names onto our layers, llama.cpp's RoPE row
order undone, GGUF blocks dequantized, Q/K/V and gate/up fused, and block-quantized copies kept
for the CPU kernels. Checkpoints that come fused already (Phi-3's qkv_proj and gate_up_proj,
llama.cpp's attn_qkv and fused ffn_up) are read as row ranges of the fused tensor, so sharding
and packing see the separate matrices every other model has.

llama.cpp's converter permutes the rows of Q and K of `llama`-architecture models so that its
interleaved RoPE applies; we undo that permutation so the HF rotate-half convention holds and the
same model code serves both formats. Its MoE files stack each layer's experts into one tensor per
projection ([n_expert, out, in]); each expert is read as its slice of rows, as HF's separate
`mlp.experts.N.*` tensors.

Gemma's RMSNorm multiplies by (1 + weight): HF checkpoints store the weight, llama.cpp's converter
writes 1 + weight into GGUF files, and the model multiplies by what the getters hand it, so the HF
getter adds the 1 (`gemma_norm_multipliers`) and the GGUF one reads the file as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from servelab.runtime import block_quant, moe, native
from servelab.runtime.linear import HALF_DTYPES, DenseLinear, Linear, half_linear
from servelab.runtime.model import LayerWeights, LlamaModel
from servelab.runtime.weights import keeps_half_storage
from servelab.errors import InvalidArgument
from servelab.spec.ggml_types import GGML_TYPE_BY_ID, GGML_TYPE_BY_NAME
from servelab.spec.model import GEMMA_ARCHITECTURES, ModelSpec

# `get(name)`: an fp32, fp16 or bf16 CPU tensor in HF layout for an HF-style name, or None.
TensorGetter = Callable[[str], torch.Tensor | None]
# `get_packed(name)`: a block-quantized weight's (ggml type id, raw rows [out, row_bytes] uint8).
PackedGetter = Callable[[str], tuple[int, torch.Tensor] | None]

# GGUF architectures whose Q and K rows llama.cpp's converter permuted.
ROPE_PERMUTED_ARCHS = ("llama", "mistral")


def build_model(
    spec: ModelSpec,
    get: TensorGetter,
    dtype: torch.dtype,
    device: str,
    rope_freq_divisors: torch.Tensor | None = None,
    get_packed: PackedGetter | None = None,
) -> LlamaModel:
    """The model from its weights by HF name; `get_packed`, for GGUF files, gives block-quantized
    weights' raw blocks for block_quant's kernels."""
    kernels = None
    if get_packed is not None and dtype == torch.float32 and device == "cpu":
        kernels = native.native_kernels()
    keep_half = keeps_half_storage(dtype, device)

    def linear(names: list[str]) -> Linear:
        raw = [need(n) for n in names]
        if keep_half and {t.dtype for t in raw} <= HALF_DTYPES:  # 16-bit weights stay so (linear.HalfLinear)
            half = half_linear(torch.cat(raw, dim=0) if len(raw) > 1 else raw[0], None, native.native_kernels())
            if half is not None:
                return half
        dense = cast(torch.cat(raw, dim=0)) if len(raw) > 1 else cast(raw[0])
        parts = None
        if kernels is not None and get_packed is not None:
            found = [p for n in names if (p := get_packed(n)) is not None]
            parts = found if len(found) == len(names) else None
        return block_quant.pack(dense, parts, kernels)

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise InvalidArgument(f"model weights lack the tensor {name!r}", param="model")
        return t

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    gemma = spec.gemma_block
    # the norm before the MLP: Llama's post_attention_layernorm; Gemma's comes after attention's output
    mlp_norm = "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        bias = None
        if spec.qkv_bias:
            bias = cast(torch.cat([need(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0))
        q_norm = k_norm = None
        if spec.qk_norm:
            q_norm, k_norm = cast(need(p + "self_attn.q_norm.weight")), cast(need(p + "self_attn.k_norm.weight"))
        experts = None
        if spec.is_moe and i not in spec.dense_layers:
            n = range(spec.num_experts)
            experts = moe.MoEMLP(
                router=DenseLinear(cast(need(moe.router_name(p)))),
                gate_up=[linear([moe.expert_name(p, e, "gate_proj"), moe.expert_name(p, e, "up_proj")]) for e in n],
                down=[linear([moe.expert_name(p, e, "down_proj")]) for e in n],
                top_k=spec.num_active_experts,
                normalize=spec.norm_topk_prob,
            )
            if spec.shared_ffn_size:
                shared = [moe.shared_expert_name(p, proj) for proj in ("gate_proj", "up_proj", "down_proj", "gate")]
                experts.shared_gate_up = linear(shared[:2])
                experts.shared_down = linear([shared[2]])
                experts.shared_gate = DenseLinear(cast(need(shared[3])))
        dense = experts is None
        layers.append(
            LayerWeights(
                q_norm=q_norm,
                k_norm=k_norm,
                input_norm=cast(need(p + "input_layernorm.weight")),
                qkv=linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                qkv_bias=bias,
                o=linear([p + "self_attn.o_proj.weight"]),
                post_norm=cast(need(p + mlp_norm)),
                attn_out_norm=cast(need(p + "post_attention_layernorm.weight")) if gemma else None,
                mlp_out_norm=cast(need(p + "post_feedforward_layernorm.weight")) if gemma else None,
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]) if dense else None,
                down=linear([p + "mlp.down_proj.weight"]) if dense else None,
                moe=experts,
            )
        )
    raw_embed = need("model.embed_tokens.weight")
    embed = cast(raw_embed)
    head = None if spec.tie_embeddings else get("lm_head.weight")
    # the largest linear at batch 1: kept 16-bit too (a tied one beside the embedding's fp32 copy)
    head_raw = raw_embed if head is None else head
    half_head = None
    if keep_half and head_raw.dtype in HALF_DTYPES:
        half_head = half_linear(head_raw, None, native.native_kernels())
    if half_head is not None:
        return LlamaModel(spec, embed, layers, cast(need("model.norm.weight")), embed if head is None else head_raw,
                          rope_freq_divisors, lm_head_packed=half_head)  # fmt: skip
    lm_head = embed if head is None else cast(head)
    head_name = "model.embed_tokens.weight" if head is None else "lm_head.weight"
    head_parts = None
    if kernels is not None and get_packed is not None and (part := get_packed(head_name)) is not None:
        head_parts = [part]
    packed_head = block_quant.pack(lm_head, head_parts, kernels)
    return LlamaModel(
        spec,
        embed,
        layers,
        cast(need("model.norm.weight")),
        lm_head,
        rope_freq_divisors,
        lm_head_packed=packed_head if isinstance(packed_head, block_quant.BlockQuantLinear) else None,
    )


def gemma_norm_multipliers(get: TensorGetter) -> TensorGetter:
    """`get` over an HF Gemma checkpoint, every RMSNorm weight w handed over as 1 + w (in fp32, as
    transformers adds it): what the model multiplies by."""

    def multiplier(name: str) -> torch.Tensor | None:
        t = get(name)
        return t.float() + 1.0 if t is not None and name.endswith("norm.weight") else t

    return multiplier


def fused_rows(spec: ModelSpec, name: str) -> tuple[str, int, int] | None:
    """Where a checkpoint that fuses Q/K/V into `qkv_proj` and gate/up into `gate_up_proj`
    (Phi-3) keeps HF tensor `name`: (the fused tensor's name, first row, rows); None for any other."""
    q, kv, ffn = spec.q_size, spec.kv_size, spec.ffn_size
    parts = {
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, ffn),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", ffn, ffn),
    }
    for suffix, (fused, start, rows) in parts.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + fused, start, rows
    return None


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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE layer's router
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",  # Qwen2-MoE's shared expert
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma's four norms a layer (llama.cpp's ffn_norm is the one before the MLP in both).
_GEMMA_GGUF_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF checkpoint's name for a GGUF tensor name; None for tensors the model does not use."""
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        names = _GEMMA_GGUF_LAYER_NAMES if architecture in GEMMA_ARCHITECTURES else _GGUF_LAYER_NAMES
        if rest in names:
            return f"model.layers.{idx}.{names[rest]}"
        if (expert := moe.hf_name_of_gguf_expert(rest)) is not None:
            return f"model.layers.{idx}.{expert}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: per head, rows (0, half, 1, half+1, ...) back to halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (input) dimension
    tensor_type: int  # ggml type id (spec/ggml_types.py)
    data: np.ndarray  # raw bytes [rows, row_bytes] (uint8), a view into the memory-mapped file

    def rows(self, name: str, start: int, count: int) -> GGUFTensor:
        """Rows [start, start + count) of a 2-D weight as tensor `name`: a view, not a copy."""
        return GGUFTensor(name, (self.shape[0], count), self.tensor_type, self.data[start : start + count])


def split_fused_gguf(spec: ModelSpec, tensors: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """llama.cpp's fused tensors (Phi-3's `attn_qkv`, and `ffn_up` holding gate then up where the
    file has no `ffn_gate`) as the separate `attn_q`/`attn_k`/`attn_v` and `ffn_gate`/`ffn_up`."""
    out = dict(tensors)
    q, kv, ffn = spec.q_size, spec.kv_size, spec.ffn_size
    for name, t in tensors.items():
        prefix = name[: name.rfind(".", 0, name.rfind(".")) + 1]  # "blk.N."
        if name.endswith(".attn_qkv.weight"):
            if t.shape[-1] != q + 2 * kv:
                raise InvalidArgument(f"GGUF tensor {name!r} has {t.shape[-1]} rows; the model needs {q + 2 * kv}",
                                      param="model")  # fmt: skip
            del out[name]
            out[prefix + "attn_q.weight"] = t.rows(prefix + "attn_q.weight", 0, q)
            out[prefix + "attn_k.weight"] = t.rows(prefix + "attn_k.weight", q, kv)
            out[prefix + "attn_v.weight"] = t.rows(prefix + "attn_v.weight", q + kv, kv)
        elif name.endswith(".ffn_up.weight") and prefix + "ffn_gate.weight" not in tensors:
            if t.shape[-1] != 2 * ffn:
                raise InvalidArgument(
                    f"GGUF tensor {name!r} has {t.shape[-1]} rows and the file no ffn_gate; a fused gate/up needs "
                    f"{2 * ffn}", param="model")  # fmt: skip
            out[prefix + "ffn_gate.weight"] = t.rows(prefix + "ffn_gate.weight", 0, ffn)
            out[name] = t.rows(name, ffn, ffn)
        elif (stacked := name[len(prefix) : -len(".weight")]) in moe.GGUF_STACKED:
            del out[name]
            experts, rows = t.shape[-1], t.shape[1]  # ggml order: [in, out, n_expert]
            if experts != spec.num_experts:
                raise InvalidArgument(f"GGUF tensor {name!r} stacks {experts} experts; the model has {spec.num_experts}",
                                      param="model")  # fmt: skip
            for e in range(experts):
                part = prefix + moe.gguf_expert_name(stacked, e)
                out[part] = t.rows(part, e * rows, rows)
    return out


def gguf_getters(spec: ModelSpec, tensors: dict[str, GGUFTensor]) -> tuple[TensorGetter, PackedGetter]:
    """`build_model`'s getters over a GGUF file's tensors: HF names, RoPE rows in HF order; dense
    weights dequantized to fp32 (F16 and BF16 ones as they are stored: build_model widens or
    keeps them), packed ones as the file's blocks."""
    by_hf = {hf: t for name, t in tensors.items() if (hf := hf_name(name, spec.architecture)) is not None}
    permuted = spec.architecture in ROPE_PERMUTED_ARCHS

    def rope_rows(name: str, w: torch.Tensor) -> torch.Tensor:
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_rope_rows(w, spec.num_heads)
        if permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute_rope_rows(w, spec.num_kv_heads)
        return w

    def get(name: str) -> torch.Tensor | None:
        t = by_hf.get(name)
        if t is None:
            return None
        stored = _as_stored_16_bit(t)
        return rope_rows(name, dequantize_gguf_tensor(t) if stored is None else stored)

    def get_packed(name: str) -> tuple[int, torch.Tensor] | None:
        t = by_hf.get(name)
        if t is None or t.tensor_type not in block_quant.GGUF_BLOCK_FORMATS:
            return None
        rows = torch.from_numpy(np.array(t.data, copy=True)).reshape(t.shape[-1], -1)  # [out, row_bytes]
        return t.tensor_type, rope_rows(name, rows)

    return get, get_packed


_SIXTEEN_BIT = {"F16": torch.float16, "BF16": torch.bfloat16}


def _as_stored_16_bit(t: GGUFTensor) -> torch.Tensor | None:
    """An F16 or BF16 GGUF tensor in its own dtype, [out, in]; None for any other type."""
    kind = GGML_TYPE_BY_ID.get(t.tensor_type)
    if kind is None or kind.name not in _SIXTEEN_BIT:
        return None
    return torch.from_numpy(np.array(t.data, copy=True)).view(_SIXTEEN_BIT[kind.name]).reshape(tuple(reversed(t.shape)))


def dequantize_gguf_tensor(t: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as an fp32 CPU tensor in row-major [out, in] (ggml's shape reversed)."""
    ggml_type = GGML_TYPE_BY_ID.get(t.tensor_type)
    if ggml_type is None:
        raise InvalidArgument(f"GGUF tensor {t.name!r} has unknown ggml type id {t.tensor_type}", param="model")
    shape = tuple(reversed(t.shape))
    fast = _FAST_DEQUANT.get(ggml_type.name)
    if fast is not None:
        return fast(torch.from_numpy(np.array(t.data, copy=True))).reshape(shape)
    import gguf  # numpy reference dequantization of the formats we do not do in torch

    try:
        arr = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
    except (NotImplementedError, ValueError) as exc:
        raise InvalidArgument(
            f"GGUF tensor {t.name!r} has quantization {ggml_type.name}, which gguf cannot dequantize", param="model"
        ) from exc
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


# The gguf package dequantizes in numpy, block group by block group: ~10 s for SmolLM2's Q4_1.
# The common legacy formats in torch take a fraction of a second; the rest go through gguf.
def _blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    return raw.reshape(-1, GGML_TYPE_BY_NAME[type_name].block_bytes)


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()  # [n, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def _dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, "Q8_0")
    return _scale(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, "Q4_0")
    return _scale(b, 0) * (_nibbles(b[:, 2:]) - 8.0)


def _dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, "Q4_1")
    return _scale(b, 0) * _nibbles(b[:, 4:]) + _scale(b, 2)


def _dequant_f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32)


def _dequant_f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _dequant_bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.bfloat16).float()


# ggml type name -> dequantization in torch.
_FAST_DEQUANT = {
    "F32": _dequant_f32,
    "F16": _dequant_f16,
    "BF16": _dequant_bf16,
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}
