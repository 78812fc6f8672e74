import dataclasses
import json

import pytest

from servelab.cli import main
from servelab.core.config import SchedulerConfig
from servelab.core.plan import ScheduledSeq, StepPlan
from servelab.core.sequence import SamplingParams, Sequence
from servelab.sim import SimConfig, simulate
from servelab.sim.executor import SimExecutor
from servelab.workload import RequestSpec, WorkloadSpec


class LinearCost:
    """1 ms per step plus 10 us per query token: simple enough to check the clock by hand."""

    def __init__(self):
        self.shapes = []

    def step_time_s(self, shape):
        self.shapes.append(list(shape))
        return 1e-3 + 1e-5 * sum(q for q, _ in shape)


def seq(rid, n):
    return Sequence(rid, list(range(n)), SamplingParams(max_tokens=4, ignore_eos=True))


def test_executor_times_the_shape_and_skips_preloaded_kv():
    cost = LinearCost()
    ex = SimExecutor(cost, sampled_token_id=7)
    a, b = seq("a", 100), seq("b", 50)
    plan = StepPlan([ScheduledSeq(a, 100, 0, True), ScheduledSeq(b, 1, 49, True)], 101)
    res = ex.execute(plan)
    assert cost.shapes[-1] == [(100, 100), (1, 50)]
    assert res.duration_s == pytest.approx(1e-3 + 101e-5)
    assert res.sampled_token_ids == [7, 7]
    # KV of the first 99 prompt tokens arrived from a prefill replica: only the last one is computed.
    ex.preloaded["a"] = 99
    res = ex.execute(StepPlan([ScheduledSeq(a, 100, 0, True)], 100))
    assert cost.shapes[-1] == [(1, 100)] and "a" not in ex.preloaded
    # A chunk that does not sample returns None for it.
    assert ex.execute(StepPlan([ScheduledSeq(b, 10, 0, False)], 10)).sampled_token_ids == [None]


def test_executor_prices_the_schedulers_sums_as_the_roofline_prices_the_shape():
    """The roofline hot path (plan sums -> time_from_totals) gives the very time of step_time_s(shape)."""
    from servelab.core.config import SchedulerConfig
    from servelab.core.scheduler import Scheduler
    from servelab.cost.roofline import Roofline
    from servelab.spec.hardware import get_hardware
    from servelab.spec.model import get_model

    roofline = Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))
    ex = SimExecutor(roofline)
    s = Scheduler(
        SchedulerConfig(num_blocks=400, block_size=16, max_num_batched_tokens=300, max_num_seqs=8, max_model_len=8192)
    )
    for i in range(12):
        s.add(
            Sequence(f"r{i}", list(range(i, i + 40 + 37 * i)), SamplingParams(max_tokens=5 + i, ignore_eos=True)), 0.0
        )
    now, kinds, all_sample = 0.0, set(), set()
    while s.has_unfinished():
        plan = s.schedule(now)
        shape = plan.shape()
        res = ex.execute(plan)
        # A token for each entry that samples, None for a prompt chunk the budget cut short.
        assert res.sampled_token_ids == [1 if x.samples else None for x in plan.scheduled]
        all_sample.add(all(x.samples for x in plan.scheduled))
        assert res.duration_s == roofline.step_time_s(shape)
        assert plan.shape_totals()[:4] == Roofline.totals(shape)
        assert ex.last_num_decode == sum(q == 1 for q, _ in shape)
        kinds.add((ex.last_num_decode > 0, ex.last_num_decode < len(shape)))
        now += res.duration_s
        s.update(plan, res, now, finished_only=True)
    assert kinds >= {(True, False), (True, True), (False, True)}  # decode-only, mixed and prefill-only steps
    assert all_sample == {True, False}  # steps with and without a prompt chunk that samples nothing


