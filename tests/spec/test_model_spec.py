import json
from pathlib import Path

import pytest

from servelab.errors import InvalidArgument, NotFound
from servelab.spec import MODELS, ModelSpec, get_model

# Trimmed copies of the public config.json files (the keys ModelSpec reads, plus some it ignores).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32768,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
}

SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_size",
    "vocab_size",
    "tie_embeddings",
    "max_context",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "qkv_bias",
    "num_experts",
    "num_active_experts",
)


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE_FIELDS)


def test_seed_parameter_counts_are_computed_from_the_spec():
    assert get_model("llama-3.1-8b").num_params == pytest.approx(8.03e9, rel=0.005)
    assert get_model("llama-3.1-70b").num_params == pytest.approx(70.6e9, rel=0.005)


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama-3.1-405b", 405.85e9),
        ("llama-3.2-1b", 1.236e9),
        ("llama-3.2-3b", 3.213e9),
        ("mistral-7b", 7.248e9),
        ("mixtral-8x7b", 46.70e9),
        ("qwen2.5-7b", 7.616e9),
        ("qwen2.5-72b", 72.71e9),
        ("smollm2-135m", 134.5e6),
    ],
)
def test_catalog_parameter_counts_match_published_sizes(name, published):
    assert get_model(name).num_params == pytest.approx(published, rel=0.005)


def test_moe_active_parameters_count_only_routed_experts():
    mixtral = get_model("mixtral-8x7b")
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=0.01)
    dense = get_model("mistral-7b")
    assert dense.num_active_params == dense.num_params


def test_kv_bytes_per_token_counts_kv_heads_not_attention_heads():
    llama = get_model("llama-3.1-8b")
    assert llama.kv_bytes_per_token("bf16") == 131_072
    assert llama.kv_bytes_per_token("fp8") == 65_536
    # The same model with one KV head per attention head (MHA) would need 4x the bytes.
    mha = ModelSpec(**{**{f: getattr(llama, f) for f in llama.__dataclass_fields__}, "num_kv_heads": 32})
    assert mha.kv_bytes_per_token("bf16") == 4 * llama.kv_bytes_per_token("bf16")


def test_catalog_has_the_required_models_and_rejects_unknown_names():
    required = {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "llama-3.1-405b",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "mistral-7b",
        "mixtral-8x7b",
        "qwen2.5-7b",
        "qwen2.5-72b",
        "smollm2-135m",
    }
    assert required <= set(MODELS)
    assert get_model("Llama-3.1-8B") is MODELS["llama-3.1-8b"]
    with pytest.raises(InvalidArgument) as err:
        get_model("llama-4-8b")
    assert "llama-4-8b" in err.value.message and "smollm2-135m" in err.value.message


def test_bundled_model_shape():
    smol = get_model("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 576, 9, 3, 64)
    assert (smol.ffn_size, smol.vocab_size, smol.tie_embeddings, smol.max_context) == (1536, 49152, True, 8192)
    assert smol.rope_theta == 100000.0


def test_spec_is_hashable_and_validates():
    assert len({get_model("llama-3.1-8b"), get_model("llama-3.1-8b"), get_model("mistral-7b")}) == 2
    with pytest.raises(InvalidArgument, match="multiple of num_kv_heads"):
        ModelSpec(
            "bad",
            2,
            64,
            num_heads=6,
            num_kv_heads=4,
            head_dim=16,
            ffn_size=128,
            vocab_size=10,
            tie_embeddings=True,
            max_context=128,
            rope_theta=1e4,
        )
    with pytest.raises(InvalidArgument, match="num_layers"):
        ModelSpec(
            "bad",
            0,
            64,
            num_heads=4,
            num_kv_heads=4,
            head_dim=16,
            ffn_size=128,
            vocab_size=10,
            tie_embeddings=True,
            max_context=128,
            rope_theta=1e4,
        )


@pytest.mark.parametrize(
    "config, catalog_name",
    [
        (LLAMA_31_8B, "llama-3.1-8b"),
        (MISTRAL_7B_V03, "mistral-7b"),
        (QWEN25_7B, "qwen2.5-7b"),
        (MIXTRAL_8X7B, "mixtral-8x7b"),
    ],
)
def test_from_hf_config_file_matches_catalog(tmp_path: Path, config, catalog_name):
    model_dir = tmp_path / catalog_name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    from_dir = ModelSpec.from_hf_config(model_dir)
    from_file = ModelSpec.from_hf_config(model_dir / "config.json")
    from_dict = ModelSpec.from_hf_config(config, name=catalog_name)
    catalog = get_model(catalog_name)
    for spec in (from_dir, from_file, from_dict):
        assert same_shape(spec, catalog), spec
        assert spec.num_params == catalog.num_params
    assert from_dir.name == catalog_name  # named after its directory


def test_from_hf_config_qwen2_has_qkv_bias_and_llama_does_not():
    assert ModelSpec.from_hf_config(QWEN25_7B).qkv_bias
    assert ModelSpec.from_hf_config({**QWEN25_7B, "attention_bias": False}).qkv_bias  # Qwen2's are always there
    assert not ModelSpec.from_hf_config(LLAMA_31_8B).qkv_bias


def test_from_hf_config_reads_the_sliding_window_where_it_applies():
    assert ModelSpec.from_hf_config(MISTRAL_7B_V03).sliding_window is None
    v01 = ModelSpec.from_hf_config({**MISTRAL_7B_V03, "sliding_window": 4096})  # Mistral-7B-v0.1
    assert (v01.sliding_window, v01.max_context) == (4096, 32768)
    assert ModelSpec.from_hf_config(QWEN25_7B).sliding_window is None  # use_sliding_window: false
    assert ModelSpec.from_hf_config({**QWEN25_7B, "use_sliding_window": True}).sliding_window == 131072


def test_from_hf_config_errors_name_the_problem(tmp_path: Path):
    with pytest.raises(InvalidArgument, match="unsupported model_type 'gpt2'.*llama"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})
    broken = {k: v for k, v in LLAMA_31_8B.items() if k != "intermediate_size"}
    with pytest.raises(InvalidArgument, match="intermediate_size"):
        ModelSpec.from_hf_config(broken)
    with pytest.raises(NotFound, match="does not exist"):
        ModelSpec.from_hf_config(tmp_path / "missing")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="JSON"):
        ModelSpec.from_hf_config(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": "abc"}, "hidden_size must be a positive integer, got 'abc'"),
        ({"intermediate_size": None}, "intermediate_size must be a positive integer, got None"),
        ({"vocab_size": 10.5}, "vocab_size must be a positive integer, got 10.5"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
        ({"num_key_value_heads": -8}, "num_key_value_heads must be a positive integer, got -8"),
        ({"head_dim": "128"}, "head_dim must be a positive integer"),
        ({"rope_theta": "big"}, "rope_theta must be a positive number"),
        ({"rope_scaling": [1]}, "rope_scaling must be an object"),
    ],
)
def test_from_hf_config_rejects_malformed_values_naming_the_key(tmp_path: Path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_31_8B, **change}))
    with pytest.raises(InvalidArgument, match=f"config.json: {message}"):
        ModelSpec.from_hf_config(path)
    with pytest.raises(InvalidArgument, match=message):
        ModelSpec.from_hf_config({**LLAMA_31_8B, **change})


def test_from_hf_config_rejects_a_file_that_is_not_a_json_object_of_text(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text("[1]")
    with pytest.raises(InvalidArgument, match="expected a JSON object"):
        ModelSpec.from_hf_config(path)
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(InvalidArgument, match="cannot read .*config.json"):
        ModelSpec.from_hf_config(path)
