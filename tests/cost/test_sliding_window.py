"""Sliding-window layers in the cost model: a window layer's attention FLOPs and KV reads use at
most `window` keys per query, global layers the whole context, and a window layer's KV holds at
most `window` tokens per sequence (the engine frees the blocks that leave the window)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servelab.cost.operators import operator_costs
from servelab.cost.roofline import Roofline
from servelab.sim import SimConfig, simulate
from servelab.spec.hardware import get_hardware
from servelab.spec.model import ModelSpec, get_model
from servelab.workload import WorkloadSpec

H200 = get_hardware("h200")


def no_window(model: ModelSpec) -> ModelSpec:
    return replace(model, sliding_window=None, sliding_layers=None)


def tiny(sliding_layers: tuple[int, ...] | None) -> ModelSpec:
    return ModelSpec(
        name="tiny-window", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_size=128,
        vocab_size=256, tie_embeddings=True, max_context=64, rope_theta=10000.0, sliding_window=4,
        sliding_layers=sliding_layers,
    )  # fmt: skip


def test_gemma_2_at_8k_caps_the_window_layers_attention_and_kv():
    gemma = get_model("gemma-2-9b")
    windowed, full = Roofline(gemma, H200), Roofline(no_window(gemma), H200)
    assert gemma.sliding_window == 4096 and len(gemma.sliding_layers or ()) == gemma.num_layers // 2
    w, f = windowed.decode(32, 8192), full.decode(32, 8192)
    # Half the layers read 4,096 of 8,192 keys: 3/4 of the KV read and of the attention FLOPs.
    assert w.kv_read_bytes == pytest.approx(0.75 * f.kv_read_bytes, rel=1e-12)
    attention_flops = 32 * 8192 * 4.0 * gemma.num_layers * gemma.num_heads * gemma.head_dim
    assert f.flops - w.flops == pytest.approx(0.25 * attention_flops, rel=1e-12)
    assert (w.weight_bytes, w.kv_write_bytes, w.activation_bytes) == (
        f.weight_bytes,
        f.kv_write_bytes,
        f.activation_bytes,
    )
    assert w.time_s < f.time_s
    # Capacity: the window layers hold 4,096 of 8,192 tokens each: a sequence takes 3/4 of the bytes.
    wm, fm = windowed.memory, full.memory
    assert wm.kv_capacity_tokens == fm.kv_capacity_tokens  # tokens of every layer
    assert wm.kv_bytes(1, 8192) == pytest.approx(0.75 * fm.kv_bytes(1, 8192), rel=1e-12)
    assert wm.max_batch(8192) == int(wm.kv_capacity_bytes // (0.75 * 8192 * wm.kv_bytes_per_token_per_device))
    assert wm.max_batch(8192) >= 4 * fm.max_batch(8192) // 3 > fm.max_batch(8192)
    assert wm.fits(wm.max_batch(8192), 8192) and not wm.fits(wm.max_batch(8192) + 1, 8192)
    assert wm.max_batch(4096) == fm.max_batch(4096)  # inside the window: every layer its whole context
    # Inside the window, the two price the same step.
    assert windowed.decode(8, 4096) == full.decode(8, 4096)


@pytest.mark.parametrize("layers", [(0,), None])  # Gemma-style one of two; Mistral-style every layer
def test_a_tiny_window_model_is_priced_by_hand(layers):
    model = tiny(layers)
    rl = Roofline(model, H200)
    kv_per_layer_token = 2 * model.num_kv_heads * model.head_dim * 2  # bf16
    # A 3-token chunk at positions 3..5 and a decode at context 9, window 4.
    shape = [(3, 6), (1, 9)]
    full_keys, window_keys = 6 + 9, 4 + 4
    full_pairs, window_pairs = (4 + 5 + 6) + 9, (4 + 4 + 4) + 4
    local = 2 if layers is None else 1
    keys_read = (2 - local) * full_keys + local * window_keys  # summed over the layers
    pairs = (2 - local) * full_pairs + local * window_pairs
    cost = rl.step(shape)
    assert cost.kv_read_bytes == keys_read * kv_per_layer_token
    matmul_flops = 4 * 2.0 * model.matmul_params_per_token + 2 * 2.0 * model.lm_head_params
    assert cost.flops == pytest.approx(matmul_flops + pairs * 4.0 * model.num_heads * model.head_dim, rel=1e-12)
    assert rl.step_time_s(shape) == pytest.approx(cost.time_s, rel=1e-12)  # two summation orders
    ops = operator_costs(rl, shape)
    assert sum(op.flops for op in ops) == pytest.approx(cost.flops, rel=1e-12)
    attention = next(op for op in ops if op.name == "attention")
    assert attention.flops == pytest.approx(pairs * 4.0 * model.num_heads * model.head_dim, rel=1e-12)


def test_a_model_without_a_window_keeps_the_plain_sums_and_the_simulators_fast_path():
    llama = Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))
    shape = [(100, 300), (1, 2048), (1, 17)]
    assert llama.step_totals(shape) == Roofline.totals(shape)
    assert llama.time_from_totals is not None
    assert llama.time_from_totals(*Roofline.totals(shape)) == llama.step_time_s(shape)
    # A window layer's keys depend on each sequence's context, which the plain sums lose.
    assert Roofline(get_model("gemma-2-9b"), H200).time_from_totals is None


def test_the_simulator_prices_a_windowed_model_from_each_steps_shape():
    from servelab.core.config import SchedulerConfig
    from servelab.core.scheduler import Scheduler
    from servelab.core.sequence import SamplingParams, Sequence
    from servelab.sim.executor import SimExecutor

    gemma = get_model("gemma-2-9b")
    windowed, full = Roofline(gemma, H200), Roofline(no_window(gemma), H200)
    ex = SimExecutor(windowed)
    s = Scheduler(
        SchedulerConfig(num_blocks=2000, block_size=16, max_num_batched_tokens=2048, max_num_seqs=4, max_model_len=8192)
    )
    for i in range(4):
        s.add(Sequence(f"r{i}", list(range(5000 + 100 * i)), SamplingParams(max_tokens=8, ignore_eos=True)), 0.0)
    now, past_window = 0.0, 0
    while s.has_unfinished():
        plan = s.schedule(now)
        shape = plan.shape()
        res = ex.execute(plan)
        assert res.duration_s == windowed.step_time_s(shape)
        if max(c for _, c in shape) > gemma.sliding_window:
            past_window += 1
            assert res.duration_s < full.step_time_s(shape)
        now += res.duration_s
        s.update(plan, res, now, finished_only=True)
    assert past_window > 8


def test_sim_runs_a_windowed_model_end_to_end():
    workload = WorkloadSpec(num_requests=8, input_len="6000", output_len="32")
    runs = {
        name: simulate(SimConfig(model=model, hardware="h200"), workload)
        for name, model in [("window", get_model("gemma-2-9b")), ("full", no_window(get_model("gemma-2-9b")))]
    }
    assert runs["window"].summary.completed == runs["full"].summary.completed == 8
    assert runs["window"].summary.tpot_s.mean < runs["full"].summary.tpot_s.mean


def test_the_simulators_windowed_pool_has_a_page_per_group_and_holds_more_sequences():
    """Gemma 2 9B's pages hold its 21 local or its 21 global layers: twice as many as blocks of
    all 42, the same longest prompt, and a longer lone context (the local layers' blocks are
    freed past the window). At 20% of an H200, 16 requests of 6,000 + 200 tokens wait less."""
    from servelab.sim.runner import scheduler_config

    gemma = get_model("gemma-2-9b")
    configs = {name: SimConfig(model=m, hardware="h200", memory_fraction=0.2)
               for name, m in (("window", gemma), ("full", no_window(gemma)))}  # fmt: skip
    window, full = (scheduler_config(c) for c in configs.values())
    assert window.kv_group_windows == (None, 4096) and full.kv_group_windows == (None,)
    assert abs(window.num_blocks - 2 * full.num_blocks) <= 1
    assert abs(window.kv_capacity_tokens - full.kv_capacity_tokens) <= 16
    assert window.kv_context_tokens > 1.7 * full.kv_capacity_tokens
    workload = WorkloadSpec(num_requests=16, input_len="6000", output_len="200")
    runs = {name: simulate(c, workload) for name, c in configs.items()}
    assert runs["window"].summary.completed == runs["full"].summary.completed == 16
    assert runs["window"].summary.ttft_s.mean < 0.9 * runs["full"].summary.ttft_s.mean
