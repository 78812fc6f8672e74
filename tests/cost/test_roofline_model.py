"""Mechanics of the roofline: one function for every step shape, TP, MoE, dtypes, efficiencies."""

import random
from dataclasses import replace

import pytest

from servelab.cost import Efficiency, Roofline, StepCostModel
from servelab.cost.roofline import overlap
from servelab.errors import InvalidArgument
from servelab.spec import get_hardware, get_model

H100 = get_hardware("h100-sxm")
LLAMA8B = get_model("llama-3.1-8b")


def brute_force_totals(shape):
    """Walk every query token: it attends to every cached key and to itself and those before it."""
    tokens = pairs = 0
    for q, c in shape:
        cached = c - q
        for i in range(q):
            tokens += 1
            pairs += cached + i + 1
    return tokens, len(shape), sum(c for _, c in shape), pairs


def test_totals_match_a_per_token_walk():
    rng = random.Random(7)
    for _ in range(200):
        shape = []
        for _ in range(rng.randint(1, 12)):
            q = rng.choice([1, 1, 1, rng.randint(1, 300)])
            shape.append((q, q + rng.randint(0, 500)))
        assert Roofline.totals(shape) == brute_force_totals(shape)


def test_step_time_s_is_the_full_step_time():
    r = Roofline(LLAMA8B, H100)
    rng = random.Random(3)
    for _ in range(50):
        shape = [(q, q + rng.randint(0, 4000)) for q in (rng.choice([1, 64, 512]) for _ in range(rng.randint(1, 40)))]
        assert r.step_time_s(shape) == pytest.approx(r.step(shape).time_s, rel=1e-12)
    assert r.step_time_s([]) == 0.0 and r.step([]).time_s == 0.0


def test_prefill_chunks_decode_and_mixed_batches_share_one_function():
    r = Roofline(LLAMA8B, H100)
    decode = [(1, 2048)] * 32
    chunk = [(512, 1024)]
    mixed = r.step(decode + chunk)
    alone_decode, alone_chunk = r.step(decode), r.step(chunk)
    # FLOPs add up; the weights are read once for the whole step
    assert mixed.flops == pytest.approx(alone_decode.flops + alone_chunk.flops)
    assert mixed.weight_bytes == alone_decode.weight_bytes == alone_chunk.weight_bytes
    assert max(alone_decode.time_s, alone_chunk.time_s) < mixed.time_s < alone_decode.time_s + alone_chunk.time_s
    # a prompt prefilled in two chunks attends to exactly the pairs of a one-shot prefill
    whole = Roofline.totals([(2048, 2048)])
    halves = [Roofline.totals([(1024, 1024)]), Roofline.totals([(1024, 2048)])]
    assert whole[3] == halves[0][3] + halves[1][3]
    assert r.decode(8, 1000).flops == pytest.approx(r.step([(1, 1000)] * 8).flops)


def test_breakdown_is_consistent():
    r = Roofline(LLAMA8B, H100)
    s = r.step([(1, 3000)] * 20 + [(256, 256)])
    assert s.total_bytes == pytest.approx(s.weight_bytes + s.kv_read_bytes + s.kv_write_bytes + s.activation_bytes)
    assert s.kv_write_bytes == (20 + 256) * 131_072
    assert s.arithmetic_intensity == pytest.approx(s.flops / s.total_bytes)
    assert s.time_s == pytest.approx(
        overlap(s.compute_time_s, s.memory_time_s, r.overlap_sharpness) + s.comm_time_s + s.overhead_s
    )
    # near the ridge the two sides overlap imperfectly (H100's measured steps): above max(), below the sum
    assert max(s.compute_time_s, s.memory_time_s) < s.time_s - s.comm_time_s - s.overhead_s
    assert s.time_s - s.comm_time_s - s.overhead_s < s.compute_time_s + s.memory_time_s
    eff = r.efficiency
    assert s.compute_time_s == pytest.approx(s.peak_compute_time_s / eff.compute_fraction)
    assert s.memory_time_s == pytest.approx(s.peak_memory_time_s / eff.bandwidth_fraction)
    assert s.bound == ("compute" if s.compute_time_s > s.memory_time_s else "memory")
    for batch in (1, 300, 600, 2000):  # the bound flips at the ridge of the achievable rates
        d = r.decode(batch, 64)
        assert (d.bound == "compute") == (d.arithmetic_intensity > r.achievable_ridge_flops_per_byte)
    assert set(s.to_dict()) >= {"time_s", "flops", "bound", "arithmetic_intensity", "ridge_flops_per_byte"}


def test_efficiencies_are_explicit_parameters():
    base = Roofline(LLAMA8B, H100)
    slower = Roofline(LLAMA8B, H100, efficiency=Efficiency(bandwidth_fraction=base.efficiency.bandwidth_fraction / 2))
    fast = Roofline(
        LLAMA8B,
        H100,
        efficiency=Efficiency(
            bandwidth_fraction=1.0,
            compute_fraction=1.0,
            step_overhead_s=0.0,
            per_layer_overhead_s=0.0,
            per_seq_overhead_s=0.0,
        ),
    )
    # batch 1 is memory-bound by ~300x: the overlap adds under 0.01% to the weight stream
    assert fast.decode(1, 1).time_s == pytest.approx(fast.decode(1, 1).peak_memory_time_s, rel=1e-4)
    assert slower.decode(1, 1).memory_time_s == pytest.approx(2 * base.decode(1, 1).memory_time_s)
    layered = Roofline(
        LLAMA8B, H100, efficiency=Efficiency(per_layer_overhead_s=1e-5, step_overhead_s=0.0, per_seq_overhead_s=0.0)
    )
    assert layered.decode(1, 1).overhead_s == pytest.approx(32 * 1e-5)
    with pytest.raises(InvalidArgument, match="bandwidth_fraction"):
        Efficiency(bandwidth_fraction=1.5)
    with pytest.raises(InvalidArgument, match="step_overhead_s"):
        Efficiency(step_overhead_s=-1)


