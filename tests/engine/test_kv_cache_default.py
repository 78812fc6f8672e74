"""The KV cache's dtype when none is asked for: float16 where the model runs the default's int8
dot products over its GGUF blocks (docs/accuracy.md scores the pair), else the compute dtype; an
explicit choice, --exact, --deterministic, --dtype and --quantization keep theirs."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM
from tests.tiny_families import write_family, write_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf_dir = write_family(tmp_path_factory.mktemp("kv") / "llama3", "llama3")
    return {"gguf": str(write_gguf(hf_dir, hf_dir.parent / "q8.gguf", qtype="Q8_0")), "hf": str(hf_dir)}


def _kv_dtype(model: str, **flags) -> torch.dtype:
    return LLM(model, num_blocks=16, **flags).engine.executor.kv_cache.dtype


@pytest.mark.parametrize(
    ("model", "flags", "expected"),
    [
        ("gguf", {}, torch.float16),  # the default path: int8 dot products, an fp16 cache
        ("gguf", {"kv_cache_dtype": "float32"}, torch.float32),
        ("gguf", {"kv_cache_dtype": "bfloat16"}, torch.bfloat16),
        ("gguf", {"exact": True}, torch.float32),
        ("gguf", {"deterministic": True}, torch.float32),
        ("gguf", {"dtype": "float32"}, torch.float32),
        ("gguf", {"quantization": "int8"}, torch.float32),
        ("gguf", {"dtype": "bfloat16"}, torch.bfloat16),  # vLLM's habit: bf16 linears, a bf16 cache
        ("hf", {}, torch.float32),  # no GGUF blocks, no int8 path: the compute dtype
    ],
)
def test_the_kv_cache_dtype_follows_the_path(models, model, flags, expected):
    assert _kv_dtype(models[model], **flags) == expected


def test_a_draft_models_cache_takes_the_targets_dtype(models):
    """Its pool is sized in the target's blocks: in another dtype it would hold other bytes."""
    draft = {"model": models["gguf"], "num_speculative_tokens": 2}
    for flags, expected in (({}, torch.float16), ({"kv_cache_dtype": "float32"}, torch.float32)):
        engine = LLM(models["gguf"], num_blocks=16, speculative_config=draft, **flags).engine
        assert engine.executor.kv_cache.dtype == expected
        assert engine.core.proposers.draft.executor.kv_cache.dtype == expected
