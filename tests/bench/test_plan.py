"""`servelab plan`: memory fit, capacity rows, ranking, cost arithmetic, CLI."""

from __future__ import annotations

import dataclasses

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.bench.planner import DEFAULT_SLO_TTFT_S, PlanJob, cost_per_million_tokens, parse_prices, plan_one, rank
from servelab.cli import main as cli_main
from servelab.core.config import SchedulerConfig
from servelab.errors import InvalidArgument, NotFound
from servelab.metrics import SLO

WORKLOAD = {"num_requests": 24, "input_len": "256", "output_len": "16", "seed": 0}


def _job(**kw) -> PlanJob:
    base = dict(
        model="llama-3.1-8b",
        hardware="h100-sxm",
        tp=1,
        slo=SLO(tpot_s=0.030, ttft_s=1.0),
        percentile=90,
        workload=WORKLOAD,
        target_rate=10.0,
        price_per_device_hour=3.0,
    )
    base.update(kw)
    return PlanJob(**base)


def test_a_configuration_that_does_not_fit_is_ranked_last_with_the_reason():
    too_big = plan_one(_job(model="llama-3.1-70b", tp=1))  # 141 GB of BF16 weights on an 80 GB device
    assert not too_big.fits and too_big.tokens_per_s_per_device is None
    assert "weights take" in too_big.reason and "80.0 GB" in too_big.reason
    ok = plan_one(_job())
    assert ok.fits and ok.meets_slo
    assert [r.hardware for r in rank([too_big, ok])] == ["h100-sxm", "h100-sxm"]
    assert rank([too_big, ok])[0] is ok


def test_capacity_row_arithmetic():
    row = plan_one(_job())
    assert row.capacity_concurrency >= 1
    assert row.tpot_s <= 0.030 and row.ttft_s <= 1.0
    assert row.cost_per_million_output_tokens == pytest.approx(3.0 / (row.tokens_per_s_per_device * 3600) * 1e6)
    assert row.devices_needed == math.ceil(10.0 / row.requests_per_s) * 1
    assert row.capacity["best"]["summary"]["output_throughput_per_device"] == row.tokens_per_s_per_device
    assert row.frontier, "the levels give the per-user vs per-device frontier"


def test_tp_that_does_not_divide_the_heads_is_reported_not_raised():
    row = plan_one(_job(tp=3))
    assert not row.fits and "tp=3" in row.reason


def test_cost_per_million_tokens():
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)


def test_prices():
    prices = parse_prices("h200=4.5", ["h100-sxm", "h200"])
    assert prices["h200"] == 4.5 and prices["h100-sxm"] > 0  # the catalog's price fills in
    with pytest.raises(InvalidArgument, match="--price"):
        parse_prices("h200", ["h200"])
    with pytest.raises(InvalidArgument, match="not a number"):
        parse_prices("h200=cheap", ["h200"])
    with pytest.raises(InvalidArgument, match="--price: empty item"):
        parse_prices("h200=4.5,,h100-sxm=2", ["h200"])
    with pytest.raises((InvalidArgument, NotFound)):
        parse_prices("tpu-v9=1", ["h200"])


def test_plan_cli_json_runs_configurations_in_parallel(capsys):
    rc = cli_main(
        [
            "plan",
            "--model",
            "llama-3.1-70b",
            "--hardware",
            "h100-sxm,h200",
            "--tp",
            "1,4",
            "--slo-tpot",
            "60ms",
            "--slo-ttft",
            "2s",
            "--num-requests",
            "16",
            "--input-len",
            "256",
            "--output-len",
            "8",
            "--target-rate",
            "5",
            "--json",
            "--workers",
            "2",
        ]
    )
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = {(c["hardware"], c["tp"]): c for c in data["configs"]}
    assert set(rows) == {("h100-sxm", 1), ("h100-sxm", 4), ("h200", 1), ("h200", 4)}
    assert not rows[("h100-sxm", 1)]["fits"] and "weights" in rows[("h100-sxm", 1)]["reason"]
    assert rows[("h200", 4)]["fits"] and rows[("h200", 4)]["output_tokens_per_s_per_device"] > 0
    assert data["configs"][-1]["fits"] is False  # the non-fitting one is ranked last


