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
    assert cfg == {"block_size": "16", "cache_dtype": "float32", "num_blocks": "512", "enable_prefix_caching": "true",
                   "max_model_len": "2048", "max_num_batched_tokens": "256", "max_num_seqs": "8", "policy": "chunked"}
    check_server_config(cfg, "http://x")


@pytest.mark.parametrize("text", [None, "", 'vllm:cache_config_info{block_size="16"} 1.0\n'])
def test_a_server_without_its_configuration_is_refused_by_name(text):
    with pytest.raises(InvalidArgument, match="does not publish its scheduler configuration.*num_blocks"):
        check_server_config(server_config(text), "http://x")


def _record(i: int, arrival: float, ok: bool = True, out: int = 4) -> RequestRecord:
    times = [arrival + 0.1 + 0.02 * k for k in range(out)] if ok else []
    return RequestRecord(f"r{i}", arrival, None, times[0] if times else None, times, times[-1] if times else arrival,
                         prompt_tokens=10 + i, output_tokens=out if ok else 0, success=ok)


def test_replay_trace_keeps_send_times_and_lengths_of_successful_requests():
    recs = [_record(0, 0.5), _record(1, 0.2), _record(2, 0.9, ok=False), _record(3, 1.4, out=7)]
    trace = replay_trace(recs)
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in trace] == [
        (0.0, 11, 4), (pytest.approx(0.3), 10, 4), (pytest.approx(1.2), 13, 7)]
    assert [s.index for s in trace] == [0, 1, 2]
    # a closed loop replays without times, in the order it was sent
    closed = replay_trace(recs, closed_loop=True)
    assert [(s.arrival_s, s.prompt_tokens) for s in closed] == [(None, 11), (None, 10), (None, 13)]
    with pytest.raises(InvalidArgument, match="no successful request"):
        replay_trace([_record(0, 0.0, ok=False)])


def test_compare_gives_signed_errors_and_target_verdicts():
    measured = summarize([_record(i, 0.1 * i) for i in range(5)], 1.0)
    slower = [RequestRecord(r.request_id, r.arrival_s, None, r.first_token_s + 0.1,
                            [t + 0.1 for t in r.token_times_s], r.end_s + 0.1, r.prompt_tokens, r.output_tokens)
              for r in (_record(i, 0.1 * i) for i in range(5))]
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
    assert (sched.num_blocks, sched.block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
            sched.max_model_len, sched.policy, sched.enable_prefix_caching) == (512, 16, 8, 256, 2048, "chunked", True)
    trace = replay_trace([_record(0, 0.0, out=3)])
    r = simulate(config, trace).records[0]
    # a 10-token prompt in one step (0.01 + 10 * 0.001), then two decode steps of 0.011 s each
    assert r.ttft_s == pytest.approx(0.02) and r.e2e_s == pytest.approx(0.042)


SERVER = {"num_blocks": "512", "block_size": "16", "max_num_seqs": "8", "max_num_batched_tokens": "256",
          "max_model_len": "2048"}
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
    records = [RequestRecord(f"r{i}", 0.0, None, 0.0, [0.0], 0.0, 40 + 3 * i, 12 + i % 5)
               for i in range(3 * concurrency + 4)]
    config = sim_config(profile, SERVER, get_model("smollm2-135m"), None, cost)
    records = replay(config, records, concurrency, think_s).records  # as a bench run's records: one send time each
    return ServerRun(concurrency, records, replay(config, records, concurrency, think_s).summary.tpot_s.p50, think_s)


@pytest.mark.parametrize("per_step_s,per_seq_s", [(0.0, 0.0), (2.5e-3, 0.0), (1e-3, 4e-4), (0.0, 1e-3)])
def test_fit_server_term_recovers_a_known_per_step_and_per_sequence_term(per_step_s, per_seq_s):
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    profile = {"fit": {"coefficients": ENGINE}}
    runs = [_server_run(per_step_s, per_seq_s, c) for c in (1, 4, 8)]
    term = fit_server_term(profile, SERVER, get_model("smollm2-135m"), runs)
    assert term["per_step_s"] == pytest.approx(per_step_s, abs=1e-4)
    assert term["per_seq_s"] == pytest.approx(per_seq_s, abs=3e-5)
    assert [r["concurrency"] for r in term["runs"]] == [1, 4, 8]
    for r, run in zip(term["runs"], runs):
        # the engine-only replay is as fast as the run would be without the term; the fitted one matches it
        assert r["engine_only_tpot_p50_s"] <= r["measured_tpot_p50_s"] + 1e-12
        assert r["fitted_tpot_p50_s"] == pytest.approx(run.tpot_p50_s, rel=0.02)


