"""Each model family the engine loads against HF transformers, from the HF directory and from the
GGUF file llama.cpp's converter would write (tests/tiny_families.py): Llama 3.x (llama3 RoPE
scaling), tied embeddings, Qwen2.5, Qwen3 (per-head q/k RMSNorm), Phi-3 (fused weights, LongRoPE),
and the mixtures of experts Mixtral, Qwen3-MoE (with a dense layer) and OLMoE (whole-projection
q/k norm, clip_qkv, top-k weights not renormalised).

Tolerance: fp32 logits within 1e-5 of transformers', relative to the largest logit (measured:
~5e-7 on every family and format); greedy tokens identical.
"""

from __future__ import annotations

import copy

import pytest
import torch

from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.errors import InvalidArgument
from servelab.runtime.loader import load_model
from servelab.runtime.ops import OPS_NAMES
from tests.runtime.isa_levels import make_ops_at
from tests.tiny_families import FAMILIES, GGUF_ARCH, write_family, write_gguf
from tests.tiny_models import max_rel_diff, prefill_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TOLERANCE = 1e-5
FORMATS = ("safetensors", "gguf")
# positions past original_max_position_embeddings (64), where llama3's and LongRoPE's scaling bite
LONG_IDS = [int(t) for t in torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = write_family(tmp_path_factory.mktemp(name) / name, name, seed=3)
    gguf_path = write_gguf(path, path.parent / f"{name}.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, {"safetensors": path, "gguf": gguf_path}, hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _hf_decode_logits(hf, ids: list[int]) -> torch.Tensor:
    """The logits of each position as transformers computes them one token at a time over a cache."""
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0] for t in ids])


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers_in_one_pass_chunks_and_decodes(family, fmt):
    name, paths, hf = family
    loaded = load_model(paths[fmt], dtype=torch.float32)
    model_type = hf.config.model_type
    assert loaded.spec.architecture == (GGUF_ARCH.get(model_type, model_type) if fmt == "gguf" else model_type)
    assert loaded.spec.tie_embeddings == bool(hf.config.tie_word_embeddings) == loaded.model.tied_head
    ref = _hf_logits(hf, LONG_IDS)
    assert max_rel_diff(prefill_logits(loaded.model, LONG_IDS), ref) <= TOLERANCE
    # a short sequence: LongRoPE's short factors (HF picks the set by the forward's length)
    short = LONG_IDS[:40]
    assert max_rel_diff(prefill_logits(loaded.model, short), _hf_logits(hf, short)) <= TOLERANCE
    assert max_rel_diff(prefill_logits(loaded.model, short, chunk=1), _hf_logits(hf, short)) <= TOLERANCE  # decodes
    chunked = prefill_logits(loaded.model, LONG_IDS, chunk=37)  # chunks through the paged cache
    if name != "phi3":
        assert max_rel_diff(chunked, ref) <= TOLERANCE
    else:  # each chunk reads the set its own length calls for: the first chunk (37 <= 64) the short one
        assert max_rel_diff(chunked[:37], _hf_logits(hf, LONG_IDS[:37])) <= TOLERANCE
        assert max_rel_diff(chunked[74:], ref[74:]) > TOLERANCE  # whose keys the later rows attend to


@pytest.mark.parametrize("name", OPS_NAMES)
def test_logits_match_transformers_at_every_isa_level(family, name, monkeypatch):
    family_name, paths, hf = family
    if family_name not in ("llama3", "qwen3", "phi3", "olmoe"):
        pytest.skip("the ISA levels differ in kernels, not in families: one of each new detail")
    model = load_model(paths["safetensors"], dtype=torch.float32).model
    model.use_ops(make_ops_at(name, monkeypatch))
    ref = _hf_logits(hf, LONG_IDS)
    assert max_rel_diff(prefill_logits(model, LONG_IDS), ref) <= TOLERANCE
    short = LONG_IDS[:48]
    assert max_rel_diff(prefill_logits(model, short, chunk=1), _hf_logits(hf, short)) <= TOLERANCE
    # decodes past original_max_position_embeddings: the decode path, and the decode stack where it runs
    ids = LONG_IDS[:72]
    assert max_rel_diff(prefill_logits(model, ids, chunk=1), _hf_decode_logits(hf, ids)) <= TOLERANCE


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_match_transformers_generate(family, fmt):
    """40 tokens after a short prompt and 40 after a long one (past position 64, where llama3's and
    LongRoPE's scaling bite), in one batch: each as transformers generates it alone."""
    _, paths, hf = family
    engine = LLMEngine.from_args(EngineArgs(model=str(paths[fmt]), dtype="float32"))
    prompts = {"short": engine.tokenizer.encode("The model is fast and the cache is"), "long": LONG_IDS[:100]}
    steps = {"short": 40, "long": 40}
    seqs = {
        key: engine.add_request(key, ids, SamplingParams(max_tokens=steps[key], temperature=0, ignore_eos=True))
        for key, ids in prompts.items()
    }
    while engine.has_unfinished():
        engine.step()
    for key, ids in prompts.items():
        assert seqs[key].output_token_ids == _hf_greedy(hf, ids, steps[key]), key


