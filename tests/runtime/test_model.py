"""The model against HF transformers: logits (fp32, max relative difference <= 1e-4) and 64
greedy tokens, for a tiny random Llama, a tied-embedding Qwen2 with qkv bias, llama3 rope
scaling, and (slow) the bundled SmolLM2 GGUF against transformers' own GGUF loader."""

from __future__ import annotations

import pytest
import torch

from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.engine.tokenizer import Tokenizer
from tests.tiny_models import write_tiny_llama
from servelab.runtime.loader import load_model

from tests.tiny_models import max_rel_diff, prefill_logits

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama": {},
    "qwen2-tied-bias": {"qkv_bias": True, "tie_embeddings": True, "kv_heads": 1},
    "llama3-rope-scaling": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp(request.param), seed=3, **VARIANTS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_logits_match_hf_in_one_pass_chunks_and_decodes(variant):
    path, hf = variant
    model = load_model(path, dtype=torch.float32).model
    ids = [int(t) for t in torch.randint(0, 500, (150,), generator=torch.Generator().manual_seed(1))]
    ref = _hf_logits(hf, ids)
    assert max_rel_diff(prefill_logits(model, ids), ref) <= 1e-4
    assert max_rel_diff(prefill_logits(model, ids, chunk=37), ref) <= 1e-4  # chunked prefill through the cache
    assert max_rel_diff(prefill_logits(model, ids[:40], chunk=1), ref[:40]) <= 1e-4  # decode path


def test_greedy_64_tokens_match_hf_generate(variant):
    path, hf = variant
    engine = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32"))
    prompt = engine.tokenizer.encode("The model is fast and the cache is")
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert seq.output_token_ids == out[0, len(prompt) :].tolist()
    assert len(seq.output_token_ids) == 64


def test_bf16_stays_close_to_fp32(tiny_llama):
    ids = list(range(3, 90))
    fp32 = prefill_logits(load_model(tiny_llama, dtype=torch.float32).model, ids)
    bf16 = prefill_logits(load_model(tiny_llama, dtype=torch.bfloat16).model, ids)
    assert bf16.dtype == torch.float32  # logits always come back in fp32 for the sampler
    assert max_rel_diff(bf16, fp32) < 0.05
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


@pytest.mark.slow
def test_bundled_smollm2_gguf_matches_transformers_gguf_loader():
    from servelab.engine.bundled import bundled_model_path

    path = bundled_model_path()
    ours = load_model(path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = Tokenizer.from_gguf(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}])
    ids = tokenizer.encode(prompt)
    assert max_rel_diff(prefill_logits(ours.model, ids), _hf_logits(hf, ids)) <= 1e-4

    engine = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32"))
    seq = engine.add_request("r", ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert seq.output_token_ids == out[0, len(ids) :].tolist()