def test_plan_cli_errors(capsys):
    assert cli_main(["plan", "--hardware", "h100-sxm", "--tp", "1"]) == 2
    assert "--slo-tpot" in capsys.readouterr().err
    assert cli_main(["plan", "--hardware", "nope", "--slo-tpot", "50ms"]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli_main(["plan", "--slo-tpot", "50ms", "--concurrency", "4"]) == 2
    assert "searches the load itself" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--target-rate", "inf"],
            "--target-rate must be a finite number > 0 requests/s, got inf",
        ),  # was OverflowError
        (["--slo-tpot", "1e400s"], "--slo-tpot: must be a finite duration, got '1e400s'"),
        (["--max-concurrency", "1000000", "--max-num-seqs", "1000000"], "--max-concurrency must be at most 100,000"),
    ],
)
def test_plan_refuses_what_cannot_be_planned_with_one_line(argv, message, capsys):
    assert cli_main(["plan", "--slo-tpot", "50ms", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_plan_refuses_a_max_concurrency_below_one(value, capsys):
    # 0 was taken as "no ceiling given" and the default searched instead
    assert cli_main(["plan", "--slo-tpot", "50ms", "--max-concurrency", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--max-concurrency must be >= 1, got {value}" in err


def test_the_start_up_wave_does_not_decide_the_capacity():
    # Closed loop: all 34 clients send at t = 0 and their 1,024-token prompts queue behind one
    # another (up to ~1.5 s of TTFT), a burst no sustained load sees. Counted, that wave alone
    # decides a p90 TTFT when it is a quarter of the samples.
    from servelab.sim import SimConfig, simulate
    from servelab.spec import get_hardware, get_model
    from servelab.workload import WorkloadSpec

    config = SimConfig(model=get_model("llama-3.1-70b"), hardware=get_hardware("h100-sxm"), tp=8)
    c = 34
    result = simulate(config, WorkloadSpec(num_requests=5 * c, concurrency=c, input_len="1024", output_len="256"))
    steady = result.steady
    assert result.summary.ttft_s.p90 > 0.8  # the burst, counted (a fifth of the samples here)
    assert steady.ttft_s.p90 < 0.3 and steady.num_requests == 4 * c
    assert steady.tpot_s.p90 == pytest.approx(result.summary.tpot_s.p90, rel=0.05)  # decode is steady either way
    assert steady.duration_s < result.summary.duration_s

    row = plan_one(_job(model="llama-3.1-70b", tp=8, slo=SLO(tpot_s=0.050, ttft_s=1.0),
                        workload={"input_len": "1024", "output_len": "256", "seed": 0}))  # fmt: skip
    assert row.meets_slo and row.capacity_concurrency > 2 * c  # was 34: the burst's TTFT, not the SLO's


# Which limit set the capacity: one case each, each judged on the level that decided the search.
SHORT = {"num_requests": 24, "input_len": "256", "output_len": "16", "seed": 0}


def test_a_capacity_capped_by_max_num_seqs_says_so():
    # Clients past the cap would only queue for a slot: the search stops at the cap, measured there.
    row = plan_one(_job(scheduler=SchedulerConfig(max_num_seqs=4), workload=SHORT))
    b = row.binding
    assert row.meets_slo and b.limit == "max-num-seqs" and row.max_running == 4
    assert row.capacity_concurrency == 4 and b.at_concurrency == 4 and b.peak_running == 4
    assert max(lv["load"] for lv in row.capacity["levels"]) == 4
    assert "--max-num-seqs 4" in b.detail and row.to_dict()["binding_limit"]["limit"] == "max-num-seqs"


def test_a_capacity_capped_by_the_kv_cache_says_so():
    # An L4 keeps ~42k tokens of Llama-3.1-8B KV after the weights: ten 4,160-token requests.
    row = plan_one(
        _job(
            hardware="l4",
            slo=SLO(tpot_s=0.5, ttft_s=20.0),
            workload={"num_requests": 24, "input_len": "4096", "output_len": "64", "seed": 0},
        )
    )
    b = row.binding
    assert row.meets_slo and b.limit == "kv-cache"
    # Measured at the limit itself: the most 4,160-token requests the pool holds, all running.
    wall = b.kv_capacity_tokens // (16 * math.ceil((4096 + 63) / 16))
    assert row.max_running == wall == row.capacity_concurrency == b.at_concurrency == b.peak_running
    assert b.preemptions == 0 and (1 - b.peak_kv_usage) * b.kv_capacity_tokens < 4160
    assert f"{b.kv_capacity_tokens:,} tokens" in b.detail


def test_plan_starts_its_search_at_the_cost_models_estimate():
    def loads(**kw):
        row = plan_one(_job(workload={"input_len": "4096", "output_len": "64", "seed": 0}, **kw))
        return [lv["load"] for lv in row.capacity["levels"]], row

    # Loose targets: the estimate is the KV ceiling, which passes: one level in all.
    levels, row = loads(hardware="l4", slo=SLO(tpot_s=0.5, ttft_s=20.0))
    assert levels == [row.max_running] == [row.capacity_concurrency]
    # A TPOT target one sequence meets and a full batch's decode step misses (an H100 holds ~100 of
    # these requests): it starts at the boundary, 4, and one step up fails.
    levels, row = loads(hardware="h100-sxm", slo=SLO(tpot_s=0.012, ttft_s=20.0))
    assert levels == [4, 5] and row.capacity_concurrency == 4 < row.max_running
    # --plot's frontier wants every doubling.
    row = plan_one(dataclasses.replace(
        _job(hardware="l4", slo=SLO(tpot_s=0.5, ttft_s=20.0), workload={"input_len": "4096", "output_len": "64"}),
        sweep_to_ceiling=True,
    ))  # fmt: skip
    assert [lv["load"] for lv in row.capacity["levels"]][:2] == [1, 2]


@pytest.mark.parametrize(
    ("policy", "prompt", "output", "hardware"),
    [
        ("chunked", 21, 136, "h100-sxm"),
        ("chunked", 1024, 128, "h100-sxm"),
        ("chunked", 8192, 16, "h100-sxm"),
        ("chunked", 128, 1, "h100-sxm"),
        ("decode-first-whole", 1024, 128, "h100-sxm"),  # one whole prompt a step
        ("decode-first-whole", 512, 64, "h100-sxm"),  # three
        ("decode-first-whole", 1900, 400, "b200"),  # fewer than one: when the decodes leave room
    ],
)
def test_the_token_budget_wall_is_what_runs_at_once_under_a_queue(policy, prompt, output, hardware):
    # Twice as many clients as the wall: the steps run about the wall's sequences and the rest
    # wait for admission, whatever the split of prompt and output tokens.
    from servelab.sim import SimConfig, simulate
    from servelab.workload import WorkloadSpec

    sched = SchedulerConfig(max_num_seqs=4096, policy=policy)
    wall = sched.budget_running(prompt, output)
    config = SimConfig(model="llama-3.1-8b", hardware=hardware, scheduler=sched)
    clients = 2 * wall
    result = simulate(config, WorkloadSpec(num_requests=6 * clients, concurrency=clients,
                                           input_len=str(prompt), output_len=str(output)))  # fmt: skip
    steady = sorted(result.trace.num_seqs[len(result.trace.num_seqs) // 2 :])
    median = steady[len(steady) // 2]
    assert 0.9 * wall <= median <= wall, (wall, median)


@pytest.mark.parametrize(("coverage", "acceptance", "output"), [(0.2, 0.3, 136), (1.0, 0.0, 6)])
def test_the_token_budget_wall_holds_under_speculative_decoding(coverage, acceptance, output):
    # Drafts in a fifth of the steps, or none accepted on short outputs: a step's tokens still carry
    # no more sequences than the plain wall, whatever the K + 1 positions a verification scores.
    from servelab.cost.speculative import Acceptance
    from servelab.sim import SimConfig, simulate
    from servelab.workload import WorkloadSpec

    sched = SchedulerConfig(max_num_seqs=4096)
    wall = sched.budget_running(21, output)
    config = SimConfig(model="llama-3.1-8b", hardware="h100-sxm", scheduler=sched,
                       speculative='{"method": "ngram", "num_speculative_tokens": 4}',
                       spec_acceptance=dataclasses.replace(Acceptance.rate(acceptance, 4), coverage=coverage))  # fmt: skip
    clients = 2 * wall
    result = simulate(config, WorkloadSpec(num_requests=3 * clients, concurrency=clients, input_len="21",
                                           output_len=str(output)))  # fmt: skip
    steady = sorted(result.trace.num_seqs[len(result.trace.num_seqs) // 2 :])
    assert steady[len(steady) // 2] <= wall


def test_out_of_reach_rows_skip_the_search_but_not_the_frontier():
    # One sequence's decode step on an L4 is over a 10 ms TPOT: no level can pass, and `plan`
    # says so without simulating; `--plot` still draws the levels (they may meet the TTFT target).
    job = _job(hardware="l4", slo=SLO(ttft_s=2.0, tpot_s=0.010), workload={"input_len": "512", "output_len": "64"})
    row = plan_one(job)
    assert row.fits and not row.meets_slo and row.capacity is None and "decode step of one sequence alone" in row.reason
    swept = plan_one(dataclasses.replace(job, sweep_to_ceiling=True))
    assert not swept.meets_slo and len(swept.frontier) >= 4
    # Lengths that vary: the sample's shortest request need not be a level's, so the search runs.
    varied = plan_one(_job(hardware="l4", slo=SLO(ttft_s=2.0, tpot_s=0.010),
                           workload={"input_len": "256-768", "output_len": "64"}))  # fmt: skip
    assert not varied.meets_slo and varied.capacity is not None


def test_a_capacity_at_the_token_budget_counts_no_queued_client():
    # 8k-token prompts, 16-token outputs: 2,048 tokens a step carry about four decodes beside the
    # prompt in prefill. Clients beyond five only queue (TTFT grows, throughput does not), and a
    # 1 s TTFT target would count three of them as users.
    row = plan_one(
        _job(slo=SLO(tpot_s=0.2, ttft_s=1.0), workload={"num_requests": 48, "input_len": "8192", "output_len": "16"})
    )
    b = row.binding
    assert row.max_running == 5 == row.capacity_concurrency and b.limit == "max-num-batched-tokens", b
    assert "--max-num-batched-tokens 2048" in b.detail and row.ttft_s < 0.5


def test_the_search_from_the_estimate_answers_as_the_one_from_one(monkeypatch):
    # 512 + 512 tokens at a 12 ms TPOT: the cost model puts the boundary near 80 clients, so the
    # search starts there and skips the levels below, the costliest per request.
    import servelab.bench.planner as planner

    job = _job(slo=SLO(tpot_s=0.012, ttft_s=2.0), workload={"input_len": "512", "output_len": "512", "seed": 0})
    row = plan_one(job)
    levels = [lv["load"] for lv in row.capacity["levels"]]
    monkeypatch.setattr(planner, "_steady_estimate", lambda *args: None)
    from_one = plan_one(job)
    assert levels[0] > 64 and len(levels) < len(from_one.capacity["levels"]) - 4
    assert [lv["load"] for lv in from_one.capacity["levels"]][:3] == [1, 2, 4]
    assert row.capacity_concurrency == from_one.capacity_concurrency == 80
    assert row.tokens_per_s_per_device == from_one.tokens_per_s_per_device


def test_the_kv_ceiling_counts_a_sliding_window_models_pages_in_every_group():
    # Gemma 2 alternates full and 4,096-token window layers: a request holds pages in both groups,
    # so the pool runs half the requests a one-group count would put at its ceiling.
    row = plan_one(
        _job(
            model="gemma-2-9b",
            slo=SLO(tpot_s=0.05),
            workload={**WORKLOAD, "num_requests": None, "input_len": "1024", "output_len": "256"},
        )  # fmt: skip
    )
    b = row.binding
    assert b.limit == "kv-cache" and row.capacity_concurrency == row.max_running == b.peak_running
    assert b.preemptions == 0


def test_rows_without_a_price_rank_after_priced_ones():
    from servelab.bench.planner import PlanRow

    def row(name: str, tps: float, price: float | None) -> PlanRow:
        r = PlanRow(hardware=name, tp=1, fits=True, price_per_device_hour=price)
        r.tokens_per_s_per_device, r.capacity_concurrency = tps, 1
        r.cost_per_million_output_tokens = None if price is None else cost_per_million_tokens(price, tps)
        return r

    rows = [row("my-box", 50.0, None), row("h100-sxm", 5000.0, 3.0)]
    assert all(r.meets_slo for r in rows)
    assert [r.hardware for r in rank(rows)] == ["h100-sxm", "my-box"]


def test_a_capacity_set_by_the_tpot_target_says_so():
    row = plan_one(_job(slo=SLO(tpot_s=0.012), workload=SHORT))
    b = row.binding
    assert row.meets_slo and b.limit == "tpot", b
    assert b.peak_running < b.max_num_seqs and b.preemptions == 0
    assert "the TPOT target" in b.detail and "p90 TPOT" in b.detail
    assert b.at_concurrency == row.capacity_concurrency + 1


def test_a_capacity_set_by_the_ttft_target_says_so():
    # 8k-token prompts: three prefills at once already take a quarter of a second.
    row = plan_one(
        _job(slo=SLO(tpot_s=0.2, ttft_s=0.25), workload={"num_requests": 48, "input_len": "8192", "output_len": "16"})
    )
    b = row.binding
    assert row.meets_slo and b.limit == "ttft", b
    assert row.ttft_s <= 1.0 and "the TTFT target" in b.detail and "p90 TTFT" in b.detail
    assert b.at_concurrency == row.capacity_concurrency + 1 < row.max_running


def test_a_search_that_never_failed_is_bound_by_its_maximum():
    row = plan_one(_job(workload=SHORT))  # 24 requests: the search stops at concurrency 24
    assert row.binding.limit == "search-maximum" and row.binding.at_concurrency == 24
    row = plan_one(_job(workload=SHORT, max_concurrency=6))
    assert row.binding.limit == "search-maximum" and row.capacity_concurrency == 6


def test_no_binding_when_no_load_meets_the_slo():
    row = plan_one(_job(slo=SLO(tpot_s=0.001), workload=SHORT))
    assert row.fits and not row.meets_slo and row.binding is None


def test_plan_cli_names_the_binding_limit(capsys):
    args = [
        "plan",
        "--hardware",
        "h100-sxm",
        "--slo-tpot",
        "30ms",
        "--slo-ttft",
        "1s",
        "--max-num-seqs",
        "4",
        "--num-requests",
        "24",
        "--input-len",
        "256",
        "--output-len",
        "16",
        "--workers",
        "1",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "bound by" in out and "max-num-seqs" in out
    assert "bound by --max-num-seqs 4: concurrency 4 meets the targets with 4 sequences running" in out
    assert cli_main([*args, "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["configs"][0]
    assert config["binding_limit"]["limit"] == "max-num-seqs" and config["binding_limit"]["peak_running"] == 4


def test_queued_clients_are_not_users_and_the_default_ttft_target_is_stated(capsys):
    # Without a TTFT target, 1,024 clients sharing 256 slots passed at a p90 TTFT of 28.6 s.
    assert cli_main(["plan", "--slo-tpot", "50ms", "--workers", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["configs"][0]
    assert data["slo"]["ttft_s"] == DEFAULT_SLO_TTFT_S and data["slo_ttft_default"] is True
    assert row["capacity_concurrency"] <= row["max_running"] <= 256
    assert row["ttft_s"] <= DEFAULT_SLO_TTFT_S and row["tpot_s"] <= 0.050
    assert row["binding_limit"]["peak_running"] == row["capacity_concurrency"]
    assert cli_main(["plan", "--slo-tpot", "50ms", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "p90 TTFT <= 2000 ms (the default; --slo-ttft to change), p90 TPOT <= 50 ms" in out
    assert f"{row['capacity_concurrency']:g}" in out and "max-num-seqs" in out


def test_slo_ttft_none_drops_the_ttft_target(capsys):
    argv = ["plan", "--slo-tpot", "30ms", "--slo-ttft", "none", "--num-requests", "24", "--input-len", "256",
            "--output-len", "16", "--workers", "1"]  # fmt: skip
    assert cli_main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slo"]["ttft_s"] is None and data["slo_ttft_default"] is False
    assert data["configs"][0]["ttft_s"] is not None  # still stated
    assert cli_main(argv) == 0
    assert "p90 TPOT <= 30 ms (no TTFT target)" in capsys.readouterr().out
    assert cli_main(["plan", "--slo-ttft", "none"]) == 2
    assert "--slo-ttft none leaves no target: give --slo-tpot" in capsys.readouterr().err
    assert cli_main(["plan", "--slo-tpot", "30ms", "--slo-ttft", "soon"]) == 2
    assert "--slo-ttft" in capsys.readouterr().err


def test_one_token_outputs_print_no_tpot(capsys):
    argv = ["plan", "--hardware", "h100-sxm", "--input-len", "64", "--output-len", "1", "--max-concurrency", "4",
            "--slo-ttft", "2s"]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "Traceback" not in out


def test_a_request_too_long_with_think_time_is_a_row_not_an_error(capsys):
    argv = ["plan", "--hardware", "h200", "--input-len", "140000", "--output-len", "16", "--slo-ttft", "2s",
            "--think-time", "exp:1s"]  # fmt: skip
    assert cli_main(argv) == 0
    assert "h200" in capsys.readouterr().out


def test_a_search_past_its_time_limit_answers_nothing_and_says_so():
    # the lab gives its jobs a limit (a server's shared workers); the CLI gives none
    row = plan_one(_job(workload={**WORKLOAD, "num_requests": None, "output_len": "4096"}, time_limit_s=0.05))
    assert row.timed_out and row.fits and not row.meets_slo and row.capacity_concurrency is None
    assert "time limit of 0.05 s" in row.reason and row.to_dict()["timed_out"]
    assert not plan_one(_job()).timed_out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(["llama-3.1-8b", "gemma-2-9b", "mixtral-8x7b"]),
    hardware=st.sampled_from(["h100-sxm", "b200", "l4", "mi300x"]),
    prompt=st.integers(16, 8000),  # within every model's context (gemma-2-9b: 8,192)
    output=st.integers(2, 40),
    clients=st.integers(1, 6),
    shared=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 3),
)
def test_the_alone_bounds_are_below_every_simulated_request(model, hardware, prompt, output, clients, shared, seed):
    # The bounds that let `plan` skip a configuration no load can serve: every request's TTFT and
    # TPOT, at any load, chunked or not, with or without prefix hits, on measured or datasheet kernels.
    from servelab.bench.planner import alone_bounds
    from servelab.sim import SimConfig, simulate
    from servelab.sim.runner import build_cost_model
    from servelab.workload import WorkloadSpec

    config = SimConfig(model=model, hardware=hardware, tp=8 if model == "mixtral-8x7b" else 1)
    workload = WorkloadSpec(num_requests=3 * clients + 2, concurrency=clients, input_len=f"{prompt // 2}-{prompt}",
                            output_len=f"2-{output}", shared_prefix_fraction=shared, seed=seed)  # fmt: skip
    ttft_s, tpot_s = alone_bounds(build_cost_model(config), workload.generate(), config.scheduler.block_size)
    records = simulate(config, workload).records
    assert min(r.ttft_s for r in records) >= ttft_s * (1 - 1e-9)
    assert min(r.tpot_s for r in records if r.tpot_s is not None) >= tpot_s * (1 - 1e-9)