def test_longrope_decodes_past_the_switch_like_transformers_with_a_cache(family):
    """A sequence that grows past original_max_position_embeddings while decoding: its new tokens
    take the long set and its cached keys keep the short one, as transformers computes with a
    cache it is handed. (transformers' own generate() recomputes Phi-3's whole cache at that
    step instead; the engine does not: docs/limits-and-safety.md.)"""
    name, paths, hf = family
    if name != "phi3":
        pytest.skip("LongRoPE only")
    ids = LONG_IDS[:70]
    ours = prefill_logits(load_model(paths["safetensors"], dtype=torch.float32).model, ids, chunk=1)
    assert max_rel_diff(ours, _hf_decode_logits(hf, ids)) <= TOLERANCE
    assert max_rel_diff(ours[64:], _hf_logits(hf, ids)[64:]) > TOLERANCE  # the recomputed cache differs


def _without_rope_scaling(hf):
    config = copy.deepcopy(hf.config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = type(hf)(config).eval()
    plain.load_state_dict(hf.state_dict())
    return plain


def test_the_long_context_checks_see_the_scaling(family):
    """Past original_max_position_embeddings the scaling moves the logits far beyond the tolerance,
    so the parity above checks it."""
    name, _, hf = family
    if name not in ("llama3", "phi3"):
        pytest.skip("no RoPE scaling")
    assert max_rel_diff(_hf_logits(_without_rope_scaling(hf), LONG_IDS), _hf_logits(hf, LONG_IDS)) > 100 * TOLERANCE


def test_unimplemented_rope_types_and_partial_rotary_are_refused_by_name(tmp_path):
    import json

    path = write_family(tmp_path / "m", "llama3")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="rope scaling type 'yarn' is not supported"):
        load_model(path, dtype=torch.float32)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="partial rotary embeddings"):
        load_model(path, dtype=torch.float32)


def test_a_gguf_architecture_the_engine_does_not_run_is_refused_by_name(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidArgument, match="unsupported GGUF architecture 'gemma2'"):
        load_model(tmp_path / "g.gguf", dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "fmt"),
    [("qwen3", "safetensors"), ("phi3", "safetensors"), ("phi3", "gguf"), ("mixtral", "safetensors"),
     ("qwen3-moe", "gguf")],
)  # fmt: skip
def test_tensor_parallel_2_matches_transformers(tmp_path_factory, name, fmt):
    """TP=2: Q/K norms replicated, Phi-3's fused weights split per rank (a rank reads its rows),
    each expert's intermediate dimension split with the router replicated (Mixtral's HF names;
    Qwen3-MoE's stacked GGUF experts and its dense layer)."""
    path = write_family(tmp_path_factory.mktemp(name) / name, name, seed=3)
    model_path = write_gguf(path, path.parent / f"{name}.gguf") if fmt == "gguf" else path
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(EngineArgs(model=str(model_path), dtype="float32", tensor_parallel_size=2))
    try:
        prompt = LONG_IDS[:80]
        # min_tokens: EOS suppressed until then, as min_new_tokens does in transformers' generate
        params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0)
        seq = engine.add_request("r", prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids == _hf_greedy(hf, prompt, 32)
        ids = prompt + seq.output_token_ids
        assert max_rel_diff(prefill_logits(engine.executor.model, ids), _hf_logits(hf, ids)) <= TOLERANCE
    finally:
        engine.close()
