"""The one description of a decoder-only transformer (Llama family: Llama 2/3, Mistral, Qwen2,
Qwen2.5, Qwen3, Phi-3/Phi-4, Gemma 2 and Gemma 3, and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE), parsed from an HF `config.json` or GGUF metadata, and the
catalog of well-known models.

The cost model reads its parameter counts and KV bytes per token; the engine builds its model,
RoPE and KV cache from the same fields. Counts assume the Llama block: RMSNorm, attention with
grouped KV heads (GQA), optional Q/K RMSNorm (per head: Qwen3; over the whole projection:
OLMoE), SwiGLU MLP (gate, up, down), optional MoE routing over SwiGLU experts (with dense-MLP
layers where Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step` put them, and Qwen2-MoE's shared
expert beside the routed ones, scaled by a sigmoid gate). Phi-3's fused
qkv_proj and gate_up_proj hold the same parameters as the separate matrices. Gemma's block has
the same matrices (its GeGLU MLP is SwiGLU's three, with GELU for SiLU) and four norms a layer
instead of two.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from servelab.errors import InvalidArgument, NotFound
from servelab.spec.dtypes import kv_dtype as _kv_dtype
from servelab.spec.dtypes import weight_dtype as _weight_dtype

# HF `model_type` -> whether Q/K/V always carry a bias (Qwen2's do, whatever `attention_bias` says).
_HF_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "phi3": False, "mixtral": False,
                   "gemma2": False, "gemma3_text": False, "gemma3": False, "qwen2_moe": True, "qwen3_moe": False,
                   "olmoe": False}  # fmt: skip
# GGUF `general.architecture` values we read; llama.cpp files Mistral and Mixtral under "llama"
# (older converters wrote "mistral").
_GGUF_ARCHS = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "phi3": False, "gemma2": False,
               "gemma3": False, "qwen2moe": True, "qwen3moe": False, "olmoe": False}  # fmt: skip
# Architectures (HF model_type and GGUF alike) that RMS-normalise each head of Q and K before RoPE.
_QK_NORM_ARCHS = ("qwen3", "gemma3", "qwen3_moe", "qwen3moe")
# ... and those that RMS-normalise the whole Q and K projections (one weight over all heads).
_QK_NORM_WHOLE_ARCHS = ("olmoe",)
# Gemma's block: RMSNorm as (1 + weight), a norm after attention and after the MLP too, GeGLU
# (tanh-approximated GELU), embeddings scaled by sqrt(hidden_size).
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# Whether a MoE renormalises its top-k routing weights to sum to one where the config does not say
# (HF's `norm_topk_prob`; Mixtral always does). llama.cpp hard-codes the same per architecture.
_HF_NORM_TOPK_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": False, "olmoe": False}
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# Architectures whose Q/K/V projections may carry a bias (the engine adds it after the fused QKV).
QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe", "qwen2moe")
# HF model types whose `sliding_window` applies unless `use_sliding_window` says otherwise
# (Qwen2 and Qwen3 configs carry a window they do not use).
_HF_SLIDING_BY_DEFAULT = ("mistral", "mixtral", "phi3", "gemma2", "gemma3_text")
# RoPE scaling names older configs use for the ones HF runs today.
_ROPE_TYPE_ALIASES = {"su": "longrope"}
# What the engine (servelab/runtime) runs; the cost model prices every spec.
ENGINE_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen2moe",
    "qwen3_moe", "qwen3moe", "olmoe",
)  # fmt: skip
ENGINE_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int  # intermediate size of one SwiGLU MLP; of one expert in a MoE
    vocab_size: int
    tie_embeddings: bool
    max_context: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    num_experts: int = 1  # 1 for a dense model
    num_active_experts: int = 1  # experts each token is routed to
    architecture: str = "llama"
    sliding_window: int | None = None  # tokens each query attends back over; None: the whole context
    qk_norm: bool = False  # RMSNorm over each head of Q and of K before RoPE (Qwen3)
    rotary_dim: int | None = None  # leading dimensions of each head that RoPE rotates; None: all of head_dim
    sliding_layers: tuple[int, ...] | None = None  # the layers that attend over sliding_window; None: all
    attention_scale: float | None = None  # of Q·K before the softmax; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits (Gemma 2)
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_theta
    qk_norm_per_head: bool = True  # with qk_norm: one weight per head_dim (Qwen3), else over all of Q / K (OLMoE)
    clip_qkv: float | None = None  # Q, K and V clamped to [-clip, clip] after the projections (OLMoE)
    norm_topk_prob: bool = True  # MoE: the k chosen routing probabilities renormalised to sum to one
    dense_layers: tuple[int, ...] = ()  # MoE: layers with a dense MLP instead of experts (Qwen3-MoE)
    dense_ffn_size: int | None = None  # MoE: intermediate size of those dense MLPs; None: ffn_size
    # MoE: intermediate size of the shared expert every token runs beside its routed ones, its output
    # scaled by sigmoid(a [1, hidden] gate) (Qwen2-MoE); 0: none
    shared_ffn_size: int = 0

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_size",
            "vocab_size",
            "max_context",
            "num_experts",
            "num_active_experts",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_active_experts > self.num_experts:
            raise InvalidArgument(
                f"model {self.name!r}: num_active_experts ({self.num_active_experts}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise InvalidArgument(
                f"model {self.name!r}: dense_layers {list(self.dense_layers)} must be layer indices below "
                f"{self.num_layers}"
            )

    # rope_scaling is a dict, so the generated hash would fail; the other fields identify a spec.
    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                self.num_layers,
                self.hidden_size,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.ffn_size,
                self.vocab_size,
                self.num_experts,
            )
        )

    # ---- shapes -----------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Rows of the Q projection: attention heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of the K (and of the V) projection: KV heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection; with tied embeddings it is the embedding matrix."""
        return self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        q_dim, kv_dim = self.q_size, self.kv_size
        params = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        if self.qkv_bias:
            params += q_dim + 2 * kv_dim
        return params

    @property
    def expert_params_per_layer(self) -> int:
        """One SwiGLU MLP: gate and up (hidden -> ffn) and down (ffn -> hidden)."""
        return 3 * self.hidden_size * self.ffn_size

    @property
    def router_params_per_layer(self) -> int:
        """A MoE layer's router; 0 in a dense model (and in a MoE's dense layers: see num_moe_layers)."""
        return self.hidden_size * self.num_experts if self.is_moe else 0

    @property
    def shared_expert_params_per_layer(self) -> int:
        """A MoE layer's shared expert (a SwiGLU MLP) and its gate; 0 without one."""
        return 3 * self.hidden_size * self.shared_ffn_size + self.hidden_size if self.shared_ffn_size else 0

    @property
    def gemma_block(self) -> bool:
        """Gemma's layer (GEMMA_ARCHITECTURES): (1 + w) norms, four a layer, GeGLU, scaled embeddings."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """Tokens layer `layer`'s queries attend back over (the query's own included); None: all."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts; the rest have one dense MLP."""
        return self.num_layers - len(set(self.dense_layers)) if self.is_moe else 0

    @property
    def dense_mlp_params(self) -> int:
        """One dense layer's SwiGLU MLP (every layer's in a dense model)."""
        return 3 * self.hidden_size * (self.dense_ffn_size or self.ffn_size)

    @property
    def norm_params_per_layer(self) -> int:
        qk = 0
        if self.qk_norm:
            qk = 2 * self.head_dim if self.qk_norm_per_head else self.q_size + self.kv_size
        return (4 if self.gemma_block else 2) * self.hidden_size + qk

    @property
    def mlp_params(self) -> int:
        """Every layer's MLPs together: each MoE layer's experts, shared expert and router, each
        dense layer's MLP."""
        moe = (
            self.num_experts * self.expert_params_per_layer
            + self.router_params_per_layer
            + self.shared_expert_params_per_layer
        )
        return self.num_moe_layers * moe + (self.num_layers - self.num_moe_layers) * self.dense_mlp_params

    @property
    def num_params(self) -> int:
        per_layer = self.attention_params_per_layer + self.norm_params_per_layer
        output = 0 if self.tie_embeddings else self.lm_head_params
        return self.num_layers * per_layer + self.mlp_params + self.embedding_params + output + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches (MoE: only its routed experts, and the shared one)."""
        inactive = (self.num_experts - self.num_active_experts) * self.expert_params_per_layer
        return self.num_params - self.num_moe_layers * inactive

    @property
    def matmul_params_per_token(self) -> int:
        """Active parameters that multiply each token, excluding the LM head (which only runs
        for positions that produce logits) and the input embedding (a row gather, not a matmul)."""
        moe = (
            self.num_active_experts * self.expert_params_per_layer
            + self.router_params_per_layer
            + self.shared_expert_params_per_layer
        )
        dense_layers = self.num_layers - self.num_moe_layers
        bias = self.q_size + 2 * self.kv_size if self.qkv_bias else 0  # added, not multiplied
        return (
            self.num_layers * (self.attention_params_per_layer - bias)
            + self.num_moe_layers * moe
            + dense_layers * self.dense_mlp_params
        )

    @property
    def engine_refusal(self) -> str | None:
        """Why the engine cannot run this model (None: it can); the cost model prices it either way."""
        if self.architecture not in ENGINE_ARCHITECTURES:
            return f"architecture {self.architecture!r}"
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            return "partial rotary embeddings"
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ENGINE_ROPE_TYPES:
            return f"rope scaling {kind!r}"
        if self.qkv_bias and self.architecture not in QKV_BIAS_ARCHS:
            return "attention_bias"
        return None

    def weight_bytes(self, dtype: str = "bf16") -> float:
        return self.num_params * _weight_dtype(dtype).bytes_per_element

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        """K and V for every layer: 2 × layers × KV heads × head_dim × bytes. GQA counts KV heads,
        not attention heads, which is what makes Llama 3's KV cache 4× smaller than MHA's."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _kv_dtype(kv_dtype).bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["num_params"] = self.num_params
        data["num_active_params"] = self.num_active_params
        data["kv_bytes_per_token_bf16"] = self.kv_bytes_per_token("bf16")
        return data

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | os.PathLike[str], *, name: str | None = None
    ) -> ModelSpec:
        """From a Hugging Face `config.json` (a dict, the file, or the model directory)."""
        source = "config.json"
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise NotFound(f"config file {path!r} does not exist", param="config")
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InvalidArgument(f"cannot read {path!r} as JSON: {exc}", param="config") from None
            if not isinstance(config, Mapping):
                raise InvalidArgument(
                    f"{path}: expected a JSON object of model settings, got {type(config).__name__}", param="config"
                )
            source = path
            if name is None:
                name = os.path.basename(os.path.dirname(os.path.abspath(path))) or None
        config = dict(config)
        model_type = config.get("model_type")
        if model_type == "gemma3":  # the multimodal checkpoint: the engine serves its language model
            text = config.get("text_config")
            if not isinstance(text, Mapping):
                raise InvalidArgument(f"{source}: a gemma3 config needs a text_config object", param="config")
            config, model_type = {**text, "model_type": "gemma3_text"}, "gemma3_text"
        if model_type in _GEMMA_DEFAULTS:
            config = _gemma_config(config, model_type, source)
        if model_type not in _HF_MODEL_TYPES:
            raise InvalidArgument(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(_HF_MODEL_TYPES)}",
                param="config",
            )

        def need(key: str) -> int:
            if key not in config:
                raise InvalidArgument(f"config.json ({model_type}) lacks the required key {key!r}", param="config")
            return positive_int(key)

        def positive_int(key: str) -> int:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{source}: {key} must be a positive integer, got {value!r}", param="config")
            return value

        def optional_int(key: str) -> int | None:
            """A positive integer, or None where the key is absent or null."""
            return None if config.get(key) is None else positive_int(key)

        def positive_float(key: str, default: float) -> float:
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise InvalidArgument(f"{source}: {key} must be a positive number, got {value!r}", param="config")
            return float(value)

        def optional_float(key: str) -> float | None:
            return None if config.get(key) is None else positive_float(key, 0.0)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        num_experts = optional_int("num_local_experts") or optional_int("num_experts") or 1
        moe = _hf_moe(config, source, need("num_hidden_layers"), num_experts) if num_experts > 1 else {}
        clip = config.get("clip_qkv")
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf
        ):
            raise InvalidArgument(f"{source}: clip_qkv must be a positive number or null, got {clip!r}", param="config")
        window = None  # read only where it applies: Qwen2 configs carry one they do not use
        if config.get("use_sliding_window", model_type in _HF_SLIDING_BY_DEFAULT):
            window = optional_int("sliding_window")
        rope_scaling, rope_theta, rotary_fraction = _hf_rope(config, source)
        head_dim = optional_int("head_dim") or hidden // heads
        num_layers = need("num_hidden_layers")
        gemma = model_type in _GEMMA_DEFAULTS
        ffn_size = moe.pop("ffn_size", None) or need("intermediate_size")
        return cls(
            name=name or config.get("_name_or_path") or model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=optional_int("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_size=ffn_size,
            vocab_size=need("vocab_size"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_context=need("max_position_embeddings"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=positive_float("rms_norm_eps", 1e-6),
            qkv_bias=_HF_MODEL_TYPES[model_type] or bool(config.get("attention_bias", False)),
            num_experts=num_experts,
            num_active_experts=(optional_int("num_experts_per_tok") or 1) if num_experts > 1 else 1,
            architecture="gemma3" if model_type == "gemma3_text" else model_type,
            sliding_window=window,
            qk_norm=model_type in _QK_NORM_ARCHS or model_type == "gemma3_text" or model_type in _QK_NORM_WHOLE_ARCHS,
            rotary_dim=None if rotary_fraction == 1.0 else int(head_dim * rotary_fraction),
            sliding_layers=None if window is None else _hf_sliding_layers(config, model_type, num_layers, source),
            attention_scale=positive_float("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            attn_logit_softcap=optional_float("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=optional_float("final_logit_softcapping") if gemma else None,
            local_rope_theta=positive_float("rope_local_base_freq", 10000.0) if model_type == "gemma3_text" else None,
            qk_norm_per_head=model_type not in _QK_NORM_WHOLE_ARCHS,
            clip_qkv=None if clip is None else float(clip),
            **moe,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        name: str | None = None,
        tensor_shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> ModelSpec:
        """From GGUF metadata and, where known, the tensors' shapes in ggml order (a GGUF file's
        index: see `from_gguf`). Only the tensors tell whether the embeddings are tied (the file
        has no `output.weight`) and whether Q/K/V carry a bias; without them: untied, and the
        bias the architecture usually has."""
        arch = metadata.get("general.architecture", "llama")
        if arch not in _GGUF_ARCHS:
            raise InvalidArgument(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}", param="model"
            )

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{key}", default)

        def count(key: str) -> int | None:
            """A positive integer, or None where an optional key is absent."""
            value = get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise InvalidArgument(
                    f"GGUF metadata: '{arch}.{key}' must be a positive integer, got {value!r}", param="model"
                )
            return value

        def need(key: str) -> int:
            value = count(key)
            if value is None:
                raise InvalidArgument(f"GGUF metadata lacks the required key '{arch}.{key}'", param="model")
            return value

        def positive_number(key: str, default: float) -> float:
            value = get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise InvalidArgument(f"GGUF metadata: '{arch}.{key}' must be a positive number, got {value!r}",
                                      param="model")  # fmt: skip
            return float(value)

        hidden = need("embedding_length")
        heads = need("attention.head_count")
        shapes = tensor_shapes or {}
        tokens = metadata.get("tokenizer.ggml.tokens")
        if "token_embd.weight" in shapes:  # [hidden, vocab] in ggml order: the rows the model has
            vocab = shapes["token_embd.weight"][1]
        elif get("vocab_size") is not None or tokens is None:
            vocab = need("vocab_size")
        else:
            vocab = len(tokens)
        scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {
                "rope_type": get("rope.scaling.type"),
                "factor": get("rope.scaling.factor"),
                "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            }
        if "rope_factors_long.weight" in shapes:  # Phi-3's LongRoPE: the factor lists are tensors
            scaling = {
                "rope_type": "longrope",
                "original_max_position_embeddings": count("rope.scaling.original_context_length"),
                "attention_factor": get("rope.scaling.attn_factor"),
            }
        # llama.cpp's defaults: head_dim from the heads, RoPE over all of it
        head_dim = count("attention.key_length") or hidden // heads
        rotary_dim = count("rope.dimension_count")
        num_experts = count("expert_count") or 1
        num_layers = need("block_count")
        window = get("attention.sliding_window") or None  # llama.cpp writes 0 for none
        if window is not None:
            window = count("attention.sliding_window")
        sliding_layers = None
        if window is not None:
            sliding_layers = _gguf_sliding_layers(arch, get("attention.sliding_window_pattern"), num_layers)
        attention_scale = None
        if arch in GEMMA_ARCHITECTURES:
            attention_scale = _gguf_attention_scale(arch, get("attention.scale"), num_layers, hidden, heads, head_dim)
        ffn = need("feed_forward_length")
        expert_ffn = count("expert_feed_forward_length") if num_experts > 1 else None
        # a MoE file's dense layers are those without a router (the experts sit beside it), where
        # the index lists any layer's tensors
        routed = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
        dense = tuple(i for i in range(num_layers) if i not in routed) if num_experts > 1 and routed else ()
        clip = get("attention.clamp_kqv")
        return cls(
            name=name or metadata.get("general.name") or arch,
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=count("attention.head_count_kv") or heads,
            head_dim=head_dim,
            ffn_size=expert_ffn or ffn,
            vocab_size=int(vocab),
            tie_embeddings=bool(shapes) and "output.weight" not in shapes,
            max_context=need("context_length"),
            rope_theta=positive_number("rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=positive_number("attention.layer_norm_rms_epsilon", 1e-5),
            qkv_bias=("blk.0.attn_q.bias" in shapes) if "blk.0.attn_q.weight" in shapes else _GGUF_ARCHS[arch],
            num_experts=num_experts,
            num_active_experts=(count("expert_used_count") or 1) if num_experts > 1 else 1,
            architecture=arch,
            sliding_window=window,
            qk_norm=arch in _QK_NORM_ARCHS or arch in _QK_NORM_WHOLE_ARCHS,
            rotary_dim=None if rotary_dim in (None, head_dim) else rotary_dim,
            sliding_layers=sliding_layers,
            attention_scale=attention_scale,
            attn_logit_softcap=get("attn_logit_softcapping") or None,
            final_logit_softcap=get("final_logit_softcapping") or None,
            local_rope_theta=_GGUF_LOCAL_ROPE_THETA.get(arch),
            qk_norm_per_head=arch not in _QK_NORM_WHOLE_ARCHS,
            clip_qkv=float(clip) if clip else None,
            norm_topk_prob=bool(get("expert_weights_norm", _GGUF_NORM_TOPK.get(arch, True))),
            shared_ffn_size=(count("expert_shared_feed_forward_length") or 0) if num_experts > 1 else 0,
            dense_layers=dense,
            dense_ffn_size=ffn if dense and expert_ffn else None,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
        from servelab.spec.gguf_reader import read_gguf

        gguf = read_gguf(path)
        shapes = {t.name: t.shape for t in gguf.tensors.values()}
        return cls.from_gguf_metadata(gguf.metadata, name=name, tensor_shapes=shapes)


# transformers' defaults for what a Gemma config.json may leave out: a multimodal Gemma 3's
# text_config holds only what differs from Gemma3TextConfig's.
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
        attn_logit_softcapping=None, rope_local_base_freq=10000.0,
    ),
}  # fmt: skip
# llama.cpp's Gemma 2/3 attend locally every layer but each Nth (src/llama-model.cpp's swa pattern).
_GGUF_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# and runs Gemma 3's local layers on RoPE base 10000, unscaled, whatever the global layers use
_GGUF_LOCAL_ROPE_THETA = {"gemma3": 10000.0}
# Block counts of the Gemma 27B models, whose query_pre_attn_scalar is hidden / heads, not head_dim.
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(config: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """A Gemma config.json with transformers' defaults filled in, Gemma 3's two RoPE settings
    (transformers 5's `rope_parameters` per layer type, or 4's `rope_scaling` and
    `rope_local_base_freq`) as the global layers' RoPE and `rope_local_base_freq`."""
    config = {**_GEMMA_DEFAULTS[model_type], **config}
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise InvalidArgument(
            f"{source}: hidden_activation {activation!r} is not supported for {model_type} (supported: "
            "gelu_pytorch_tanh)", param="config")  # fmt: skip
    params = config.get("rope_parameters")
    if model_type == "gemma3_text" and isinstance(params, Mapping) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise InvalidArgument(
                f"{source}: RoPE scaling {local.get('rope_type')!r} on the sliding-window layers is not supported",
                param="config",
            )
        config["rope_parameters"] = params["full_attention"]
        config["rope_local_base_freq"] = local.get("rope_theta", config["rope_local_base_freq"])
    global_params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if model_type == "gemma3_text" and "rope_theta" not in config and "rope_theta" not in global_params:
        config["rope_theta"] = 1_000_000.0  # Gemma3TextConfig's global base
    return config


def _hf_sliding_layers(
    config: Mapping[str, Any], model_type: str, num_layers: int, source: str
) -> tuple[int, ...] | None:
    """The layers that attend over the window (None: all): `layer_types` where the config has it,
    else what transformers derives for the family (Gemma 2 every other layer from the first;
    Gemma 3 all but each `sliding_window_pattern`-th; Qwen2 from `max_window_layers` on)."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != num_layers:
            raise InvalidArgument(f"{source}: layer_types must list {num_layers} layer types", param="config")
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    elif model_type in ("gemma2", "gemma3_text"):
        pattern = config.get("sliding_window_pattern", 2 if model_type == "gemma2" else 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise InvalidArgument(f"{source}: sliding_window_pattern must be a positive integer", param="config")
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    elif model_type in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", 28)  # Qwen2Config's default
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise InvalidArgument(f"{source}: max_window_layers must be a non-negative integer", param="config")
        sliding = tuple(range(first, num_layers))
    else:
        return None
    return None if len(sliding) == num_layers else sliding


def _gguf_sliding_layers(arch: str, pattern: Any, num_layers: int) -> tuple[int, ...] | None:
    """llama.cpp's rule: `attention.sliding_window_pattern` (a period, or one flag a layer) where
    the file has it, else the architecture's fixed period; every layer for the others."""
    if isinstance(pattern, (list, tuple)) and len(pattern) == num_layers:
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        period = pattern if isinstance(pattern, int) and pattern > 0 else _GGUF_SLIDING_PATTERN.get(arch)
        if period is None:
            return None
        sliding = tuple(i for i in range(num_layers) if (i + 1) % period)
    return None if len(sliding) == num_layers else sliding


def _gguf_attention_scale(arch: str, scale: Any, num_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """Gemma's softmax scale from a GGUF file: `attention.scale` where written, else llama.cpp's
    rule (the files carry no query_pre_attn_scalar): hidden / heads for the 27B models, head_dim
    for the others."""
    if isinstance(scale, (int, float)) and scale > 0:
        return float(scale)
    scalar = hidden // heads if _GGUF_GEMMA_27B_LAYERS.get(arch) == num_layers else head_dim
    return scalar**-0.5


def _hf_moe(config: Mapping[str, Any], source: str, num_layers: int, num_experts: int) -> dict[str, Any]:
    """A MoE config's ModelSpec fields: the expert's intermediate size (`moe_intermediate_size`
    where the config has one: Qwen3-MoE's `intermediate_size` is its dense layers'), whether the
    top-k weights are renormalised, and the layers HF builds with a dense MLP
    (`mlp_only_layers`, or not a multiple of `decoder_sparse_step`)."""
    model_type = config["model_type"]
    fields: dict[str, Any] = {
        "norm_topk_prob": bool(config.get("norm_topk_prob", _HF_NORM_TOPK_DEFAULT.get(model_type, True)))
    }
    step = config.get("decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise InvalidArgument(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}", param="config")
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise InvalidArgument(
            f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}", param="config"
        )
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    for key, field in (("moe_intermediate_size", "ffn_size"), ("intermediate_size", "dense_ffn_size")):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise InvalidArgument(f"{source}: {key} must be a positive integer, got {value!r}", param="config")
        if key == "moe_intermediate_size" and value is not None:
            fields[field] = value
    shared = config.get("shared_expert_intermediate_size")
    if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int) or shared < 0):
        raise InvalidArgument(
            f"{source}: shared_expert_intermediate_size must be a non-negative integer, got {shared!r}", param="config"
        )
    if shared:
        fields["shared_ffn_size"] = shared
    if dense and "ffn_size" in fields:
        fields["dense_ffn_size"] = config.get("intermediate_size")
    if dense:
        fields["dense_layers"] = dense
    return fields


def _hf_rope(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any] | None, float, float]:
    """(scaling, theta, rotated fraction of each head) from a config.json: `rope_scaling` and
    top-level `rope_theta` / `partial_rotary_factor` as transformers 4 writes them, or the one
    `rope_parameters` object of transformers 5. Scaling is None for plain RoPE, else HF's keys
    under the canonical `rope_type` ("su" read as "longrope")."""
    params = config.get("rope_parameters")
    if params is None:
        params = config.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise InvalidArgument(f"{source}: rope_scaling must be an object or null, got {params!r}", param="config")
    scaling = dict(params or {})
    theta = config.get("rope_theta", scaling.pop("rope_theta", 10000.0))
    fraction = config.get("partial_rotary_factor", scaling.pop("partial_rotary_factor", 1.0))
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise InvalidArgument(f"{source}: {key} must be a positive number, got {value!r}", param="config")
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"{source}: partial_rotary_factor must be in (0, 1], got {fraction!r}", param="config")
    kind = scaling.pop("type", None)
    kind = scaling.get("rope_type", kind) or "default"
    kind = _ROPE_TYPE_ALIASES.get(kind, kind)
    if kind == "default":
        return None, float(theta), float(fraction)
    scaling["rope_type"] = kind
    # Phi-3 keeps its pretraining length beside max_position_embeddings; HF gives that one priority
    if kind == "longrope":
        original = config.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
        scaling["original_max_position_embeddings"] = original or config.get("max_position_embeddings")
    return scaling, float(theta), float(fraction)


# ---- catalog ------------------------------------------------------------------------------------
# Values are the models' public Hugging Face config.json files (repository named per entry).

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "factor": 32.0}
_GEMMA3_ROPE = {"rope_type": "linear", "factor": 8.0}  # the 4B-27B's global layers


def _gemma2(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
            scalar: int) -> ModelSpec:  # fmt: skip
    """A Gemma 2 model: 4096-token window on every other layer from the first, soft-capping 50 and 30."""
    return ModelSpec(
        name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        ffn_size=ffn, vocab_size=256000, tie_embeddings=True, max_context=8192, rope_theta=10000.0,
        rms_norm_eps=1e-6, architecture="gemma2", sliding_window=4096, sliding_layers=tuple(range(0, layers, 2)),
        attention_scale=scalar**-0.5, attn_logit_softcap=50.0, final_logit_softcap=30.0,
    )  # fmt: skip


def _gemma3(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, head_dim: int = 256,
            scalar: int = 256, vocab: int = 262208, context: int = 131072, window: int = 1024,
            scaling: dict[str, Any] | None = _GEMMA3_ROPE) -> ModelSpec:  # fmt: skip
    """A Gemma 3 language model: five window layers to each global one, local RoPE base 10000."""
    return ModelSpec(
        name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        ffn_size=ffn, vocab_size=vocab, tie_embeddings=True, max_context=context, rope_theta=1_000_000.0,
        rope_scaling=scaling, rms_norm_eps=1e-6, architecture="gemma3", sliding_window=window,
        sliding_layers=tuple(i for i in range(layers) if (i + 1) % 6), qk_norm=True, attention_scale=scalar**-0.5,
        local_rope_theta=10000.0,
    )  # fmt: skip


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # meta-llama/Llama-3.1-8B
        ModelSpec(
            "llama-3.1-8b",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=14336,
            vocab_size=128256,
            tie_embeddings=False,
            max_context=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-3.1-70B
        ModelSpec(
            "llama-3.1-70b",
            num_layers=80,
            hidden_size=8192,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=28672,
            vocab_size=128256,
            tie_embeddings=False,
            max_context=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-3.1-405B
        ModelSpec(
            "llama-3.1-405b",
            num_layers=126,
            hidden_size=16384,
            num_heads=128,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=53248,
            vocab_size=128256,
            tie_embeddings=False,
            max_context=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-3.2-1B
        ModelSpec(
            "llama-3.2-1b",
            num_layers=16,
            hidden_size=2048,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            ffn_size=8192,
            vocab_size=128256,
            tie_embeddings=True,
            max_context=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA32_ROPE,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-3.2-3B
        ModelSpec(
            "llama-3.2-3b",
            num_layers=28,
            hidden_size=3072,
            num_heads=24,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=8192,
            vocab_size=128256,
            tie_embeddings=True,
            max_context=131072,
            rope_theta=500000.0,
            rope_scaling=_LLAMA32_ROPE,
            rms_norm_eps=1e-5,
        ),
        # mistralai/Mistral-7B-Instruct-v0.3 (v0.3: 32768-token vocab, no sliding window)
        ModelSpec(
            "mistral-7b",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=14336,
            vocab_size=32768,
            tie_embeddings=False,
            max_context=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            architecture="mistral",
        ),
        # mistralai/Mixtral-8x7B-v0.1
        ModelSpec(
            "mixtral-8x7b",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=14336,
            vocab_size=32000,
            tie_embeddings=False,
            max_context=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            num_experts=8,
            num_active_experts=2,
            architecture="mixtral",
        ),
        # Qwen/Qwen3-30B-A3B (128 experts of 768, top-8, renormalised; every layer sparse)
        ModelSpec(
            "qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            ffn_size=768,
            vocab_size=151936,
            tie_embeddings=False,
            max_context=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            num_experts=128,
            num_active_experts=8,
            architecture="qwen3_moe",
            qk_norm=True,
        ),
        # Qwen/Qwen1.5-MoE-A2.7B (60 experts of 1,408, top-4, not renormalised, a shared expert of 5,632)
        ModelSpec(
            "qwen1.5-moe-a2.7b",
            num_layers=24,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            ffn_size=1408,
            vocab_size=151936,
            tie_embeddings=False,
            max_context=8192,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            qkv_bias=True,
            num_experts=60,
            num_active_experts=4,
            architecture="qwen2_moe",
            norm_topk_prob=False,
            shared_ffn_size=5632,
        ),
        # Qwen/Qwen2-57B-A14B (64 experts of 2,560, top-8, not renormalised, a shared expert of 20,480)
        ModelSpec(
            "qwen2-57b-a14b",
            num_layers=28,
            hidden_size=3584,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            ffn_size=2560,
            vocab_size=151936,
            tie_embeddings=False,
            max_context=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            qkv_bias=True,
            num_experts=64,
            num_active_experts=8,
            architecture="qwen2_moe",
            norm_topk_prob=False,
            shared_ffn_size=20480,
        ),
        # allenai/OLMoE-1B-7B-0924 (64 experts, top-8, not renormalised; q/k norm over the projections)
        ModelSpec(
            "olmoe-1b-7b",
            num_layers=16,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            ffn_size=1024,
            vocab_size=50304,
            tie_embeddings=False,
            max_context=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            num_experts=64,
            num_active_experts=8,
            architecture="olmoe",
            qk_norm=True,
            qk_norm_per_head=False,
            norm_topk_prob=False,
        ),
        # Qwen/Qwen2.5-7B-Instruct
        ModelSpec(
            "qwen2.5-7b",
            num_layers=28,
            hidden_size=3584,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            ffn_size=18944,
            vocab_size=152064,
            tie_embeddings=False,
            max_context=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            qkv_bias=True,
            architecture="qwen2",
        ),
        # Qwen/Qwen2.5-72B-Instruct
        ModelSpec(
            "qwen2.5-72b",
            num_layers=80,
            hidden_size=8192,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=29568,
            vocab_size=152064,
            tie_embeddings=False,
            max_context=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            qkv_bias=True,
            architecture="qwen2",
        ),
        # Qwen/Qwen3-8B
        ModelSpec(
            "qwen3-8b",
            num_layers=36,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=12288,
            vocab_size=151936,
            tie_embeddings=False,
            max_context=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            architecture="qwen3",
            qk_norm=True,
        ),
        # Qwen/Qwen3-0.6B
        ModelSpec(
            "qwen3-0.6b",
            num_layers=28,
            hidden_size=1024,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=3072,
            vocab_size=151936,
            tie_embeddings=True,
            max_context=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            architecture="qwen3",
            qk_norm=True,
        ),
        # microsoft/Phi-3-mini-128k-instruct (LongRoPE; the factor lists matter to the engine only)
        ModelSpec(
            "phi-3-mini-128k",
            num_layers=32,
            hidden_size=3072,
            num_heads=32,
            num_kv_heads=32,
            head_dim=96,
            ffn_size=8192,
            vocab_size=32064,
            tie_embeddings=False,
            max_context=131072,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096},
            rms_norm_eps=1e-5,
            architecture="phi3",
        ),
        # microsoft/phi-4
        ModelSpec(
            "phi-4",
            num_layers=40,
            hidden_size=5120,
            num_heads=40,
            num_kv_heads=10,
            head_dim=128,
            ffn_size=17920,
            vocab_size=100352,
            tie_embeddings=False,
            max_context=16384,
            rope_theta=250000.0,
            rms_norm_eps=1e-5,
            architecture="phi3",
        ),
        # google/gemma-2-2b
        _gemma2("gemma-2-2b", layers=26, hidden=2304, heads=8, kv_heads=4, head_dim=256, ffn=9216, scalar=256),
        # google/gemma-2-9b
        _gemma2("gemma-2-9b", layers=42, hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn=14336, scalar=256),
        # google/gemma-2-27b
        _gemma2("gemma-2-27b", layers=46, hidden=4608, heads=32, kv_heads=16, head_dim=128, ffn=36864, scalar=144),
        # google/gemma-3-1b-it (text only; 512-token window, no RoPE scaling)
        _gemma3(
            "gemma-3-1b",
            layers=26,
            hidden=1152,
            heads=4,
            kv_heads=1,
            ffn=6912,
            vocab=262144,
            context=32768,
            window=512,
            scaling=None,
        ),
        # google/gemma-3-4b-it (its language model)
        _gemma3("gemma-3-4b", layers=34, hidden=2560, heads=8, kv_heads=4, ffn=10240),
        # google/gemma-3-27b-it (its language model)
        _gemma3("gemma-3-27b", layers=62, hidden=5376, heads=32, kv_heads=16, ffn=21504, head_dim=128, scalar=168),
        # HuggingFaceTB/SmolLM2-135M (the bundled model)
        ModelSpec(
            "smollm2-135m",
            num_layers=30,
            hidden_size=576,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            ffn_size=1536,
            vocab_size=49152,
            tie_embeddings=True,
            max_context=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-2-7b-hf (multi-head attention: 32 KV heads); in docs/fidelity.md's measurements
        ModelSpec(
            "llama-2-7b",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            ffn_size=11008,
            vocab_size=32000,
            tie_embeddings=False,
            max_context=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-2-13b-hf
        ModelSpec(
            "llama-2-13b",
            num_layers=40,
            hidden_size=5120,
            num_heads=40,
            num_kv_heads=40,
            head_dim=128,
            ffn_size=13824,
            vocab_size=32000,
            tie_embeddings=False,
            max_context=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
        # meta-llama/Llama-2-70b-hf
        ModelSpec(
            "llama-2-70b",
            num_layers=80,
            hidden_size=8192,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            ffn_size=28672,
            vocab_size=32000,
            tie_embeddings=False,
            max_context=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)}, or give an HF config.json (or its "
            "directory) or a .gguf file", param="model")  # fmt: skip


def resolve_model(text: str) -> ModelSpec:
    """What a command's --model names: a catalog model, an HF config.json (or a directory holding
    one), or a GGUF file (its header only)."""
    if text.endswith(".gguf"):
        return ModelSpec.from_gguf(text)
    if text.endswith(".json") or os.path.isdir(text):
        return ModelSpec.from_hf_config(text)
    return get_model(text)


MODEL_HELP = "catalog model (see `servelab models`), an HF config.json (or its directory) or a .gguf file"
