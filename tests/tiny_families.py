"""Test helpers: tiny random models of each family the engine loads, built with transformers' own
config and model classes (so the checkpoint is exactly what `save_pretrained` writes), and the
same model as a GGUF file written the way llama.cpp's convert_hf_to_gguf.py writes it.

`write_family(path, name)` writes an HF directory (config.json, model.safetensors, the tiny BPE
tokenizer of tests/tiny_models.py); `write_gguf(hf_dir, out)` converts it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tests.tiny_models import EOS_TOKEN, IM_END, _write_tokenizer
from tests.tiny_spm import SpmVocab, add_spm_tokenizer, gemma_vocab, llama_vocab, phi3_vocab

VOCAB = 512
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5,
)  # fmt: skip
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Phi-3's LongRoPE: 16 factors (head_dim 32 / 2), growing with the wavelength as the real ones do.
_SHORT = [round(1.0 + 0.05 * i, 3) for i in range(16)]
_LONG = [round(1.0 + 0.5 * i, 3) for i in range(16)]
# Gemma: head_dim 32 (not hidden / heads) and query_pre_attn_scalar equal to it, as the 2B-12B
# models have (GGUF files carry no scalar: llama.cpp takes head_dim); an 8-token window.
GEMMA_WINDOW = 8
_GEMMA = dict(_COMMON, head_dim=32, query_pre_attn_scalar=32, sliding_window=GEMMA_WINDOW, max_position_embeddings=512)

# name -> (transformers config class, its arguments). Each has the detail that changes the numbers.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (  # Llama 3.x: rope_scaling llama3, past original_max_position_embeddings at 64
        "LlamaConfig",
        dict(_COMMON, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=512),
    ),
    "llama-tied": (  # Llama 3.2 1B/3B: tied embeddings
        "LlamaConfig",
        dict(_COMMON, rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=512),
    ),
    "qwen2.5": (  # Qwen2.5: qkv bias
        "Qwen2Config",
        dict(_COMMON, rope_theta=1000000.0, max_position_embeddings=512, use_sliding_window=False),
    ),
    "qwen3": (  # Qwen3: per-head q/k RMSNorm, head_dim 32 (not hidden / heads), no qkv bias
        "Qwen3Config",
        dict(_COMMON, head_dim=32, rope_theta=1000000.0, max_position_embeddings=512),
    ),
    "qwen3-tied": (  # Qwen3 0.6B-4B: tied embeddings too
        "Qwen3Config",
        dict(_COMMON, head_dim=32, rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=True),
    ),
    "phi3": (  # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, LongRoPE from 64 to 256 positions
        "Phi3Config",
        dict(
            _COMMON,
            hidden_size=128,
            num_key_value_heads=4,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG},
            sliding_window=None,
        ),
    ),  # fmt: skip
    "gemma2": (  # Gemma 2: local/global layers, attention and final soft-capping (low enough to bite)
        "Gemma2Config",
        dict(_GEMMA, attn_logit_softcapping=10.0, final_logit_softcapping=30.0),
    ),
    "gemma3": (  # Gemma 3 text: 5 local layers then 1 global, q/k norms, local RoPE base, linear scaling
        "Gemma3TextConfig",
        dict(
            _GEMMA,
            num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "mixtral": (  # Mixtral: 8 experts, top-2, softmax over the chosen two
        "MixtralConfig",
        dict(
            _COMMON,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1000000.0,
            max_position_embeddings=512,
            sliding_window=None,
        ),
    ),
    "qwen3-moe": (  # Qwen3-MoE: per-head q/k norm, moe_intermediate_size, a dense layer (mlp_only_layers)
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            num_hidden_layers=3,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_theta=1000000.0,
            max_position_embeddings=512,
        ),
    ),
    "qwen2-moe": (  # Qwen2-MoE: Q/K/V bias, a shared expert with its sigmoid gate, a dense layer
        "Qwen2MoeConfig",
        dict(
            _COMMON,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_theta=1000000.0,
            max_position_embeddings=512,
            use_sliding_window=False,
        ),
    ),
    "olmoe": (  # OLMoE: q/k norm over the whole projections, top-k weights not renormalised, clip_qkv
        "OlmoeConfig",
        dict(
            _COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=2.0,
            rope_theta=10000.0,
            max_position_embeddings=512,
        ),
    ),
}
# The mixtures of experts among FAMILIES.
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")


def hf_config(name: str, eos_id: int | None = None, pad_id: int | None = None):
    import transformers

    cls, kwargs = FAMILIES[name]
    return getattr(transformers, cls)(**kwargs, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)


def write_family(path: str | Path, name: str, *, seed: int = 0) -> Path:
    """A random `name` model (a FAMILIES key) as an HF directory, its weights scaled like a trained
    model's (activations of order one) so greedy decoding has clear winners."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, VOCAB, seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = hf_config(name, tok.token_to_id(IM_END), tok.token_to_id(EOS_TOKEN))
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # Gemma stores the offset from 1
                offset = 0.0 if config.model_type.startswith("gemma") else 1.0
                p.copy_(offset + 0.1 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif pname == "lm_head.weight":  # untied: spread the logits over several units
                p.copy_(4.0 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:  # transformers keeps experts stacked, [n_expert, out, in]: scale by the input width
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return path


def _llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: Q/K rows into ggml's interleaved RoPE order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # llama.cpp's phi3 keeps gate and up fused in ffn_up
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# llama.cpp stacks each layer's experts into one tensor per projection (Mixtral's w1/w3/w2 too).
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip
# HF model_type -> the GGUF architecture llama.cpp's converter writes it as.
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}  # fmt: skip


def write_gguf(
    hf_dir: Path, out: Path, qtype: str = "F32", *, stack_experts: bool = True, spm: SpmVocab | None = None
) -> Path:
    """The HF directory `write_family` wrote, as llama.cpp's converter writes it (F32 tensors):
    arch llama (Q/K rows permuted, llama3's scaling as `rope_freqs.weight`; Mixtral too), qwen2,
    qwen3, phi3 (LongRoPE as `rope_factors_long/short.weight`, `rope.scaling.attn_factor`), gemma2
    or gemma3 (Gemma2Model/Gemma3Model: 1 added to every norm weight, soft-capping and window keys,
    no RoPE base for gemma2, Gemma 3's embedding cut to the tokenizer's size), qwen2moe, qwen3moe or
    olmoe (MoE: `expert_count`, `expert_used_count`, the `expert_feed_forward_length`, Qwen2-MoE's
    `expert_shared_feed_forward_length` and `*_shexp` tensors, each
    layer's experts stacked per projection beside the router `ffn_gate_inp`); no `output.weight`
    when the embeddings are tied. `qtype` (e.g. "Q8_0"): every matrix but the router in that ggml
    type, as llama-quantize leaves them. `stack_experts` False: one `ffn_gate.E.weight` tensor per
    expert, as converters before the stacking wrote Mixtral. `spm` writes that SentencePiece
    vocabulary (`spm_vocab_for`) instead of the directory's byte-level BPE."""
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH.get(cfg["model_type"], cfg["model_type"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    arch = "gemma3" if arch == "gemma3_text" else arch
    gemma = arch in ("gemma2", "gemma3")
    if arch == "gemma3":
        rope = rope.get("full_attention", rope)  # the global layers'; llama.cpp fixes the local ones
        theta = rope.get("rope_theta", theta)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch != "gemma2":
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if not gemma:
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if gemma:
        if cfg.get("final_logit_softcapping") and arch == "gemma3":
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    if spm is None:
        _add_tokenizer(w, hf_dir, cfg)
    else:
        add_spm_tokenizer(w, spm)

    tensors = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings") or gemma:
        tensors.pop("lm_head.weight", None)
    if arch == "gemma3":  # Gemma3Model.modify_tensors: the rows past the tokenizer's go
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][
            : len(tok["model"]["vocab"]) + len(tok["added_tokens"])
        ]
    layer_names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    extra: dict[str, torch.Tensor] = {}
    kind = rope.get("rope_type", rope.get("type"))
    if arch == "llama" and kind == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_factors(rope, theta, head_dim)
    if arch == "phi3" and kind in ("longrope", "su"):
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        extra["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
        extra["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():  # convert_hf_to_gguf.py's modify_tensors: experts stacked in order
        parts = name.split(".")
        if "experts" in parts:
            i, e = parts[2], int(parts[parts.index("experts") + 1])
            stacks.setdefault(f"blk.{i}.{_EXPERT_NAMES[parts[-2]]}.weight", {})[e] = t
    tensors = {n: t for n, t in tensors.items() if ".experts." not in n}
    for name, by_id in stacks.items():
        if stack_experts:
            extra[name] = torch.stack([by_id[e] for e in sorted(by_id)])
        else:
            extra.update({name.replace("_exps.weight", f".{e}.weight"): t for e, t in by_id.items()})
    for name, t in {**tensors, **extra}.items():
        if name in _TOP_NAMES:
            name = _TOP_NAMES[name]
        elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            name = f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            name = f"blk.{i}.{layer_names[rest]}"
        if gemma and name.endswith("norm.weight"):  # Gemma2Model / Gemma3Model: (1 + w) stored whole
            t = t + 1
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = _llama_cpp_permute(t, heads if "attn_q" in name else kv_heads)
        arr = t.float().contiguous().numpy()
        if qtype != "F32" and arr.ndim >= 2 and not name.endswith("ffn_gate_inp.weight"):
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _llama3_rope_factors(rope: dict, theta: float, head_dim: int):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: llama3 scaling as divisors."""
    import torch

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _add_tokenizer(w, hf_dir: Path, cfg: dict) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(vocab))]
    added = {a["id"]: a["content"] for a in tok["added_tokens"]}
    for i, content in added.items():
        tokens[i] = content
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])


# The tokenizer each family's real GGUF carries (convert_hf_to_gguf.py): SentencePiece for Llama 2,
# Mistral, Mixtral, Phi-3 and Gemma; byte-level BPE ('gpt2', the directory's) for Llama 3 and Qwen.
_SPM_VOCABS = {"llama2": llama_vocab, "mistral": llama_vocab, "mixtral": llama_vocab, "phi3": phi3_vocab,
               "gemma": gemma_vocab, "gemma2": gemma_vocab, "gemma3": gemma_vocab}  # fmt: skip


def spm_vocab_for(family: str, seed: int = 0) -> SpmVocab | None:
    """The SentencePiece vocabulary (VOCAB tokens) `family`'s GGUF carries, or None for a 'gpt2' one."""
    make = _SPM_VOCABS.get(family)
    return None if make is None else make(VOCAB, seed)
