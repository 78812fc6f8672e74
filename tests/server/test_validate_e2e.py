"""`calibrate` -> `validate` end to end on the bundled model: a coarse profile, a real
`servelab serve`, a short bench run replayed through the simulator. This checks the loop and the
report, not the accuracy (docs/fidelity.md records that)."""

from __future__ import annotations

import json

import pytest

from servelab.cli import main
from servelab.commands import calibrate

pytestmark = pytest.mark.slow


def test_calibrate_then_validate_against_a_live_server(server_launcher, tmp_path, monkeypatch, capsys):
    from servelab.engine.bundled import bundled_model_path

    try:
        path = bundled_model_path()
    except Exception as e:
        pytest.skip(f"bundled model unavailable: {e}")
    small = calibrate.Grid(
        chunk=64,
        prefill_lens=(16, 64, 128),
        decode_batches=(1, 2, 4),
        decode_contexts=(32, 96),
        decode_steps=3,
        repeats=2,
    )
    monkeypatch.setitem(calibrate.GRIDS, "coarse", small)
    # the serving term (per step and per sequence) from two short closed loops against the server calibrate starts
    monkeypatch.setattr(calibrate, "SERVER_RUNS", ((1, 2), (2, 3)))
    monkeypatch.setattr(calibrate, "SERVER_OUTPUT_LEN", 6)
    profile = tmp_path / "profile.json"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(path),
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--out",
                str(profile),
                "--max-heldout-error",
                "1e9",
                "--server-term",
            ]
        )
        == 0
    )  # accuracy is not tested
    text = capsys.readouterr().out
    assert "server_per_step_s" in text and "server_per_seq_s" in text and "per_prefill_step_s" in text
    term = json.loads(profile.read_text())["server"]
    assert [r["concurrency"] for r in term["runs"]] == [1, 2] and term["per_step_s"] >= 0 and term["per_seq_s"] >= 0
    assert all(r["measured_tpot_p50_s"] > 0 and r["engine_only_tpot_p50_s"] > 0 for r in term["runs"])
    # fitted from every step the server ran (its --step-log), grouped by the step's sequences
    assert term["steps"] == len(term["served_steps"]) > 10 and {g["seqs"] for g in term["by_seqs"]} <= {1, 2}
    assert sum(g["steps"] for g in term["by_seqs"]) == term["steps"] and "served steps" in text
    # its clients paused a seeded draw after each request, and the check replayed each draw
    for r in term["runs"]:
        assert len(r["think_s"]) == r["requests"] and min(r["think_s"]) >= 0
        assert r["think_time_s"] == pytest.approx(sum(r["think_s"]) / r["requests"]) and r["think_time_s"] > 0
    step_log = tmp_path / "steps.jsonl"
    server = server_launcher(
        path, "--max-model-len", "512", "--dtype", "float32", "--max-num-seqs", "4", "--step-log", str(step_log)
    )
    saved = tmp_path / "validate.json"
    assert (
        main(
            [
                "validate",
                "--base-url",
                server.url,
                "--profile",
                str(profile),
                "--concurrency",
                "2",
                "--num-requests",
                "6",
                "--input-len",
                "24",
                "--output-len",
                "6",
                "--seed",
                "3",
                "--think-time",
                "20ms",
                "--save-result",
                str(saved),
                "--no-progress",
                "--step-log",
                str(step_log),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    print(text)
    assert "ms per step +" in text.splitlines()[0]  # which serving term the replay used
    for metric in ("TTFT p50", "TPOT p50", "ITL p90", "output tok/s"):
        assert metric in text
    out = json.loads(saved.read_text())
    cfg = out["config"]
    assert cfg["serving_term"] == {"form": "per-step", "per_step_s": term["per_step_s"], "per_seq_s": term["per_seq_s"]}
    assert cfg["replayed_requests"] == 6 and cfg["sim_model"] == "smollm2-135m"
    # the bench's clients paused 20 ms between requests, and the replay's did too
    assert cfg["workload"]["think_time_s"] == 0.02 and cfg["replay"] == "closed loop, concurrency 2, think time 20 ms"
    assert cfg["host"]["steal_cpus"] >= 0 and "host: the hypervisor took" in text  # the measured run's steal
    # the steps the server ran during the run, from its step log, priced with the profile
    steps = out["server_steps"]
    assert 6 <= steps["steps"] <= 6 * 6 and steps["served_s"] > 0 and steps["priced_s"] > 0  # 6 x 6 tokens
    assert f"server steps: {steps['steps']} during the run" in text
    # the simulator ran the server's own budgets and KV pool, read from /metrics
    assert cfg["server"]["max_num_seqs"] == "4" and int(cfg["server"]["num_blocks"]) > 0
    assert out["measured"]["completed"] == out["simulated"]["completed"] == 6
    for side in ("measured", "simulated"):  # the same 6 x 6 output tokens on both sides
        assert out[side]["output_throughput"] * out[side]["duration_s"] == pytest.approx(36)
    rows = {r["metric"]: r for r in out["comparison"]}
    assert rows["TPOT p50"]["measured"] > 0 and rows["TPOT p50"]["simulated"] > 0
    assert rows["TPOT p50"]["error_pct"] == pytest.approx(
        (rows["TPOT p50"]["simulated"] - rows["TPOT p50"]["measured"]) / rows["TPOT p50"]["measured"] * 100
    )
