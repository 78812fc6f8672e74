"""A step split by operator: the split adds up to the step, decode attention stays memory-bound at
any batch while the matmuls move right with it, and prefill's matmuls sit past the ridge."""

from __future__ import annotations

import pytest

from servelab.cost import Roofline
from servelab.cost.operators import OPERATORS, operator_costs
from servelab.spec import get_hardware, get_model

CONTEXT = 2048


def roofline(model: str = "llama-3.1-8b", hardware: str = "h100-sxm", **kwargs) -> Roofline:
    return Roofline(get_model(model), get_hardware(hardware), **kwargs)


def by_name(rl: Roofline, shape) -> dict:
    ops = operator_costs(rl, shape)
    assert [o.name for o in ops] == list(OPERATORS)
    return {o.name: o for o in ops}


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-2-7b", "mixtral-8x7b", "qwen2-57b-a14b"])
@pytest.mark.parametrize("shape", [[(2048, 2048)], [(1, 2048)], [(1, 2048)] * 64, [(512, 1024), (1, 300), (1, 90)]])
def test_the_operators_add_up_to_the_step(model, shape):
    rl = roofline(model, "h200")
    ops = operator_costs(rl, shape)
    step = rl.step(shape)
    assert sum(o.flops for o in ops) == pytest.approx(step.flops, rel=1e-9)
    # The norms' weights belong to no operator: a few hundred kB of several GB.
    assert sum(o.weight_bytes for o in ops) == pytest.approx(step.weight_bytes, rel=1e-3)
    assert sum(o.weight_bytes for o in ops) < step.weight_bytes


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-2-7b"])
def test_decode_attention_stays_memory_bound_while_the_matmuls_move_right(model):
    rl = roofline(model)
    batches = [1, 8, 64, 512, 2048]
    steps = [by_name(rl, [(1, CONTEXT)] * b) for b in batches]
    attention = [s["attention"] for s in steps]
    assert all(a.bound == "memory" for a in attention)
    # Each sequence brings its own KV: attention's intensity does not grow with the batch.
    assert max(a.arithmetic_intensity for a in attention) == pytest.approx(
        min(a.arithmetic_intensity for a in attention)
    )
    assert attention[0].arithmetic_intensity < rl.ridge_flops_per_byte / 10
    for name in ("qkv_proj", "o_proj", "mlp", "lm_head"):
        intensity = [s[name].arithmetic_intensity for s in steps]
        assert intensity == sorted(intensity) and intensity[-1] > 100 * intensity[0], name
        assert steps[0][name].bound == "memory"
    # At a large enough batch the MLP turns compute-bound; attention never does.
    assert steps[-1]["mlp"].bound == "compute"


def test_prefill_matmuls_sit_past_the_ridge_and_every_point_is_under_the_roof():
    rl = roofline()
    for shape in ([(4096, 4096)], [(1, CONTEXT)] * 32):
        for o in operator_costs(rl, shape):
            roof = min(rl.peak_flops_per_s, o.arithmetic_intensity * rl.peak_bandwidth_bytes_per_s)
            assert 0 < o.attained_flops_per_s <= roof * (1 + 1e-9), o.name
    prefill = by_name(rl, [(4096, 4096)])
    for name in ("qkv_proj", "o_proj", "mlp"):
        assert prefill[name].arithmetic_intensity > rl.ridge_flops_per_byte and prefill[name].bound == "compute"
    # The LM head runs once per sequence, not per prompt token: in prefill it is still a GEMV.
    assert prefill["lm_head"].bound == "memory"


def test_gqa_raises_decode_attention_intensity_by_the_group_size():
    gqa = by_name(roofline("llama-3.1-8b"), [(1, CONTEXT)])["attention"].arithmetic_intensity
    mha = by_name(roofline("llama-2-7b"), [(1, CONTEXT)])["attention"].arithmetic_intensity
    group = get_model("llama-3.1-8b").num_heads // get_model("llama-3.1-8b").num_kv_heads
    assert gqa / mha == pytest.approx(group, rel=0.05)