def test_virtual_clock_matches_hand_computed_times():
    cost = LinearCost()
    reqs = [RequestSpec(0, 0.5, prompt_tokens=100, output_tokens=3)]
    r = simulate(SimConfig(cost_model=cost, scheduler=SchedulerConfig(num_blocks=64)), reqs).records[0]
    prefill = 1e-3 + 100e-5
    decode = 1e-3 + 1e-5
    assert r.first_token_s == pytest.approx(0.5 + prefill)
    assert list(r.token_times_s) == pytest.approx([0.5 + prefill, 0.5 + prefill + decode, 0.5 + prefill + 2 * decode])
    assert r.queue_s == 0.0


def test_closed_loop_never_exceeds_its_concurrency():
    wl = WorkloadSpec(60, concurrency=5, input_len="64-256", output_len="8-64", seed=2)
    result = simulate(SimConfig(cost_model=LinearCost(), scheduler=SchedulerConfig(num_blocks=2000)), wl)
    assert result.summary.completed == 60
    events = sorted(
        [(r.arrival_s, 1) for r in result.records] + [(r.end_s, -1) for r in result.records], key=lambda e: (e[0], e[1])
    )
    in_flight = peak = 0
    for _, d in events:
        in_flight += d
        peak = max(peak, in_flight)
    assert peak == 5


def test_capped_open_loop_sends_when_a_slot_frees():
    reqs = [RequestSpec(i, 0.0, prompt_tokens=32, output_tokens=10) for i in range(4)]
    result = simulate(
        SimConfig(cost_model=LinearCost(), scheduler=SchedulerConfig(num_blocks=100)), reqs, concurrency=2
    )
    arrivals = sorted(r.arrival_s for r in result.records)
    assert arrivals[:2] == [0.0, 0.0] and arrivals[2] > 0


def test_a_request_that_outgrows_the_kv_pool_is_refused_not_cut_short():
    # pool of 4 x 16 = 64 tokens: the last sampled token needs no slot, so 40 + 25 just fits
    config = SimConfig(cost_model=LinearCost(), scheduler=SchedulerConfig(num_blocks=4, block_size=16))
    fits = simulate(config, [RequestSpec(0, 0.0, prompt_tokens=40, output_tokens=25)], concurrency=1)
    assert fits.records[0].output_tokens == 25
    from servelab.errors import RequestTooLong

    with pytest.raises(RequestTooLong, match=r"prompt 40 \+ output 26 tokens can never fit a replica's KV pool of 64"):
        simulate(config, [RequestSpec(0, 0.0, prompt_tokens=40, output_tokens=26)], concurrency=1)


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding", "least-kv"])
def test_routers_spread_load_over_replicas(router):
    wl = WorkloadSpec(200, rate=400.0, input_len="128", output_len="32", seed=0)
    result = simulate(
        SimConfig(cost_model=LinearCost(), replicas=4, router=router, scheduler=SchedulerConfig(num_blocks=4000)), wl
    )
    finished = [s["finished"] for s in result.replica_stats]
    assert sum(finished) == 200
    assert min(finished) >= 30, finished
    assert result.summary.num_devices == 4


def test_disagg_tokens_come_from_the_decode_pool():
    wl = WorkloadSpec(20, rate=5.0, input_len="200", output_len="10", seed=0)
    result = simulate(SimConfig(cost_model=LinearCost(), disagg=(1, 2), scheduler=SchedulerConfig(num_blocks=1000)), wl)
    assert result.summary.completed == 20
    assert all(r.output_tokens == 10 for r in result.records)
    stats = {s["role"]: s for s in result.replica_stats}
    assert stats["prefill"]["finished"] == 20
    assert result.kv_transfer_bytes > 0 and result.kv_transfer_s.mean > 0
    assert result.to_dict()["kv_transfer"]["total_bytes"] == result.kv_transfer_bytes