def test_a_per_step_term_is_the_same_at_every_concurrency():
    # what calibrate's runs showed (docs/fidelity.md): priced per step, one term fits 1 and 8 alike,
    # while the per-sequence reading of the same runs falls with the concurrency
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    runs = [_server_run(2e-3, 0.0, c) for c in (1, 8)]
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), runs)
    one, eight = term["runs"]
    assert one["per_step_alone_s"] == pytest.approx(2e-3, rel=0.02)
    assert eight["per_step_alone_s"] == pytest.approx(2e-3, rel=0.02)
    assert eight["per_seq_alone_s"] < one["per_seq_alone_s"] / 4
    assert eight["seqs_per_step"] > 4 and one["seqs_per_step"] == pytest.approx(1.0, rel=0.05)


def test_fit_server_term_is_zero_when_the_engine_alone_is_slow_enough():
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    fast = {**ENGINE, "per_step_s": 4e-3}
    runs = [_server_run(0.0, 0.0, 2, engine=fast)]  # measured faster than ENGINE's steps price it
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), runs)
    assert term["per_step_s"] == term["per_seq_s"] == 0.0
    assert term["runs"][0]["engine_only_tpot_p50_s"] > runs[0].tpot_p50_s


def test_one_concurrency_gives_a_per_step_term_only():
    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    runs = [_server_run(1e-3, 2e-4, 4)]
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), runs)
    assert term["per_seq_s"] == 0.0 and term["per_step_s"] > 1e-3  # the run's whole term, read per step
    assert term["runs"][0]["fitted_tpot_p50_s"] == pytest.approx(runs[0].tpot_p50_s, rel=0.02)


def test_fit_server_term_replays_each_requests_own_think_time():
    # calibrate's clients pause a seeded exponential draw after each request; the fit replays each
    # draw, recovers the term, and records them. Replaying the same runs with no pause misprices them.
    from dataclasses import replace

    import numpy as np

    from servelab.bench.fidelity import fit_server_term
    from servelab.spec import get_model

    runs = []
    for c in (1, 4, 8):
        draws = np.random.default_rng(c).exponential(0.05, size=3 * c + 4).tolist()
        runs.append(_server_run(1e-3, 4e-4, c, think_s=draws))
    term = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), runs)
    assert term["per_step_s"] == pytest.approx(1e-3, abs=1e-4)
    assert term["per_seq_s"] == pytest.approx(4e-4, abs=6e-5)
    for r, run in zip(term["runs"], runs):
        assert r["think_s"] == run.think_s and r["think_time_s"] == pytest.approx(np.mean(run.think_s))
        assert r["fitted_tpot_p50_s"] == pytest.approx(run.tpot_p50_s, rel=0.02)
        # a small run's ratio of the two terms alone can exceed its concurrency; a step cannot
        assert 1.0 <= r["seqs_per_step"] <= run.concurrency
    no_pause = [replace(run, think_s=0.0) for run in runs]
    wrong = fit_server_term({"fit": {"coefficients": ENGINE}}, SERVER, get_model("smollm2-135m"), no_pause)
    assert abs(wrong["per_seq_s"] - 4e-4) > 5e-5 or abs(wrong["per_step_s"] - 1e-3) > 2e-4


def test_replay_trace_takes_one_think_time_per_replayed_request_in_send_order():
    from servelab.bench.fidelity import replay_trace

    records = [RequestRecord(f"r{i}", 2.0 - i, None, 0.0, [0.0], 0.0, 10, 3) for i in range(3)]
    trace = replay_trace(records, closed_loop=True, think_s=[0.1, 0.2, 0.3])
    assert [t.think_s for t in trace] == [0.1, 0.2, 0.3]  # the earliest send (r2) thinks first
    with pytest.raises(InvalidArgument, match="2 think times for 3 replayed requests"):
        replay_trace(records, closed_loop=True, think_s=[0.1, 0.2])
