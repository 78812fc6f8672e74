"""The seed text's claims, shown by the simulator (Llama 3.1 8B on an H100 SXM, roofline cost)."""

import numpy as np
import pytest

from servelab.core.config import SchedulerConfig
from servelab.cost.roofline import Roofline
from servelab.sim import SimConfig, simulate
from servelab.spec.hardware import get_hardware
from servelab.spec.model import get_model
from servelab.workload import RequestSpec, WorkloadSpec


def gaps_of(records, ids):
    return {r.request_id: np.diff(np.asarray(r.token_times_s)) for r in records if r.request_id in ids}


def long_prompt_joins_decoders(policy, budget):
    # 32 sequences are decoding when one 8,000-token prompt arrives.
    reqs = [RequestSpec(i, 0.0, prompt_tokens=128, output_tokens=300) for i in range(32)]
    reqs.append(RequestSpec(32, 0.5, prompt_tokens=8000, output_tokens=1))
    cfg = SimConfig(scheduler=SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_model_len=8192))
    result = simulate(cfg, reqs)
    assert result.summary.completed == 33
    gaps = gaps_of(result.records, {str(i) for i in range(32)})
    all_gaps = np.concatenate(list(gaps.values()))
    return float(np.median(all_gaps)), float(all_gaps.max())


def test_long_prefill_stalls_decode_and_chunking_fixes_it():
    normal_pf, max_pf = long_prompt_joins_decoders("prefill-first", 2048)
    normal_ch, max_ch = long_prompt_joins_decoders("chunked", 512)
    # The whole 8K prefill runs in one step in which nobody decodes.
    assert max_pf > 10 * normal_pf
    # Chunks of 512 tokens interleave with decode: the worst gap is at least 3x smaller.
    assert max_pf >= 3 * max_ch
    assert normal_ch == pytest.approx(normal_pf, rel=0.2)


def run_at(rate, n=300, seed=0):
    wl = WorkloadSpec(n, rate=rate, input_len="512", output_len="128", seed=seed)
    return simulate(SimConfig(), wl).summary


def test_load_raises_throughput_lowers_per_user_speed_then_ttft_explodes():
    rates = [2, 8, 24]
    summaries = [run_at(r) for r in rates]
    throughput = [s.output_throughput for s in summaries]
    per_user = [1 / s.tpot_s.mean for s in summaries]
    assert throughput[0] < throughput[1] < throughput[2]
    assert per_user[0] > per_user[1] > per_user[2]
    # Far past saturation, the queue grows as long as requests keep coming: TTFT has no bound.
    over_short, over_long = run_at(400, n=300), run_at(400, n=900)
    assert over_long.output_throughput == pytest.approx(over_short.output_throughput, rel=0.25)
    assert over_long.ttft_s.mean > 2 * over_short.ttft_s.mean
    assert over_short.ttft_s.mean > 20 * summaries[0].ttft_s.mean


def test_disaggregation_keeps_decode_clean_and_pays_the_transfer_in_ttft():
    wl = WorkloadSpec(240, rate=6.0, input_len="4096", output_len="128", seed=1)
    colo = simulate(SimConfig(replicas=2), wl)
    disagg = simulate(SimConfig(disagg=(1, 1)), wl)
    assert colo.summary.completed == disagg.summary.completed == 240
    # Colocated: prefills share steps with decodes, so the ITL tail is far above the median.
    assert colo.summary.itl_s.p99 > 2.5 * colo.summary.itl_s.p50
    # Disaggregated: the decode pool only decodes, its p99 ITL stays near the pure-decode step.
    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    roof = Roofline(model, hw)
    decode_trace = disagg.trace
    decode_idx = [s["replica"] for s in disagg.replica_stats if s["role"] == "decode"][0]
    rows = np.frombuffer(decode_trace.replica, dtype=np.int32) == decode_idx
    batch = int(np.median(np.frombuffer(decode_trace.num_seqs, dtype=np.int32)[rows]))
    pure_decode_s = roof.decode(batch, 4096 + 64).time_s
    assert disagg.summary.itl_s.p99 < 1.3 * pure_decode_s
    assert disagg.summary.itl_s.p99 < colo.summary.itl_s.p99 / 2
    # The KV move shows in TTFT: a 20x slower link adds its extra transfer time to TTFT.
    slow = simulate(SimConfig(disagg=(1, 1), link_bandwidth_bytes_per_s=2.5e9), wl)
    kv_bytes = model.kv_bytes_per_token("bf16") * 4096
    assert slow.kv_transfer_s.p50 >= kv_bytes / 2.5e9
    extra_transfer = slow.kv_transfer_s.mean - disagg.kv_transfer_s.mean
    extra_ttft = slow.summary.ttft_s.mean - disagg.summary.ttft_s.mean
    assert extra_ttft == pytest.approx(extra_transfer, rel=0.3)
    assert min(r.ttft_s for r in slow.records) > kv_bytes / 2.5e9


def test_the_steady_summary_counts_the_preemptions_of_its_stretch_only():
    wl = WorkloadSpec(120, concurrency=48, input_len="256-768", output_len="64-384", seed=3)
    result = simulate(SimConfig(scheduler=SchedulerConfig(num_blocks=300)), wl)
    whole, steady = result.summary, result.steady
    assert whole.preemptions == sum(r["preemptions"] for r in result.replica_stats) > 0
    # The stretch starts once no wave request is left running and ends at the last send.
    wave_end_s = max(r.last_token_s for r in result.records if int(r.request_id) < 48)
    last_send_s = max(r.arrival_s for r in result.records)
    assert steady.duration_s == pytest.approx(last_send_s - wave_end_s)
    # The wave's burst preempts too; the steady stretch counts only its own.
    assert 0 < steady.preemptions < whole.preemptions


def test_same_seed_same_results_and_kv_pressure_preempts_but_completes():
    wl = WorkloadSpec(120, concurrency=48, input_len="256-768", output_len="64-384", seed=3)
    # 300 blocks x 16 = 4,800 tokens of KV for 48 clients of up to 1,152 tokens each.
    cfg = SimConfig(scheduler=SchedulerConfig(num_blocks=300))
    a, b = simulate(cfg, wl), simulate(cfg, wl)
    assert a.summary.to_dict() == b.summary.to_dict()
    assert [list(r.token_times_s) for r in a.records] == [list(r.token_times_s) for r in b.records]
    assert a.summary.preemptions > 0
    assert a.summary.completed == 120 and a.summary.failed == 0
    want = {str(r.index): r.output_tokens for r in wl.generate()}
    assert all(r.output_tokens == want[r.request_id] for r in a.records)
    c = simulate(cfg, WorkloadSpec(120, concurrency=48, input_len="256-768", output_len="64-384", seed=4))
    assert c.summary.to_dict() != a.summary.to_dict()
