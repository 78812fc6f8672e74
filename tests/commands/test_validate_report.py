"""validate's JSON records how the profile priced the replay: its serving term, the statistic its
step times were taken by, the kernel switches it priced, and the closed loop it replayed."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from servelab.commands import validate
from servelab.metrics import RequestRecord, summarize
from servelab.workload import WorkloadSpec

SERVER = {
    "num_blocks": "400",
    "block_size": "16",
    "max_num_seqs": "8",
    "max_num_batched_tokens": "2048",
    "max_model_len": "2048",
}


def test_the_report_records_the_profiles_statistic_and_kernel_rows(tmp_path):
    records = [
        RequestRecord(f"r{i}", float(i), float(i), i + 0.1, [i + 0.1, i + 0.2, i + 0.3], i + 0.3, 32, 3)
        for i in range(3)
    ]
    measured = SimpleNamespace(records=records, summary=summarize(records, 3.3))
    coefs = {
        "per_step_s": 2e-3,
        "per_token_s": 5e-5,
        "per_seq_s": 1e-4,
        "per_context_token_s": 0.0,
        "per_pair_s": 0.0,
        "per_wide_step_s": 1e-3,
    }
    profile = {
        "format": "servelab-profile",
        "version": 1,
        "model": "smollm2-135m",
        "fit": {"coefficients": coefs},
        "step_time_statistic": "median of the interleaved passes",
        "kernel_rows": {"fused_max_rows": 4, "max_rows": None, "linears": "GGUF blocks kept packed (Q4_1)"},
    }
    saved = tmp_path / "v.json"
    args = argparse.Namespace(sim_model=None, base_url="http://x", profile="p.json", save_result=str(saved), json=False)
    workload = WorkloadSpec(num_requests=3, concurrency=1, input_len="32", output_len="3")
    assert (
        validate._predict_and_report(
            args, profile, workload, None, measured, SERVER, "smollm2-135m", {"cpus": 2, "steal_cpus": None}
        )
        == 0
    )
    cfg = json.loads(saved.read_text())["config"]
    assert cfg["step_time_statistic"] == "median of the interleaved passes"
    assert cfg["kernel_rows"] == profile["kernel_rows"]


def test_the_replay_runs_the_benchs_closed_loop_with_its_think_time(tmp_path):
    # Three one-client requests; the bench thought 0.5 s between them, so the replay must too.
    records = [
        RequestRecord(f"r{i}", 0.6 * i, 0.6 * i, 0.6 * i + 0.05, [0.6 * i + 0.05, 0.6 * i + 0.1], 0.6 * i + 0.1, 32, 2)
        for i in range(3)
    ]
    measured = SimpleNamespace(records=records, summary=summarize(records, 1.3))
    coefs = {"per_step_s": 2e-3, "per_token_s": 5e-5, "per_seq_s": 0.0, "per_context_token_s": 0.0, "per_pair_s": 0.0}
    profile = {"format": "servelab-profile", "version": 1, "model": "smollm2-135m", "fit": {"coefficients": coefs}}
    out = {}
    for think_s in (0.0, 0.5):
        saved = tmp_path / f"v{think_s}.json"
        args = argparse.Namespace(
            sim_model=None, base_url="http://x", profile="p.json", save_result=str(saved), json=False
        )
        workload = WorkloadSpec(num_requests=3, concurrency=1, input_len="32", output_len="2", think_time_s=think_s)
        assert (
            validate._predict_and_report(
                args, profile, workload, None, measured, SERVER, "smollm2-135m", {"cpus": 2, "steal_cpus": None}
            )
            == 0
        )
        out[think_s] = json.loads(saved.read_text())
    cfg = out[0.5]["config"]
    assert cfg["workload"]["think_time_s"] == 0.5 and cfg["replay"] == "closed loop, concurrency 1, think time 500 ms"
    # the replayed run spans its two thinks; without them it is three requests back to back
    assert out[0.5]["simulated"]["duration_s"] == pytest.approx(out[0.0]["simulated"]["duration_s"] + 1.0)


def test_an_exponential_think_time_replays_each_requests_own_draw():
    from servelab.bench.fidelity import replay_trace

    workload = WorkloadSpec(
        num_requests=4,
        concurrency=2,
        input_len="32",
        output_len="2",
        think_time_s=1.0,
        think_time_dist="exponential",
        seed=5,
    )
    drawn = [s.think_s for s in workload.generate()]
    # a bench record's id is its request's index; sent out of index order, as random thinks allow
    records = [
        RequestRecord(str(i), t, None, t + 0.1, [t + 0.1, t + 0.2], t + 0.2, 32, 2)
        for i, t in ((0, 0.0), (1, 0.0), (3, 1.5), (2, 2.5))
    ]
    trace = replay_trace(records, closed_loop=True, think_s=validate.bench_think_times(workload))
    assert [s.think_s for s in trace] == [drawn[0], drawn[1], drawn[3], drawn[2]]
    assert validate.bench_think_times(WorkloadSpec(num_requests=4, concurrency=2, think_time_s=0.5)) == 0.5


def _validate_against(monkeypatch, tmp_path, measured, served_model, *extra):
    """`servelab validate` with the live bench replaced by `measured` (what the server gave)."""
    from servelab.cli import main

    coefs = {"per_step_s": 2e-3, "per_token_s": 5e-5, "per_seq_s": 0.0, "per_context_token_s": 0.0, "per_pair_s": 0.0}
    profile = tmp_path / "p.json"
    profile.write_text(
        json.dumps(
            {"format": "servelab-profile", "version": 1, "model": "smollm2-135m", "fit": {"coefficients": coefs}}
        )
    )

    async def bench_live_server(args, workload, slo, profile=None):
        return measured, SERVER, served_model

    monkeypatch.setattr(validate, "bench_live_server", bench_live_server)
    return main(
        [
            "validate",
            "--base-url",
            "http://127.0.0.1:9",
            "--profile",
            str(profile),
            "--concurrency",
            "1",
            "--num-requests",
            "2",
            "--input-len",
            "32",
            "--output-len",
            "2",
            "--no-progress",
            *extra,
        ]
    )


def test_validate_fails_when_no_request_completed(monkeypatch, tmp_path, capsys):
    from servelab.bench.records import ClientReport

    records = [
        RequestRecord(
            f"r{i}", float(i), None, None, [], float(i), 32, 0, success=False, error="HTTP 404: no model 'wrongname'"
        )
        for i in range(2)
    ]
    measured = SimpleNamespace(
        records=records,
        summary=summarize(records, 2.0),
        report=ClientReport(failures={"HTTP 404: no model 'wrongname'": 2}),
    )
    assert _validate_against(monkeypatch, tmp_path, measured, "wrongname") == 1
    captured = capsys.readouterr()
    assert "0 / 2" in captured.out  # the measured run's report, with nothing to compare it to
    assert captured.err.splitlines()[-1] == (
        "servelab validate: no request completed: 2 of 2 failed "
        "(2 x HTTP 404: no model 'wrongname'); nothing to replay in the "
        "simulator"
    )


def _completed_run():
    from servelab.bench.records import ClientReport

    records = [
        RequestRecord(f"r{i}", 0.6 * i, 0.6 * i, 0.6 * i + 0.05, [0.6 * i + 0.05, 0.6 * i + 0.1], 0.6 * i + 0.1, 32, 2)
        for i in range(2)
    ]
    return SimpleNamespace(records=records, summary=summarize(records, 1.3), report=ClientReport())


@pytest.mark.parametrize(
    ("served", "extra", "other"),
    [
        ("llama-3.1-8b", [], "llama-3.1-8b"),  # the server runs another catalog model than the profile's
        ("smollm2-135m", ["--sim-model", "llama-3.1-8b"], "llama-3.1-8b"),  # the simulator would
        ("SmolLM2-135M-Instruct.Q4_1", [], None),  # the profile's model under its file name
        ("my-fine-tune", [], None),  # a served name the catalog does not know: nothing to say
    ],
)
def test_validate_warns_when_the_profile_is_another_models(served, extra, other, monkeypatch, tmp_path, capsys):
    assert _validate_against(monkeypatch, tmp_path, _completed_run(), served, *extra) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "was calibrated for model" in line]
    if other is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and f"not {other!r}" in warnings[0] and "'smollm2-135m'" in warnings[0]