@pytest.mark.parametrize(("model", "tp"), [("llama-3.1-8b", 1), ("gemma-3-1b", 1), ("qwen3-30b-a3b", 8)])
def test_a_disaggregated_prefill_sends_the_kv_its_ranks_hold(model, tp):
    # What every rank holds, summed: a sliding-window layer's window only (gemma-3), and a KV head
    # that several ranks keep (qwen3-30b-a3b: 4 KV heads over 8 ranks), once a rank.
    from servelab.spec.model import resolve_model

    spec, n = resolve_model(model), 4096
    wl = WorkloadSpec(2, concurrency=1, input_len=str(n), output_len="4", seed=0)
    result = simulate(SimConfig(model=model, hardware="h100-sxm", tp=tp, disagg=(1, 1)), wl)
    per_layer_token = 2 * -(-spec.num_kv_heads // tp) * spec.head_dim * 2 * tp  # bf16 K and V, over the ranks
    tokens = sum(n if (w := spec.layer_window(i)) is None else min(n, w) for i in range(spec.num_layers))
    assert result.kv_transfer_bytes == pytest.approx(2 * tokens * per_layer_token)
    if spec.sliding_window is not None:
        assert tokens < spec.num_layers * n
    if spec.num_kv_heads < tp:
        assert result.kv_transfer_bytes > 2 * spec.kv_bytes_per_token("bf16") * n


def test_a_disaggregated_prefill_sends_only_what_the_decode_side_has_not_cached():
    # 30 requests sharing a 768-token prefix of 1,024, one decode replica: once the first has
    # decoded there, its prefix cache holds the shared blocks and each later request's transfer
    # carries only the rest, as a decode worker that reserves the prompt first asks for.
    from servelab.sim.runner import transfer_bytes

    config = SimConfig(model="llama-3.1-8b", hardware="h100-sxm", disagg=(1, 1))
    per_request = transfer_bytes(config)
    wl = WorkloadSpec(30, rate=2.0, input_len="1024", output_len="4", shared_prefix_fraction=0.75, seed=0)
    shared = simulate(config, wl)
    assert shared.summary.completed == 30
    unshared = per_request(1024) * 30
    # The first request sends all 1,024 tokens; each later one the 256 past the shared 48 blocks.
    assert shared.kv_transfer_bytes == pytest.approx(per_request(1024) + 29 * per_request(256))
    # Without prefix caching every request sends its whole prompt.
    plain = simulate(dataclasses.replace(config, scheduler=SchedulerConfig(enable_prefix_caching=False)), wl)
    assert plain.kv_transfer_bytes == pytest.approx(unshared)


def test_prefix_sharing_shows_in_cached_tokens():
    wl = WorkloadSpec(30, rate=2.0, input_len="1024", output_len="4", shared_prefix_fraction=0.75, seed=0)
    result = simulate(SimConfig(cost_model=LinearCost(), scheduler=SchedulerConfig(num_blocks=4000)), wl)
    cached = [r.num_cached_tokens for r in result.records]
    assert max(cached) >= 736  # 768 shared tokens, in whole 16-token blocks
    assert result.replica_stats[0]["prefix_cache_hit_rate"] > 0.5


def run_cli(capsys, *argv):
    code = main(["sim", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_schema_requests_out_and_plots(tmp_path, capsys):
    reqs_out = tmp_path / "reqs.jsonl"
    code, out, _ = run_cli(
        capsys,
        "--rate",
        "5",
        "--num-requests",
        "40",
        "--input-len",
        "256",
        "--output-len",
        "32",
        "--slo-ttft",
        "500ms",
        "--slo-tpot",
        "50ms",
        "--json",
        "--requests-out",
        str(reqs_out),
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert code == 0
    doc = json.loads(out)
    s = doc["summary"]
    for key in (
        "num_requests",
        "completed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "output_throughput_per_device",
        "preemptions",
        "goodput",
        "slo_attainment",
    ):
        assert key in s
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(s[metric]) == {"mean", "p50", "p90", "p95", "p99", "max"}
    assert s["completed"] == 40 and s["slo_attainment"] == 1.0
    assert doc["config"]["model"] == "llama-3.1-8b" and doc["config"]["workload"]["rate"] == 5.0
    lines = reqs_out.read_text().splitlines()
    assert len(lines) == 40 and json.loads(lines[0])["output_tokens"] == 32
    for name in ("step_timeline.png", "latency_cdf.png", "kv_usage.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_table(capsys):
    code, out, _ = run_cli(capsys, "--disagg", "1:1", "--rate", "2", "--num-requests", "10")
    assert code == 0
    assert "TTFT" in out and "KV transfer" in out and "x2" in out


def test_cli_header_gives_a_traces_own_request_count(tmp_path, capsys):
    trace = tmp_path / "one_line.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0.5, "prompt_tokens": 100, "output_tokens": 20}) + "\n")
    for extra in ([], ["--num-requests", "20"]):
        code, out, _ = run_cli(capsys, "--trace", str(trace), "--no-progress", *extra)
        assert code == 0
        assert f"workload: 1 request, trace {trace}, at the trace's arrival times" in out, out
        assert "Requests (completed / failed)     1 / 0" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-9", "--rate", "1"], "unknown model"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--rate", "-3"], "--rate must be > 0"),
        (["--rate", "1", "--input-len", "9000", "--max-model-len", "8192"], "exceeds max_model_len 8192"),
        (["--model", "llama-3.1-70b", "--rate", "1"], "weights take"),
        (
            [
                "--model",
                "llama-3.1-70b",
                "--dtype",
                "fp8",
                "--kv-cache-dtype",
                "float32",
                "--input-len",
                "1800",
                "--output-len",
                "1500",
                "--rate",
                "1",
            ],
            "prompt 1800 + output 1500 tokens can never fit a replica's KV pool",
        ),
        (["--num-requests", "3"], "give a load"),
        (["--rate", "1", "--scheduler", "fastest"], "policy must be one of"),
        (["--rate", "1", "--slo-ttft", "soon"], "--slo-ttft"),
        (["--rate", "1", "--warmup", "soon"], "--warmup: expected a request count (e.g. 50) or a duration"),
        (["--rate", "1", "--warmup", "3"], "--warmup 3 leaves no request to summarize (the run has 3)"),
    ],
)
def test_cli_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, _, err = (
        run_cli(capsys, *argv, "--num-requests", "3") if "--num-requests" not in argv else run_cli(capsys, *argv)
    )
    assert code == 2
    assert message in err and "Traceback" not in err


# Steady state: a closed loop's start-up wave (all clients at once) left out, as bench and plan do.
STEADY_LOAD = ["--input-len", "2048", "--output-len", "64", "--seed", "0"]


def test_sim_steady_state_leaves_out_the_start_up_wave_and_matches_plan(capsys):
    from servelab.bench.planner import PlanJob, plan_one
    from servelab.metrics import SLO

    n = 64
    row = plan_one(PlanJob(model="llama-3.1-8b", hardware="h100-sxm", tp=1, slo=SLO(ttft_s=0.5, tpot_s=0.05),
                           percentile=90, workload={"num_requests": n, "input_len": "2048", "output_len": "64",
                                                    "seed": 0}))  # fmt: skip
    c = int(row.capacity_concurrency)
    assert c >= 8
    code, out, _ = run_cli(
        capsys,
        "--concurrency",
        str(c),
        "--num-requests",
        str(n + c),
        *STEADY_LOAD,
        "--slo-ttft",
        "500ms",
        "--slo-tpot",
        "50ms",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    whole, steady = doc["summary"], doc["steady_state"]["summary"]
    assert doc["steady_state"]["startup_requests_excluded"] == c and steady["num_requests"] == n
    # The wave's c prompts of 2,048 tokens queue behind one another: counted, they decide the p90.
    assert whole["ttft_s"]["p90"] > 1.5 * steady["ttft_s"]["p90"]
    assert steady["ttft_s"]["p90"] <= 0.5 < whole["ttft_s"]["p90"]
    assert steady == row.capacity["best"]["summary"]  # plan measured exactly this level


def test_sim_warmup_by_count_and_by_time(capsys):
    code, out, _ = run_cli(capsys, "--rate", "20", "--num-requests", "60", *STEADY_LOAD, "--json")
    assert code == 0 and "steady_state" not in json.loads(out)  # an open loop has no start-up wave
    code, out, _ = run_cli(
        capsys,
        "--rate",
        "20",
        "--num-requests",
        "60",
        *STEADY_LOAD,
        "--warmup",
        "10",
        "--json",
        "--requests-out",
        "/dev/null",
    )
    st = json.loads(out)["steady_state"]
    assert st["startup_requests_excluded"] == 10 and st["summary"]["num_requests"] == 50
    code, out, _ = run_cli(capsys, "--rate", "20", "--num-requests", "60", *STEADY_LOAD, "--warmup", "1s", "--json")
    doc = json.loads(out)
    st = doc["steady_state"]
    assert st["warmup_s"] == 1.0 and 0 < st["startup_requests_excluded"] < 60
    assert st["summary"]["num_requests"] + st["startup_requests_excluded"] == 60
    assert st["summary"]["duration_s"] < doc["summary"]["duration_s"]
    code, out, _ = run_cli(
        capsys, "--concurrency", "8", "--num-requests", "24", *STEADY_LOAD, "--warmup", "0", "--json"
    )
    assert "steady_state" not in json.loads(out)
    code, out, _ = run_cli(capsys, "--concurrency", "8", "--num-requests", "24", *STEADY_LOAD)
    assert "steady state (without the first 8 requests, the start-up wave sent at once):" in out


def test_replicas_are_capped_with_a_clear_message(capsys):
    code, _, err = run_cli(capsys, "--rate", "1", "--num-requests", "3", "--replicas", "1000000")
    assert code == 2 and "replicas: at most 10,000 in one simulation, got 1,000,000" in err
    code, _, err = run_cli(capsys, "--rate", "1e9", "--num-requests", "10000000")  # grew to 12 GB
    assert code == 2 and "--num-requests must be at most 1,000,000, got 10,000,000" in err


def test_a_tiny_rate_is_refused_rather_than_reported_as_zero_latency(capsys):
    code, _, err = run_cli(capsys, "--input-len", "64", "--output-len", "16", "--rate", "1e-15", "--num-requests", "20")
    assert code == 2 and "at least 2e-08 requests/s" in err and "Traceback" not in err


def test_check_is_called_during_a_run_and_ends_it_by_raising():
    from servelab.sim.cluster import CHECK_EVERY_EVENTS

    class Stop(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    # 2,000 requests trickling in: ~14,000 steps, an event each
    workload = WorkloadSpec(num_requests=2000, rate=20.0, input_len="64", output_len="64", seed=0)
    whole = simulate(SimConfig(model="llama-3.1-8b", hardware="h100-sxm"), workload, check=lambda: calls.append(0))
    ran = len(calls)
    assert ran > 3
    calls.clear()
    with pytest.raises(Stop):
        simulate(SimConfig(model="llama-3.1-8b", hardware="h100-sxm"), workload, check=check)
    assert len(calls) == 3 and sum(r.success for r in whole.records) == 2000
    assert ran <= len(whole.trace) * 3 // CHECK_EVERY_EVENTS + 1  # every CHECK_EVERY_EVENTS events, not more often


def test_api_inputs_that_would_lose_requests_are_refused():
    from servelab.errors import InvalidArgument

    open_loop = [RequestSpec(i, 0.1 * i, 16, 4) for i in range(4)]
    with pytest.raises(InvalidArgument, match="concurrency must be >= 1, got 0"):
        simulate(SimConfig(cost_model=LinearCost()), open_loop, concurrency=0)
    with pytest.raises(InvalidArgument, match=r"disagg is \(prefill replicas, decode replicas\)"):
        SimConfig(disagg=(1,))
