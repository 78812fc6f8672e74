"""A linear layer's GEMM computes whole tiles of rows (the tile of the part's measured GEMMs), and a
MoE layer's experts each see their share of the step's tokens, T·k / (experts hit), not T: a
128-token prompt of Mixtral gives each of 8 experts 32 rows, which an FP8 GEMM on Hopper computes
as one 128-row tile, four times the useful FLOPs."""

from __future__ import annotations


import pytest

from servelab.cost import Roofline
from servelab.cost.operators import operator_costs
from servelab.cost.roofline import overlap, step_overlap, tiled_rows
from servelab.spec import get_hardware, get_model

MIXTRAL = get_model("mixtral-8x7b")


def test_tiled_rows_pads_to_whole_tiles_and_a_tile_of_one_pads_nothing():
    assert tiled_rows(32, 128) == 128
    assert tiled_rows(128, 128) == 128
    assert tiled_rows(129, 128) == 256
    assert tiled_rows(31.7, 32) == 32  # an expected (fractional) count rounds up the same way
    assert tiled_rows(31.7, 1) == 31.7  # no tile: the rows themselves, not ceil()


def test_the_tile_is_the_measured_gemms_and_one_where_none_was_measured():
    h200 = get_hardware("h200")
    assert step_overlap(h200, "fp8").tile_tokens == h200.kernels.gemm["fp8"].tile_tokens == 128
    assert step_overlap(h200, "bf16").tile_tokens == h200.kernels.gemm["bf16"].tile_tokens == 32
    h100 = get_hardware("h100-sxm")
    assert step_overlap(h100, "fp8").tile_tokens == h100.kernels.gemm["fp8"].tile_tokens == 128
    assert step_overlap(h100, "bf16").tile_tokens == 1  # Vidur's H100 fit found no step
    assert step_overlap(get_hardware("a100-80gb"), "bf16").tile_tokens == 1  # Vidur's A100 fit found no step
    assert step_overlap(get_hardware("l40s"), "fp8").tile_tokens == 1  # nothing measured on Ada


def test_a_short_moe_prefill_pays_each_experts_tile_by_hand():
    """Mixtral 8x7B, FP8 on two H200s, one 128-token prompt. Per device: attention projections
    (4096 x 6144 and 4096 x 4096) and the router (4096 x 8) see all 128 rows; each expert
    (3 x 4096 x 14336 / 2) sees 128 x 2 / 8 = 32 rows (8 experts hit: 8(1 - 0.75^128)), padded to
    one 128-row tile; the LM head (32000 x 4096 / 2) runs 1 row, padded to 128."""
    r = Roofline(MIXTRAL, get_hardware("h200"), weight_dtype="fp8", kv_dtype="fp8", tp=2)
    layers, tp = 32, 2
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    router = 4096 * 8
    expert = 3 * 4096 * 14336
    hit = 8 * (1 - 0.75**128)
    assert hit == pytest.approx(8.0, abs=1e-12)
    linear_flops = (
        2 * 128 * layers * (attention + router) / tp
        + hit * 128 * 2 * layers * expert / tp  # 32 rows per expert, one 128-row tile
        + 2 * 128 * 32000 * 4096 / tp  # the LM head's 1 row, one tile
    )
    pairs = 128 * 129 // 2
    attention_flops = pairs * 4 * layers * 32 * 128 / tp
    step = r.prefill(128)
    rate = 1978.9e12 * r.efficiency.for_format("fp8").compute_fraction
    assert step.compute_time_s == pytest.approx((linear_flops + attention_flops) / rate, rel=1e-9)
    # The useful FLOPs stay 2 x active parameters x tokens: the experts did a quarter of their tile.
    useful = 2 * 128 * layers * (attention + router + 2 * expert) / tp + 2 * 32000 * 4096 / tp + attention_flops
    assert step.flops == pytest.approx(useful, rel=1e-9)
    expert_tiled, expert_useful = hit * 128 * 2 * layers * expert / tp, 2 * 128 * 2 * layers * expert / tp
    assert expert_tiled / expert_useful == pytest.approx(4.0, rel=1e-9)


def test_at_a_full_tile_per_expert_the_padding_is_gone():
    """512 tokens top-2 of 8: 128 rows per expert, a whole tile; the experts' FLOPs are the useful
    ones and only the LM head's one row is padded."""
    r = Roofline(MIXTRAL, get_hardware("h200"), weight_dtype="fp8", kv_dtype="fp8", tp=2)
    step = r.prefill(512)
    head_padding = 2 * 127 * 32000 * 4096 / 2
    rate = 1978.9e12 * r.efficiency.for_format("fp8").compute_fraction
    assert step.compute_time_s * rate == pytest.approx(step.flops + head_padding, rel=1e-6)


@pytest.mark.parametrize("hardware", ["a100-80gb", "l40s"])
def test_without_a_tile_compute_is_the_plain_flops(hardware):
    r = Roofline(MIXTRAL, get_hardware(hardware), weight_dtype="fp16" if hardware == "a100-80gb" else "fp8", tp=2)
    for shape in ([(128, 128)], [(1, 900)] * 7, [(37, 600), (1, 50)]):
        s = r.step(shape)
        assert s.compute_time_s == pytest.approx(s.flops / r.achievable_flops_per_s, rel=1e-12)


def test_the_tiles_raise_a_short_moe_prefill_and_leave_a_dense_one_alone():
    """The same 128-token prompt: Mixtral's experts compute 4x their FLOPs (one step nearer its
    ridge: the overlap costs more), Mistral 7B's projections and MLP run exactly one tile."""
    h200 = get_hardware("h200")
    moe = Roofline(MIXTRAL, h200, weight_dtype="fp8", kv_dtype="fp8", tp=2)
    dense = Roofline(get_model("mistral-7b"), h200, weight_dtype="fp8", kv_dtype="fp8")
    for r, ratio in ((moe, 2.5), (dense, 1.0)):
        s = r.prefill(128)
        lm_head_padding = 2 * 127 * r.model.lm_head_params / r.tp
        tiled_over_useful = (s.compute_time_s * r.achievable_flops_per_s - lm_head_padding) / s.flops
        assert tiled_over_useful > ratio if ratio > 1 else tiled_over_useful == pytest.approx(1.0, rel=1e-9)
    # Nearer the ridge the overlap costs more than it would at the useful FLOPs.
    s = moe.prefill(128)
    useful = overlap(s.flops / moe.achievable_flops_per_s, s.memory_time_s, moe.overlap_sharpness)
    assert s.time_s - s.comm_time_s - s.overhead_s > useful * (1 + 1e-3)


def test_operators_price_each_linear_by_its_tiled_rows():
    r = Roofline(MIXTRAL, get_hardware("h200"), weight_dtype="fp8", kv_dtype="fp8", tp=2)
    ops = {o.name: o for o in operator_costs(r, [(128, 128)])}
    rate = r.achievable_flops_per_s
    assert ops["qkv_proj"].compute_time_s == pytest.approx(ops["qkv_proj"].flops / rate, rel=1e-12)
    mlp = ops["mlp"]
    router_flops = 32 * 2 * 128 * 4096 * 8
    expert_flops = mlp.flops - router_flops
    assert mlp.compute_time_s * rate == pytest.approx(4 * expert_flops + router_flops, rel=1e-9)
    assert ops["lm_head"].compute_time_s * rate == pytest.approx(128 * ops["lm_head"].flops, rel=1e-12)
