"""ModelSpec for the families the engine loads: config.json as transformers 4 and 5 write it, GGUF
metadata as llama.cpp writes it, the counts the cost model prices, and `servelab models`."""

from __future__ import annotations

import json

import pytest

from servelab.cli import main
from servelab.errors import InvalidArgument
from servelab.spec.model import MODELS, ModelSpec

_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}  # fmt: skip


def test_phi3_as_transformers_4_wrote_it_su_scaling_and_a_top_level_original_length():
    spec = ModelSpec.from_hf_config({
        **_BASE, "model_type": "phi3", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        "sliding_window": 200,
    })  # fmt: skip
    assert spec.rope_scaling == {
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    assert spec.rope_theta == 10000.0 and spec.sliding_window == 200 and spec.engine_refusal is None


def test_qwen3_and_llama3_as_transformers_5_writes_them_in_rope_parameters():
    qwen3 = ModelSpec.from_hf_config({**_BASE, "model_type": "qwen3", "head_dim": 32, "sliding_window": 64,
                                      "use_sliding_window": False, "rope_parameters": {"rope_type": "default",
                                      "rope_theta": 1e6}})  # fmt: skip
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.sliding_window) == (True, False, 32, None)
    assert qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
    llama = ModelSpec.from_hf_config({**_BASE, "model_type": "llama", "rope_parameters": rope})
    assert llama.rope_theta == 500000.0 and llama.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_partial_rotary_is_recorded_and_the_engine_refusal_names_it():
    spec = ModelSpec.from_hf_config({**_BASE, "model_type": "phi3", "partial_rotary_factor": 0.75})
    assert spec.rotary_dim == 12 and spec.engine_refusal == "partial rotary embeddings"


def test_gguf_metadata_of_qwen3_and_phi3():
    base = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 512}  # fmt: skip
    qwen3 = ModelSpec.from_gguf_metadata({"general.architecture": "qwen3", **{f"qwen3.{k}": v for k, v in base.items()},
                                          "qwen3.attention.key_length": 32})  # fmt: skip
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.rotary_dim) == (True, 32, None)
    phi3 = ModelSpec.from_gguf_metadata(
        {"general.architecture": "phi3", **{f"phi3.{k}": v for k, v in base.items()},
         "phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": 1.2,
         "phi3.attention.sliding_window": 0},
        tensor_shapes={"rope_factors_long.weight": (8,), "rope_factors_short.weight": (8,), "output.weight": (64, 512)},
    )  # fmt: skip
    assert phi3.rope_scaling == {"rope_type": "longrope", "original_max_position_embeddings": 64,
                                 "attention_factor": 1.2}  # fmt: skip
    assert phi3.sliding_window is None and not phi3.tie_embeddings


def test_tied_embeddings_are_counted_once():
    tied = MODELS["qwen3-0.6b"]
    untied = ModelSpec(**{**{f: getattr(tied, f) for f in tied.__dataclass_fields__}, "tie_embeddings": False})
    assert untied.num_params - tied.num_params == tied.vocab_size * tied.hidden_size
    assert tied.norm_params_per_layer == 2 * tied.hidden_size + 2 * tied.head_dim  # q_norm and k_norm


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-0.6b", "phi-3-mini-128k", "phi-4"])
def test_the_cost_model_prices_each_family(model, capsys):
    assert main(["roofline", "--model", model, "--hardware", "h100-sxm", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["step_time_s"] > 0 for r in rows)
    assert rows[0]["weight_bytes"] == MODELS[model].weight_bytes("bf16")  # a tied matrix once


def test_models_lists_what_the_engine_loads_beside_what_the_cost_model_prices(capsys):
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    assert lines["qwen3-8b"].endswith("loads") and lines["phi-4"].endswith("loads")
    assert lines["mixtral-8x7b"].endswith("loads")  # a MoE
    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m["engine_loads"] for m in json.loads(capsys.readouterr().out)}
    assert listed["phi-3-mini-128k"] and listed["mixtral-8x7b"]


# google/gemma-3-4b-it's config.json: its text_config holds only what differs from Gemma3TextConfig's defaults
_GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}  # fmt: skip
# google/gemma-2-9b's config.json (transformers 4)
_GEMMA2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}  # fmt: skip