def test_tensor_parallel_splits_weights_and_kv_and_adds_all_reduce():
    one = Roofline(get_model("llama-3.1-70b"), H100, tp=1)
    four = Roofline(get_model("llama-3.1-70b"), H100, tp=4)
    s1, s4 = one.decode(16, 4096), four.decode(16, 4096)
    assert s4.weight_bytes == pytest.approx(s1.weight_bytes / 4)
    assert s4.kv_read_bytes == pytest.approx(s1.kv_read_bytes / 4)
    assert s4.flops == pytest.approx(s1.flops / 4)
    assert s1.comm_time_s == 0 and s4.comm_time_s > 0
    assert s4.time_s < s1.time_s
    # all-reduce bytes grow with the tokens of the step
    assert four.prefill(4096).comm_time_s > 10 * s4.comm_time_s
    # more devices than KV heads: each device keeps one KV head, not a fraction
    seventy_tp16 = Roofline(get_model("llama-3.1-70b"), H100, tp=16)
    assert seventy_tp16.kv_bytes_per_token == one.kv_bytes_per_token / 8
    with pytest.raises(InvalidArgument, match="tp=3 does not divide"):
        Roofline(LLAMA8B, H100, tp=3)


def test_moe_reads_only_the_experts_its_tokens_hit():
    r = Roofline(get_model("mixtral-8x7b"), H100, tp=2)
    one, few, many = r.decode(1, 512), r.decode(4, 512), r.decode(256, 512)
    assert one.weight_bytes < few.weight_bytes < many.weight_bytes
    all_weights = r.memory.weight_bytes_per_device
    embedding = get_model("mixtral-8x7b").embedding_params * 2 / 2
    assert many.weight_bytes == pytest.approx(all_weights - embedding, rel=1e-6)
    # batch 1 touches 2 of 8 experts per layer
    spec = get_model("mixtral-8x7b")
    experts_all = spec.num_layers * 8 * spec.expert_params_per_layer * 2 / 2
    assert one.weight_bytes == pytest.approx(all_weights - embedding - experts_all * 6 / 8, rel=1e-6)
    # compute follows active parameters, not total
    dense_equiv = Roofline(get_model("mistral-7b"), H100, tp=2)
    assert one.flops < 2 * dense_equiv.decode(1, 512).flops


def test_a_shared_expert_streams_every_step_and_computes_every_token():
    spec = get_model("qwen2-57b-a14b")  # 64 experts of 2,560, top 8, a shared expert of 20,480
    r = Roofline(spec, H100, tp=4)
    one, many = r.decode(1, 512), r.decode(512, 512)
    embedding = spec.embedding_params * 2 / 4
    experts_all = spec.num_layers * 64 * spec.expert_params_per_layer * 2 / 4
    # batch 1: everything but the embedding and 56 of 64 experts, the shared expert included
    assert one.weight_bytes == pytest.approx(r.memory.weight_bytes_per_device - embedding - experts_all * 56 / 64)
    assert many.weight_bytes == pytest.approx(r.memory.weight_bytes_per_device - embedding, rel=1e-6)
    shared = spec.num_layers * spec.shared_expert_params_per_layer
    assert shared == 28 * (3 * 3584 * 20480 + 3584)
    without = Roofline(replace(spec, shared_ffn_size=0), H100, tp=4)
    assert one.weight_bytes - without.decode(1, 512).weight_bytes == pytest.approx(shared * 2 / 4)
    assert one.flops - without.decode(1, 512).flops == pytest.approx(2 * shared / 4)


def test_weight_dtypes_change_bytes_and_compute_rate():
    bf16 = Roofline(LLAMA8B, H100)
    fp8 = Roofline(LLAMA8B, H100, weight_dtype="fp8")
    int4 = Roofline(LLAMA8B, H100, weight_dtype="int4")
    assert fp8.decode(1, 1).weight_bytes == pytest.approx(bf16.decode(1, 1).weight_bytes / 2)
    assert int4.decode(1, 1).weight_bytes == pytest.approx(bf16.decode(1, 1).weight_bytes / 4)
    assert fp8.peak_flops_per_s == pytest.approx(2 * bf16.peak_flops_per_s, rel=1e-3)
    assert int4.peak_flops_per_s == bf16.peak_flops_per_s
    assert fp8.decode(1, 2048).time_s < bf16.decode(1, 2048).time_s
    kv8 = Roofline(LLAMA8B, H100, kv_dtype="fp8")
    assert kv8.decode(64, 2048).kv_read_bytes == bf16.decode(64, 2048).kv_read_bytes / 2
    a100_fp8 = Roofline(LLAMA8B, get_hardware("a100-80gb"), weight_dtype="fp8")
    assert a100_fp8.peak_flops_per_s == 312e12  # no FP8 tensor cores: weight-only at the BF16 rate
    with pytest.raises(InvalidArgument, match="unknown weight dtype"):
        Roofline(LLAMA8B, H100, weight_dtype="fp4")


def test_conveniences_check_their_inputs():
    r = Roofline(LLAMA8B, H100)
    with pytest.raises(InvalidArgument, match="131072"):
        r.decode(1, 200_000)
    with pytest.raises(InvalidArgument, match="batch"):
        r.decode(0, 100)
    with pytest.raises(InvalidArgument, match="prompt length"):
        r.prefill(0)


def test_roofline_is_a_step_cost_model():
    assert isinstance(Roofline(get_model("smollm2-135m"), get_hardware("l4")), StepCostModel)
