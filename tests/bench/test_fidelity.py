"""Replaying a measured run through the simulator: the server's configuration, the trace, the errors."""

from __future__ import annotations

import pytest

from servelab.bench.fidelity import Row, check_server_config, compare, replay_trace, server_config
from servelab.errors import InvalidArgument
from servelab.metrics import RequestRecord, summarize

METRICS_TEXT = """\
# HELP servelab:cache_config_info KV cache configuration, as labels (the value is 1).
# TYPE servelab:cache_config_info gauge
servelab:cache_config_info{block_size="16",cache_dtype="float32",model_name="m",num_blocks="512"} 1.0
servelab:scheduler_config_info{enable_prefix_caching="true",max_model_len="2048",max_num_batched_tokens="256",\
max_num_seqs="8",model_name="m",policy="chunked"} 1.0
servelab:num_requests_running{model_name="m"} 0.0
"""


def test_server_config_reads_both_info_gauges():
    cfg = server_config(METRICS_TEXT)
    assert cfg == {
        "block_size": "16",
        "cache_dtype": "float32",
        "num_blocks": "512",
        "enable_prefix_caching": "true",
        "max_model_len": "2048",
        "max_num_batched_tokens": "256",
        "max_num_seqs": "8",
        "policy": "chunked",
    }
    check_server_config(cfg, "http://x")


SGLANG_TEXT = """\
# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 161721.0
sglang:max_prefill_tokens{model_name="m"} 16384.0
sglang:max_running_requests{model_name="m"} 4096.0
sglang:context_len{model_name="m"} 8192.0
sglang:num_running_reqs{model_name="m"} 3.0
sglang:token_usage{model_name="m"} 0.28
"""


def test_server_config_reads_sglangs_limit_gauges():
    cfg = server_config(SGLANG_TEXT)
    assert cfg == {
        "max_num_seqs": "4096",
        "max_num_batched_tokens": "16384",
        "max_model_len": "8192",
        "block_size": "16",
        "num_blocks": str(161721 // 16),
    }
    check_server_config(cfg, "http://x")
    # A server that exports only some of them is refused for the rest, by name.
    with pytest.raises(InvalidArgument, match="missing num_blocks"):
        check_server_config(server_config("sglang:max_running_requests 8\n"), "http://x")


@pytest.mark.parametrize("text", [None, "", 'vllm:cache_config_info{block_size="16"} 1.0\n'])
def test_a_server_without_its_configuration_is_refused_by_name(text):
    with pytest.raises(InvalidArgument, match="does not publish its scheduler configuration.*num_blocks"):
        check_server_config(server_config(text), "http://x")


def _record(i: int, arrival: float, ok: bool = True, out: int = 4) -> RequestRecord:
    times = [arrival + 0.1 + 0.02 * k for k in range(out)] if ok else []
    return RequestRecord(
        f"r{i}",
        arrival,
        None,
        times[0] if times else None,
        times,
        times[-1] if times else arrival,
        prompt_tokens=10 + i,
        output_tokens=out if ok else 0,
        success=ok,
    )


def test_replay_trace_keeps_send_times_and_lengths_of_successful_requests():
    recs = [_record(0, 0.5), _record(1, 0.2), _record(2, 0.9, ok=False), _record(3, 1.4, out=7)]
    trace = replay_trace(recs)
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in trace] == [
        (0.0, 11, 4),
        (pytest.approx(0.3), 10, 4),
        (pytest.approx(1.2), 13, 7),
    ]
    assert [s.index for s in trace] == [0, 1, 2]
    # a closed loop replays without times, in the order it was sent
    closed = replay_trace(recs, closed_loop=True)
    assert [(s.arrival_s, s.prompt_tokens) for s in closed] == [(None, 11), (None, 10), (None, 13)]
    with pytest.raises(InvalidArgument, match="no successful request"):
        replay_trace([_record(0, 0.0, ok=False)])


def test_compare_gives_signed_errors_and_target_verdicts():
    measured = summarize([_record(i, 0.1 * i) for i in range(5)], 1.0)
    slower = [
        RequestRecord(
            r.request_id,
            r.arrival_s,
            None,
            r.first_token_s + 0.1,
            [t + 0.1 for t in r.token_times_s],
            r.end_s + 0.1,
            r.prompt_tokens,
            r.output_tokens,
        )
        for r in (_record(i, 0.1 * i) for i in range(5))
    ]
    simulated = summarize(slower, 1.0)
    rows = {r.metric: r for r in compare(measured, simulated)}
    # TTFT 100 ms measured, 200 ms simulated: +100%, outside the 20% target
    assert rows["TTFT p50"].error_pct == pytest.approx(100.0)
    assert rows["TTFT p50"].within_target is False
    # the gaps between tokens are the same: TPOT exact, within its 10% target
    assert rows["TPOT p50"].error_pct == pytest.approx(0.0, abs=1e-9)
    assert rows["TPOT p50"].within_target is True
    assert "goodput req/s" not in rows  # no SLO: neither side has a goodput
    assert Row("x", 0.0, 1.0).error_pct is None and Row("x", None, 1.0).error_pct is None


