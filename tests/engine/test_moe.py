"""Mixtures of experts in the engine (runtime/moe.py): grouped routing against a per-token
reference, untouched experts not called, batch invariance under deterministic ops, the per-step
weight-bytes counter, GGUF-quantized experts, the HF and GGUF specs of each family, clip_qkv, and
the tensor-parallel split of experts. Parity with transformers (TP=2 too) is
tests/engine/test_families.py's."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace

import pytest
import torch

from servelab.errors import InvalidArgument
from servelab.runtime import block_quant
from servelab.runtime.linear import DenseLinear, Linear
from servelab.runtime.loader import load_model
from servelab.runtime.moe import MoEMLP
from servelab.runtime.parallel.sharding import Slice, check_tensor_parallel
from servelab.spec.model import ModelSpec
from tests.tiny_families import MOE_FAMILIES, write_family, write_gguf
from tests.tiny_models import max_rel_diff, prefill_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

IDS = [int(t) for t in torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(2))]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, dict[str, object]]:
    out = {}
    for name in MOE_FAMILIES:
        hf = write_family(tmp_path_factory.mktemp(name) / name, name, seed=3)
        out[name] = {"safetensors": hf, "gguf": write_gguf(hf, hf.parent / f"{name}.gguf")}
    return out


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _random_moe(experts: int = 8, k: int = 2, hidden: int = 32, ffn: int = 48, normalize: bool = True) -> MoEMLP:
    gen = torch.Generator().manual_seed(0)

    def lin(out: int, inp: int) -> Linear:
        return DenseLinear(torch.randn(out, inp, generator=gen) / inp**0.5)

    return MoEMLP(
        router=DenseLinear(torch.randn(experts, hidden, generator=gen)),
        gate_up=[lin(2 * ffn, hidden) for _ in range(experts)],
        down=[lin(hidden, ffn) for _ in range(experts)],
        top_k=k,
        normalize=normalize,
    )


@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_experts_compute_what_each_token_through_its_experts_does(normalize):
    moe = _random_moe(normalize=normalize)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(moe.router(x), dim=-1)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):  # the per-token definition
        w, ids = torch.topk(probs[t], moe.top_k)
        w = w / w.sum() if normalize else w
        for weight, e in zip(w.tolist(), ids.tolist()):
            ref[t] += weight * moe.down[e](_silu_mul(moe.gate_up[e](x[t : t + 1])))[0]
    assert torch.allclose(moe(x, _silu_mul), ref, atol=1e-5, rtol=1e-5)


@dataclass(slots=True)
class _Recording:
    """A linear that records the rows of each call before the one it wraps computes."""

    inner: Linear
    calls: list[int]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.inner(x)


def test_only_the_experts_some_token_chose_run_each_once_over_its_tokens():
    moe = _random_moe()
    calls: dict[int, list[int]] = {e: [] for e in range(moe.num_experts)}
    moe.gate_up = [_Recording(w, calls[e]) for e, w in enumerate(moe.gate_up)]  # type: ignore[misc]  # a test double
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(5))
    _, ids = moe.route(x)
    moe(x, _silu_mul)
    chosen = sorted(ids[0].tolist())
    assert moe.experts_hit == tuple(chosen)
    assert {e: c for e, c in calls.items() if c} == {e: [1] for e in chosen}  # the other six never called
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(6))
    for c in calls.values():
        c.clear()
    _, ids = moe.route(x)
    moe(x, _silu_mul)
    per_expert = torch.bincount(ids.reshape(-1), minlength=moe.num_experts).tolist()
    assert {e: c for e, c in calls.items() if c} == {e: [n] for e, n in enumerate(per_expert) if n}  # one GEMM each


def test_a_token_s_output_does_not_depend_on_its_batch_under_deterministic_ops(paths):
    model = load_model(paths["mixtral"]["safetensors"], dtype=torch.float32).model
    model.make_batch_invariant()
    layer = model.layers[0]
    assert layer.moe is not None
    x = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    together = layer.moe(x, model.ops.silu_mul)
    alone = torch.cat([layer.moe(x[t : t + 1], model.ops.silu_mul) for t in range(x.shape[0])])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_a_step_counts_the_dense_weights_and_the_experts_it_ran(paths, name):
    model = load_model(paths[name]["safetensors"], dtype=torch.float32).model
    spec = model.config
    moe_layers = [layer.moe for layer in model.layers if layer.moe is not None]
    assert len(moe_layers) == spec.num_moe_layers
    expert_bytes = moe_layers[0].expert_nbytes(0)
    dense = model.dense_weight_bytes()
    assert model.weight_bytes() == dense + spec.num_moe_layers * spec.num_experts * expert_bytes
    prefill_logits(model, IDS[:1])  # one token: k experts a MoE layer
    assert model.step_weight_bytes() == dense + spec.num_moe_layers * spec.num_active_experts * expert_bytes
    prefill_logits(model, IDS)  # 60 tokens: every expert
    assert model.step_weight_bytes() == model.weight_bytes()
    # the counter agrees with the spec: every parameter but the embedding, 4 bytes each
    assert model.weight_bytes() == 4 * (
        spec.num_params - spec.embedding_params + spec.lm_head_params * spec.tie_embeddings
    )


def test_gguf_q8_0_experts_stay_blocks_and_stay_close(paths, tmp_path):
    path = write_gguf(paths["mixtral"]["safetensors"], tmp_path / "mixtral-q8.gguf", qtype="Q8_0")
    q8 = load_model(path, dtype=torch.float32).model
    moe = q8.layers[0].moe
    assert moe is not None and all(isinstance(w, block_quant.BlockQuantLinear) for w in moe.linears())
    assert isinstance(moe.router, DenseLinear) and moe.router.weight.dtype == torch.float32  # the router stays exact
    ref = load_model(paths["mixtral"]["gguf"], dtype=torch.float32).model
    ids = IDS[:40]
    assert 0 < max_rel_diff(prefill_logits(q8, ids), prefill_logits(ref, ids)) < 0.05
    # a quantized expert reads its blocks: about a quarter of its fp32 bytes (34 bytes per 32 weights)
    assert moe.expert_nbytes(0) == pytest.approx(ref.layers[0].moe.expert_nbytes(0) * 34 / 128)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_hf_and_gguf_give_one_spec(paths, name):
    from_hf = ModelSpec.from_hf_config(paths[name]["safetensors"])
    from_gguf = ModelSpec.from_gguf(paths[name]["gguf"])
    assert (
        replace(from_gguf, name=from_hf.name, rms_norm_eps=from_hf.rms_norm_eps, architecture=from_hf.architecture)
        == from_hf
    )
    assert from_hf.is_moe and (from_hf.num_experts, from_hf.num_active_experts) == (8, 2)
    expected = {"mixtral": ((), True, 0), "qwen2-moe": ((1,), False, 64), "qwen3-moe": ((1,), True, 0),
                "olmoe": ((), False, 0)}[name]  # fmt: skip
    assert (from_hf.dense_layers, from_hf.norm_topk_prob, from_hf.shared_ffn_size) == expected
    hf = transformers.AutoModelForCausalLM.from_pretrained(paths[name]["safetensors"])
    assert from_hf.num_params == sum(p.numel() for p in hf.parameters())


def test_qwen3_moe_reads_its_expert_and_dense_mlp_sizes():
    config = {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
        "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 100, "max_position_embeddings": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3],
    }  # fmt: skip
    spec = ModelSpec.from_hf_config(config)
    # HF's rule: layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    assert (spec.ffn_size, spec.dense_ffn_size, spec.dense_layers, spec.num_moe_layers) == (32, 96, (0, 2, 3), 1)
    assert not spec.norm_topk_prob and spec.qk_norm and spec.qk_norm_per_head
    with pytest.raises(InvalidArgument, match="decoder_sparse_step must be a positive integer"):
        ModelSpec.from_hf_config({**config, "decoder_sparse_step": 0})
    with pytest.raises(InvalidArgument, match="mlp_only_layers must be a list"):
        ModelSpec.from_hf_config({**config, "mlp_only_layers": "3"})


def test_qwen2_moe_s_shared_expert_changes_the_logits_so_parity_checks_it(paths):
    """The shared expert and its gate move the logits far beyond the parity tolerance, so the
    family's parity test checks them; and under TP each rank holds its slice of the shared expert."""
    from servelab.runtime.parallel.sharding import Shard

    path = paths["qwen2-moe"]["safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    without = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in without.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.fill_(-1e4)  # sigmoid -> 0: the shared expert off
        ref, off = (m(torch.tensor([IDS])).logits[0] for m in (hf, without))
    assert max_rel_diff(off, ref) > 1e-3
    ours = prefill_logits(load_model(path, dtype=torch.float32).model, IDS)
    assert max_rel_diff(ours, ref) <= 1e-5
    spec = ModelSpec.from_hf_config(path)
    shard = Shard(spec, 1, 2)
    assert shard.local_spec().shared_ffn_size == 32
    assert shard.slice_of("model.layers.0.mlp.shared_expert.up_proj.weight").start == 32
    assert shard.slice_of("model.layers.0.mlp.shared_expert.down_proj.weight").dim == 1
    assert shard.slice_of("model.layers.0.mlp.shared_expert_gate.weight") is None  # replicated
    with pytest.raises(InvalidArgument, match="shared expert's MLP size 64"):
        Shard(replace(spec, num_heads=5 * 4, num_kv_heads=5, ffn_size=40, dense_ffn_size=40), 0, 5)


def test_olmoe_s_clip_qkv_changes_the_logits_so_parity_checks_it(paths):
    path = paths["olmoe"]["safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = copy.deepcopy(hf.config)
    config.clip_qkv = None
    unclipped = type(hf)(config).eval()
    unclipped.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref, loose = (m(torch.tensor([IDS])).logits[0] for m in (hf, unclipped))
    assert max_rel_diff(loose, ref) > 1e-3
    ours = prefill_logits(load_model(path, dtype=torch.float32).model, IDS)
    assert max_rel_diff(ours, ref) <= 1e-5


def test_tensor_parallel_splits_each_expert_and_names_a_size_that_does_not_divide(paths):
    from servelab.runtime.parallel.sharding import Shard

    spec = ModelSpec.from_hf_config(paths["qwen3-moe"]["safetensors"])  # experts' ffn 32, dense layer's 128
    shard = Shard(spec, 1, 2)
    assert (shard.local_spec().ffn_size, shard.local_spec().dense_ffn_size) == (16, 64)
    p = "model.layers.0."
    assert shard.slice_of(p + "mlp.experts.5.up_proj.weight") == Slice(0, 16, 32)
    assert shard.slice_of(p + "mlp.experts.5.down_proj.weight") == Slice(1, 16, 32)
    assert shard.slice_of("model.layers.1.mlp.gate_proj.weight") == Slice(0, 64, 128)  # the dense layer
    assert shard.slice_of(p + "mlp.gate.weight") is None  # the router: whole on every rank
    with pytest.raises(InvalidArgument, match="must divide each expert's MLP size 32"):
        check_tensor_parallel(replace(spec, num_heads=12, num_kv_heads=3), 3)


def test_a_moe_config_with_a_bad_expert_count_is_named(paths, tmp_path):
    config = json.loads((paths["olmoe"]["safetensors"] / "config.json").read_text())
    with pytest.raises(InvalidArgument, match="num_active_experts \\(9\\) exceeds num_experts \\(8\\)"):
        ModelSpec.from_hf_config({**config, "num_experts_per_tok": 9})


def test_int8_quantizes_the_experts_and_leaves_the_router_exact(paths):
    from servelab.runtime.quantization import LINEARS

    ref = load_model(paths["qwen3-moe"]["safetensors"], dtype=torch.float32).model
    model = load_model(paths["qwen3-moe"]["safetensors"], dtype=torch.float32).model
    model.quantize("int8")
    quantized = tuple(LINEARS.values())
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    assert all(isinstance(w, quantized) for w in moe.linears()) and not isinstance(moe.router, quantized)
    # int8's error flips the top-k of a few near-tied tokens, which moves their logits far more
    # than in a dense model (0.27 of the largest logit here against 0.03): compare the argmax
    ids = IDS[:40]
    ours, exact = prefill_logits(model, ids), prefill_logits(ref, ids)
    assert not torch.equal(ours, exact) and (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_gguf_with_one_tensor_per_expert_loads_like_the_stacked_one(paths, tmp_path):
    path = write_gguf(paths["mixtral"]["safetensors"], tmp_path / "mixtral-per-expert.gguf", stack_experts=False)
    stacked = prefill_logits(load_model(paths["mixtral"]["gguf"], dtype=torch.float32).model, IDS)
    assert torch.equal(prefill_logits(load_model(path, dtype=torch.float32).model, IDS), stacked)