def test_a_multimodal_gemma3_config_is_its_language_model_with_transformers_defaults():
    spec = ModelSpec.from_hf_config(_GEMMA3_4B, name="gemma-3-4b")
    assert spec == MODELS["gemma-3-4b"]
    assert (spec.num_heads, spec.head_dim, spec.vocab_size, spec.max_context) == (8, 256, 262208, 131072)
    assert spec.local_rope_theta == 10000.0 and spec.rope_theta == 1e6 and spec.qk_norm
    assert [spec.layer_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert spec.engine_refusal is None


def test_gemma3_rope_as_transformers_5_writes_it_per_layer_type():
    spec = ModelSpec.from_hf_config({**_BASE, "model_type": "gemma3_text", "layer_types": [
        "sliding_attention", "full_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}})  # fmt: skip
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0} and spec.rope_theta == 5e5
    assert spec.local_rope_theta == 20000.0 and spec.sliding_layers == (0,) and spec.sliding_window == 4096


def test_gemma2_config_and_its_counts():
    spec = ModelSpec.from_hf_config(_GEMMA2_9B, name="gemma-2-9b")
    assert spec == MODELS["gemma-2-9b"]
    assert (spec.attn_logit_softcap, spec.final_logit_softcap, spec.softmax_scale) == (50.0, 30.0, 256**-0.5)
    assert [spec.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    # google/gemma-2-2b and gemma-3-1b as transformers counts them: GeGLU holds SwiGLU's three
    # matrices, and a layer has four norms
    assert MODELS["gemma-2-2b"].num_params == 2_614_341_888
    assert MODELS["gemma-3-1b"].num_params == 999_885_952


def test_gemma_refuses_an_activation_it_does_not_run():
    with pytest.raises(InvalidArgument, match="hidden_activation 'silu'"):
        ModelSpec.from_hf_config({**_GEMMA2_9B, "hidden_activation": "silu"})


def test_sliding_layers_of_qwen2_and_mistral():
    qwen2 = ModelSpec.from_hf_config({**_BASE, "model_type": "qwen2", "use_sliding_window": True,
                                      "sliding_window": 32, "max_window_layers": 1})  # fmt: skip
    assert qwen2.sliding_layers == (1,) and [qwen2.layer_window(i) for i in range(2)] == [None, 32]
    mistral = ModelSpec.from_hf_config({**_BASE, "model_type": "mistral", "sliding_window": 32})
    assert mistral.sliding_layers is None and mistral.layer_window(1) == 32


def test_gguf_metadata_of_gemma2_and_gemma3_as_llama_cpp_reads_it():
    def meta(arch: str, layers: int, **extra) -> dict:
        base = {"block_count": layers, "context_length": 8192, "embedding_length": 4608, "feed_forward_length": 128,
                "attention.head_count": 32, "attention.head_count_kv": 16, "attention.key_length": 128,
                "attention.sliding_window": 4096, "vocab_size": 512, **extra}  # fmt: skip
        return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in base.items()}}

    gemma2_27b = ModelSpec.from_gguf_metadata(meta("gemma2", 46, attn_logit_softcapping=50.0,
                                                   final_logit_softcapping=30.0))  # fmt: skip
    assert gemma2_27b.softmax_scale == 144**-0.5  # hidden / heads: llama.cpp's 27B rule
    assert gemma2_27b.sliding_layers == tuple(range(0, 46, 2)) and gemma2_27b.attn_logit_softcap == 50.0
    gemma2 = ModelSpec.from_gguf_metadata(meta("gemma2", 42))
    assert gemma2.softmax_scale == 128**-0.5 and gemma2.final_logit_softcap is None
    gemma3 = ModelSpec.from_gguf_metadata(meta("gemma3", 12, **{"attention.scale": 0.1}))
    assert gemma3.softmax_scale == 0.1 and gemma3.qk_norm and gemma3.local_rope_theta == 10000.0
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert gemma3.engine_refusal is None and gemma3.norm_params_per_layer == 4 * 4608 + 2 * 128


@pytest.mark.parametrize(
    ("key", "value"),
    [("rope.freq_base", "fast"), ("attention.layer_norm_rms_epsilon", -1.0), ("attention.sliding_window", "4k")],
)
def test_malformed_gguf_numbers_are_refused_by_key(key, value):
    base = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 512}  # fmt: skip
    metadata = {"general.architecture": "llama", **{f"llama.{k}": v for k, v in base.items()}, f"llama.{key}": value}
    with pytest.raises(InvalidArgument, match=f"'llama.{key}' must be a positive"):
        ModelSpec.from_gguf_metadata(metadata)
