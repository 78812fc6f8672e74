"""Each model family the engine loads against HF transformers, from the HF directory and from the
GGUF file llama.cpp's converter would write (tests/tiny_families.py): Llama 3.x (llama3 RoPE
scaling), tied embeddings, Qwen2.5, Qwen3 (per-head q/k RMSNorm), Phi-3 (fused weights, LongRoPE),
Gemma 2 (soft-capping, local/global layers) and Gemma 3 (q/k norms, local RoPE base, linear
scaling), whose 8-token windows every prompt here crosses; Mistral's window; and the mixtures of
experts Mixtral, Qwen3-MoE (with a dense layer) and OLMoE (whole-projection q/k norm, clip_qkv,
top-k weights not renormalised).

Tolerance: fp32 logits within 1e-5 of transformers', relative to the largest logit (measured:
~5e-7 on every family and format); greedy tokens identical.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from servelab.core.config import SchedulerConfig
from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.errors import InvalidArgument
from servelab.runtime.loader import load_model
from servelab.runtime.ops import OPS_NAMES
from tests.runtime.isa_levels import make_ops_at
from tests.tiny_families import FAMILIES, GEMMA_WINDOW, GGUF_ARCH, write_family, write_gguf
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
    hf = _hf_model(path)
    return name, {"safetensors": path, "gguf": gguf_path}, hf


def _hf_model(path):
    """The reference in eager attention: the one that soft-caps Gemma 2's scores."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _hf_decode_logits(hf, ids: list[int]) -> torch.Tensor:
    """The logits of each position as transformers computes them one token at a time over a cache."""
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0] for t in ids])


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens; min_new_tokens keeps transformers going past EOS by banning it."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers_in_one_pass_chunks_and_decodes(family, fmt):
    name, paths, hf = family
    loaded = load_model(paths[fmt], dtype=torch.float32)
    model_type = hf.config.model_type.removesuffix("_text")  # Gemma 3's text model
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
    if family_name not in ("llama3", "qwen3", "phi3", "gemma2", "gemma3", "qwen2-moe", "olmoe"):
        pytest.skip("the ISA levels differ in kernels, not in families: one of each new detail")
    if family_name.startswith("gemma") and name.startswith("invariant"):
        pytest.skip("deterministic mode refuses windowed models (test_deterministic_mode_refuses_...)")
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
    # EOS banned as transformers' min_new_tokens bans it (ignore_eos alone may pick it)
    ban_eos = {hf.generation_config.eos_token_id: -100.0}
    seqs = {
        key: engine.add_request(
            key, ids, SamplingParams(max_tokens=steps[key], temperature=0, ignore_eos=True, logit_bias=ban_eos)
        )
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

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidArgument, match="unsupported GGUF architecture 'falcon'"):
        load_model(tmp_path / "g.gguf", dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "fmt"),
    [("qwen3", "safetensors"), ("phi3", "safetensors"), ("phi3", "gguf"), ("gemma2", "gguf"),
     ("gemma3", "safetensors"), ("mixtral", "safetensors"), ("qwen2-moe", "gguf"), ("qwen3-moe", "gguf")],
)  # fmt: skip
def test_tensor_parallel_2_matches_transformers(tmp_path_factory, name, fmt):
    """TP=2: Q/K norms replicated, Phi-3's fused weights split per rank (a rank reads its rows);
    Gemma's extra norms act on the reduced outputs, its logits are capped after the gather; each
    expert's intermediate dimension split with the router replicated (Mixtral's HF names;
    Qwen3-MoE's stacked GGUF experts and its dense layer)."""
    path = write_family(tmp_path_factory.mktemp(name) / name, name, seed=3)
    model_path = write_gguf(path, path.parent / f"{name}.gguf") if fmt == "gguf" else path
    hf = _hf_model(path)
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


def _gemma_variant(hf, **changes):
    config = copy.deepcopy(hf.config)
    for key, value in changes.items():
        setattr(config, key, value)
    variant = type(hf)(config).eval()
    variant.load_state_dict(hf.state_dict())
    return variant


