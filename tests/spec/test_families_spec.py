"""ModelSpec for the families the engine loads: config.json as transformers 4 and 5 write it, GGUF
metadata as llama.cpp writes it, the counts the cost model prices, and `servelab models`."""

from __future__ import annotations

import json

import pytest

from servelab.cli import main
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