def test_the_replay_runs_the_servers_scheduler_priced_by_the_profile():
    from servelab.bench.fidelity import sim_config
    from servelab.sim import simulate
    from servelab.spec import get_model

    coefs = {"per_step_s": 0.01, "per_token_s": 0.001, "per_seq_s": 0.0, "per_context_token_s": 0.0, "per_pair_s": 0.0}
    config = sim_config({"fit": {"coefficients": coefs}}, server_config(METRICS_TEXT), get_model("smollm2-135m"), None)
    sched = config.scheduler
    assert (
        sched.num_blocks,
        sched.block_size,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        sched.max_model_len,
        sched.policy,
        sched.enable_prefix_caching,
    ) == (512, 16, 8, 256, 2048, "chunked", True)
    trace = replay_trace([_record(0, 0.0, out=3)])
    r = simulate(config, trace).records[0]
    # a 10-token prompt in one step (0.01 + 10 * 0.001), then two decode steps of 0.011 s each
    assert r.ttft_s == pytest.approx(0.02) and r.e2e_s == pytest.approx(0.042)


SERVER = {
    "num_blocks": "512",
    "block_size": "16",
    "max_num_seqs": "8",
    "max_num_batched_tokens": "256",
    "max_model_len": "2048",
}
ENGINE = {"per_step_s": 8e-3, "per_token_s": 1e-3, "per_seq_s": 5e-4, "per_context_token_s": 2e-6, "per_pair_s": 1e-9}


def _server_run(per_step_s: float, per_seq_s: float, concurrency: int, engine=ENGINE, think_s=0.0):
    """A "measured" closed-loop run: the simulator with a known serving term stands in for the server
    (its clients pausing `think_s` after each request: one for all, or each request's own)."""
    from dataclasses import replace

    from servelab.bench.fidelity import ServerRun, replay, sim_config
    from servelab.cost.profile import ProfileStepCost
    from servelab.spec import get_model

    profile = {"fit": {"coefficients": engine}}
    cost = replace(ProfileStepCost.from_profile(profile), server_per_step_s=per_step_s, server_per_seq_s=per_seq_s)
    records = [
        RequestRecord(f"r{i}", 0.0, None, 0.0, [0.0], 0.0, 40 + 3 * i, 12 + i % 5) for i in range(3 * concurrency + 4)
    ]
    config = sim_config(profile, SERVER, get_model("smollm2-135m"), None, cost)
    records = replay(config, records, concurrency, think_s).records  # as a bench run's records: one send time each
    return ServerRun(concurrency, records, replay(config, records, concurrency, think_s).summary.tpot_s.p50, think_s)


def _served_steps(per_step_s: float, per_seq_s: float, seqs=(1, 2, 4, 8, 16), engine=ENGINE, seed=0):
    """Steps "a server ran": decodes, prefills and mixed steps at each sequence count, each taking
    the profile's price plus a known serving term, with one step in ten stalled by the host."""
    import random

    from servelab.bench.fidelity import ServedStep
    from servelab.cost.profile import ProfileStepCost
    from servelab.cost.roofline import Roofline

    cost = ProfileStepCost.from_profile({"fit": {"coefficients": engine}})
    rng, steps = random.Random(seed), []
    for n in seqs:
        for i in range(40):
            shape = [(1, rng.randint(20, 300)) for _ in range(n)]
            if i % 8 == 0:  # a prompt joins (or, alone, a prefill)
                shape[0] = (rng.randint(16, 128),) * 2
            totals = Roofline.totals(shape)
            served = cost.time_from_totals(*totals) + per_step_s + per_seq_s * n
            if i % 10 == 3:
                served *= 3  # a stall: the medians must not follow it
            steps.append(ServedStep(*totals, served_s=served, execute_s=served - 2e-4))
    return steps