def test_the_gemma_checks_see_the_window_and_the_soft_caps(family):
    """Each Gemma detail moves the logits far beyond the tolerance, so the parity above checks it:
    the window (against attending to the whole context), Gemma 2's soft-capping, Gemma 3's RoPE."""
    name, _, hf = family
    if not name.startswith("gemma"):
        pytest.skip("Gemma only")
    ref = _hf_logits(hf, LONG_IDS)
    moved = {"window": _gemma_variant(hf, sliding_window=4096)}
    if name == "gemma2":
        moved["attention soft-cap"] = _gemma_variant(hf, attn_logit_softcapping=None)
        moved["final soft-cap"] = _gemma_variant(hf, final_logit_softcapping=None)
    if name == "gemma3":  # the local layers' own RoPE base, the global layers' linear scaling
        rope = hf.config.rope_parameters
        moved["local RoPE base"] = _gemma_variant(hf, rope_parameters={**rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}})  # fmt: skip
        moved["global scaling"] = _gemma_variant(hf, rope_parameters={**rope, "full_attention": {
            "rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}})  # fmt: skip
    for what, variant in moved.items():
        assert max_rel_diff(_hf_logits(variant, LONG_IDS), ref) > 100 * TOLERANCE, what


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemma_chunked_prefill_and_batching_through_the_engine_match_transformers(family, fmt):
    """The scheduler's own chunks (16 tokens a step, across the 8-token window), prompts of
    different lengths in one batch and decodes beside prefill chunks: each sequence's greedy
    tokens as transformers generates it alone."""
    name, paths, hf = family
    if not name.startswith("gemma"):
        pytest.skip("Gemma only")
    scheduler = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    engine = LLMEngine.from_args(EngineArgs(model=str(paths[fmt]), dtype="float32", scheduler=scheduler))
    prompts = {"a": LONG_IDS[:3], "b": LONG_IDS[5:50], "c": LONG_IDS[60:90], "d": LONG_IDS[100:111]}
    seqs = {
        key: engine.add_request(
            key, ids, SamplingParams(max_tokens=2 * GEMMA_WINDOW + 4, temperature=0, ignore_eos=True)
        )
        for key, ids in prompts.items()
    }
    while engine.has_unfinished():
        engine.step()
    for key, ids in prompts.items():
        assert seqs[key].output_token_ids == _hf_greedy(hf, ids, 2 * GEMMA_WINDOW + 4), key


def test_gemma_query_pre_attn_scalar_sets_the_softmax_scale(tmp_path):
    """Gemma 2 27B's scalar (hidden / heads, not head_dim): read from config.json."""
    path = write_family(tmp_path / "g", "gemma2", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["query_pre_attn_scalar"] = 48
    (path / "config.json").write_text(json.dumps(config))
    hf = _hf_model(path)
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.spec.attention_scale == 48**-0.5
    assert max_rel_diff(prefill_logits(loaded.model, LONG_IDS[:60]), _hf_logits(hf, LONG_IDS[:60])) <= TOLERANCE


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration's config.json (the text model's settings in text_config,
    only those that differ from the defaults) and its weights under the language model's prefix,
    beside a vision tower that text serving leaves unread."""
    from safetensors.torch import load_file, save_file

    text = write_family(tmp_path / "text", "gemma3", seed=3)
    hf = _hf_model(text)
    config = json.loads((text / "config.json").read_text())
    multi = tmp_path / "multi"
    multi.mkdir()
    for f in text.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (multi / f.name).write_bytes(f.read_bytes())
    text_config = {k: v for k, v in config.items() if k not in ("architectures", "dtype", "transformers_version")}
    for key, default in (("head_dim", 256), ("query_pre_attn_scalar", 256), ("rms_norm_eps", 1e-6)):
        assert text_config[key] != default  # kept: they differ from Gemma3TextConfig's
    text_config.pop("final_logit_softcapping", None)  # None, the default: left out
    (multi / "config.json").write_text(
        json.dumps(
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_config}
        )
    )
    tensors = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in load_file(str(text / "model.safetensors")).items()
    }
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(tensors, str(multi / "model.safetensors"))
    loaded = load_model(multi, dtype=torch.float32)
    assert loaded.spec.architecture == "gemma3" and loaded.spec.sliding_layers == (0, 1, 2, 3, 4)
    assert max_rel_diff(prefill_logits(loaded.model, LONG_IDS), _hf_logits(hf, LONG_IDS)) <= TOLERANCE


def test_mistral_sliding_window_matches_transformers_past_the_window(tmp_path):
    """Mistral attends over its window on every layer: one pass, chunks and decodes at 3x the
    window, and greedy tokens through the engine (the context is not capped at the window)."""
    path = tmp_path / "mistral"
    write_family(path, "llama3", seed=3)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    hf = _hf_model(path)
    assert type(hf).__name__ == "MistralForCausalLM"
    ids = LONG_IDS[:50]
    ref = _hf_logits(hf, ids)
    model = load_model(path, dtype=torch.float32).model
    for chunk in (None, 7, 1):
        assert max_rel_diff(prefill_logits(model, ids, chunk=chunk), ref) <= TOLERANCE, chunk
    assert max_rel_diff(_hf_logits(_gemma_variant(hf, sliding_window=None), ids), ref) > 100 * TOLERANCE
    engine = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32"))
    assert engine.max_model_len > 16
    seq = engine.add_request("r", ids[:20], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == _hf_greedy(hf, ids[:20], 32)


def test_deterministic_mode_refuses_a_windowed_model_by_name(family):
    name, paths, _ = family
    if name != "gemma2":
        pytest.skip("one windowed, soft-capped model")
    with pytest.raises(InvalidArgument, match="no sliding window or soft-capping"):
        load_model(paths["gguf"], dtype=torch.float32).model.make_batch_invariant()