@pytest.mark.parametrize("per_step_s,per_seq_s", [(0.0, 0.0), (2.5e-3, 0.0), (1e-3, 4e-4), (0.0, 1e-3)])
def test_fit_server_term_recovers_a_known_term_from_the_served_steps(per_step_s, per_seq_s):
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    steps = _served_steps(per_step_s, per_seq_s)
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), steps)
    assert term["per_step_s"] == pytest.approx(per_step_s, abs=1e-6)
    assert term["per_seq_s"] == pytest.approx(per_seq_s, abs=1e-7)
    assert term["steps"] == len(steps) and [g["seqs"] for g in term["by_seqs"]] == [1, 2, 4, 8, 16]
    assert all(g["steps"] == 40 and g["median_outside_executor_s"] == pytest.approx(2e-4) for g in term["by_seqs"])


def test_a_sequence_count_only_a_few_transitional_steps_had_moves_the_fit_little():
    # run 20: one 14-sequence step (a prompt joining) served 207 ms past its price; weighed by its
    # one step against groups of 40 it must not set the per-sequence term
    from dataclasses import replace

    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    steps = _served_steps(1e-3, 2e-4, seqs=(1, 4, 8, 16))
    rare = _served_steps(1e-3, 2e-4, seqs=(14,))[:1]
    steps += [replace(rare[0], served_s=rare[0].served_s + 0.207)]
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), steps)
    assert term["per_step_s"] == pytest.approx(1e-3, abs=3e-4)
    assert term["per_seq_s"] == pytest.approx(2e-4, abs=5e-5)


def test_steps_as_fast_as_priced_give_no_term_and_one_sequence_count_a_per_step_term_only():
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    model, profile = get_model("smollm2-135m"), {"fit": {"coefficients": ENGINE}}
    fast = _served_steps(0.0, 0.0, engine={**ENGINE, "per_step_s": 4e-3})  # faster than ENGINE prices them
    assert fit_server_term(profile, SERVER, model, fast)["per_step_s"] == 0.0
    one = fit_server_term(profile, SERVER, model, _served_steps(1e-3, 2e-4, seqs=(4,)))
    assert one["per_seq_s"] == 0.0 and one["per_step_s"] == pytest.approx(1e-3 + 4 * 2e-4, abs=1e-6)
    with pytest.raises(InvalidArgument, match="at least one served step"):
        fit_server_term(profile, SERVER, model, [])


def test_a_served_step_lasts_until_the_next_starts_less_the_idle_wait():
    from servelab.bench.fidelity import ServedStep

    shape = {"num_tokens": 1, "num_seqs": 1, "context_tokens": 9, "pairs": 9, "execute_s": 0.008}
    log = [
        {**shape, "start_s": 10.0, "end_s": 10.011, "waited_s": 0.0},
        {**shape, "start_s": 10.012, "end_s": 10.021, "waited_s": 0.0},  # straight after: 12 ms
        {**shape, "start_s": 11.0, "end_s": 11.010, "waited_s": 0.950},
    ]  # after an idle wait: 38 ms
    steps = ServedStep.from_log(log)
    assert [st.served_s for st in steps] == pytest.approx([0.012, 0.038, 0.010])  # the last: to its own end
    assert ServedStep.from_row(steps[1].to_row()) == ServedStep(1, 1, 9, 9, 0.038, 0.008)  # kept to 1 µs


def test_the_runs_check_the_term_replayed_with_each_requests_own_think_time():
    # calibrate's clients pause a seeded exponential draw after each request; the check replays
    # each draw and records them
    import numpy as np

    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    runs = []
    for c in (1, 4, 8):
        draws = np.random.default_rng(c).exponential(0.05, size=3 * c + 4).tolist()
        runs.append(_server_run(1e-3, 4e-4, c, think_s=draws))
    term = fit_server_term(
        {"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), _served_steps(1e-3, 4e-4), runs
    )
    for r, run in zip(term["runs"], runs):
        assert r["think_s"] == run.think_s and r["think_time_s"] == pytest.approx(np.mean(run.think_s))
        assert r["fitted_tpot_p50_s"] == pytest.approx(run.tpot_p50_s, rel=1e-3)
        assert r["engine_only_tpot_p50_s"] < run.tpot_p50_s


def test_replay_trace_takes_one_think_time_per_replayed_request_in_send_order():
    from servelab.bench.fidelity import replay_trace

    records = [RequestRecord(f"r{i}", 2.0 - i, None, 0.0, [0.0], 0.0, 10, 3) for i in range(3)]
    trace = replay_trace(records, closed_loop=True, think_s=[0.1, 0.2, 0.3])
    assert [t.think_s for t in trace] == [0.1, 0.2, 0.3]  # the earliest send (r2) thinks first
    with pytest.raises(InvalidArgument, match="2 think times for 3 replayed requests"):
        replay_trace(records, closed_loop=True, think_s=[0.1, 0.2])
