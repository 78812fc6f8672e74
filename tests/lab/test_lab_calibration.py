"""The "your machine" panel's background calibration: one at a time, with progress, its errors
shown, ended with the server, and its profile loaded into the panel when it finishes. A stand-in
script plays `servelab calibrate --base-url` (the real one takes minutes)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION
from servelab.lab.app import create_lab_app
from servelab.lab.calibration_job import CalibrationRunner, calibrate_argv

METRICS = (
    'servelab:cache_config_info{model_name="m",block_size="16",num_blocks="64"} 1.0\n'
    'servelab:scheduler_config_info{model_name="m",max_num_seqs="4",max_num_batched_tokens="256",'
    'max_model_len="512",policy="chunked",order="fcfs"} 1.0\n'
)
PROFILE = {
    "format": PROFILE_FORMAT,
    "version": PROFILE_VERSION,
    "source": "black-box",
    "model": "smollm2-135m",
    "host_noise": {"noisy": True, "spread_median_pct": 14.2, "thresholds": {"spread_median_pct": 10.0}},
    "fit": {
        "coefficients": {
            "per_step_s": 0.01,
            "per_token_s": 0.0,
            "per_seq_s": 0.0,
            "per_context_token_s": 0.0,
            "per_pair_s": 0.0,
        },  # fmt: skip
        "heldout": {"count": 12, "median_abs_pct": 4.5, "max_abs_pct": 11.0},
    },
}
# argv: OUT MODE SEEN PROFILE; prints calibrate's progress lines, then writes the profile or fails.
STAND_IN = """
import json, os, shutil, sys, time
out, mode, seen, profile = sys.argv[1:5]
with open(seen, "w") as f:
    json.dump({"key": os.environ.get("SERVELAB_API_KEY"), "argv": sys.argv}, f)
for i in range(1, 4):
    print(f"progress {i}/3 prefill b=1 L={64 * i}", file=sys.stderr, flush=True)
if mode == "hang":
    time.sleep(60)
if mode == "fail":
    print("servelab calibrate: error: only 3 points measured: give a longer --budget", file=sys.stderr)
    sys.exit(1)
shutil.copyfile(profile, out)
print("wrote " + out)
"""


def _records() -> list[dict]:
    return [{"sent_s": i * 0.06, "first_token_s": i * 0.06 + 0.01, "last_token_s": i * 0.06 + 0.05,
             "prompt_tokens": 8, "output_tokens": 5} for i in range(4)]  # fmt: skip


def _app(tmp_path: Path, mode: str) -> tuple[TestClient, Path]:
    script, profile, seen = tmp_path / "stand_in.py", tmp_path / "fitted.json", tmp_path / "seen.json"
    script.write_text(STAND_IN)
    profile.write_text(json.dumps(PROFILE))

    def argv_for(base_url: str, out: str, served_model: str | None) -> list[str]:
        return [sys.executable, str(script), out, mode, str(seen), str(profile), base_url, served_model or ""]

    app = create_lab_app(lambda: METRICS, served_model=lambda: "smollm2-135m")
    app.state.calibration = CalibrationRunner(app.state.predictor.set_profile, argv_for, out_dir=str(tmp_path))
    return TestClient(app), seen


def _wait(client: TestClient, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get("/api/live/calibrate").json()
        if status["state"] != "running" or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_a_calibration_reports_progress_and_its_profile_drives_the_prediction(tmp_path):
    client, seen = _app(tmp_path, "ok")
    assert client.get("/api/live/calibrate").json()["state"] == "idle"
    before = client.post("/api/live/predict", json={"concurrency": 1, "records": _records()}).json()
    assert not before["has_prediction"] and "Calibrate" in before["why_no_prediction"]
    started = client.post("/api/live/calibrate", headers={"Authorization": "Bearer sk-lab"})
    assert started.status_code == 202 and started.json()["state"] == "running"
    status = _wait(client)
    assert status["state"] == "done", status
    assert (status["points_done"], status["points_total"]) == (3, 3) and status["current"] == "prefill b=1 L=192"
    assert status["profile_path"].startswith(str(tmp_path)) and status["error"] is None
    called = json.loads(seen.read_text())
    assert called["key"] == "sk-lab"  # in the environment, not on the command line
    assert "sk-lab" not in called["argv"] and called["argv"][-2:] == ["http://testserver", "smollm2-135m"]
    setup = client.get("/api/live/setup").json()["profile"]
    assert setup["path"] == status["profile_path"] and setup["held_out"]["median_abs_pct"] == 4.5
    assert setup["noise"]["noisy"] is True and "10% slower" in setup["noise"]["rule"]
    d = client.post("/api/live/predict", json={"concurrency": 1, "records": _records()}).json()
    assert d["has_prediction"] and d["config"]["profile"] == status["profile_path"]
    table = d["percentiles"]
    assert table["TPOT"]["percentiles"] == ["p50", "p90", "p99"]
    assert table["TPOT"]["measured_ms"][0] == pytest.approx(10.0) and table["TPOT"]["predicted_ms"][0] == pytest.approx(
        10.0
    )
    # requests that succeeded without a token (an immediate EOS) leave nothing to replay: the
    # measurement comes back with the reason, not a 400
    empty = [{**r, "output_tokens": 0} for r in _records()]
    no_tokens = client.post("/api/live/predict", json={"concurrency": 1, "records": empty})
    assert no_tokens.status_code == 200 and "produced a token" in no_tokens.json()["why_no_prediction"]
    stats = {s["label"]: s["value"] for s in d["stats"]}
    assert stats["profile's held-out error (median / max)"] == "4.5% / 11% over 12 steps"
    assert stats["host while calibrating"].startswith("NOISY") and "noisy host" in d["notice"]
    assert "measured" in stats["TTFT p50 / p90 / p99"] and "predicted" in stats["TTFT p50 / p90 / p99"]


def test_a_failed_calibration_shows_calibrates_own_error_and_keeps_no_profile(tmp_path):
    client, _ = _app(tmp_path, "fail")
    assert client.post("/api/live/calibrate").status_code == 202
    status = _wait(client)
    assert status["state"] == "failed" and status["error"] == "only 3 points measured: give a longer --budget"
    assert client.get("/api/live/setup").json()["profile"] is None
    assert client.post("/api/live/calibrate").status_code == 202  # a new try may start


def test_one_at_a_time_and_a_stopping_server_ends_it(tmp_path):
    client, _ = _app(tmp_path, "hang")
    assert client.post("/api/live/calibrate").status_code == 202
    again = client.post("/api/live/calibrate")
    assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
    t0 = time.monotonic()
    client.app.state.stop()
    status = _wait(client, timeout_s=10)
    assert status["state"] == "cancelled" and "shutting down" in status["error"]
    assert time.monotonic() - t0 < 5
    refused = client.post("/api/live/calibrate")
    assert refused.status_code == 503


def test_without_an_engine_there_is_nothing_to_calibrate():
    client = TestClient(create_lab_app())
    response = client.post("/api/live/calibrate")
    assert response.status_code == 404 and "servelab serve" in response.json()["error"]["message"]


def test_the_server_root_is_the_labs_parent_mount(tmp_path):
    seen: list[str] = []

    class Recorder(CalibrationRunner):
        def start(self, base_url, api_key, served_model):  # noqa: ANN001, ANN201
            seen.append(base_url)
            return {"state": "running"}

    lab = create_lab_app(lambda: METRICS)
    lab.state.calibration = Recorder(lab.state.predictor.set_profile)
    server = FastAPI()
    server.mount("/lab", lab)
    assert TestClient(server).post("/lab/api/live/calibrate").status_code == 202
    assert seen == ["http://testserver"]
    # the address the request came in on, not the Host header its client wrote: calibration's
    # minutes of load, and the caller's key, go nowhere else
    headers = {"Host": "attacker.example:4444"}
    assert TestClient(server).post("/lab/api/live/calibrate", headers=headers).status_code == 202
    assert seen == ["http://testserver"] * 2


def test_the_labs_command_is_a_short_black_box_calibrate_that_calibrate_parses():
    import argparse

    from servelab.commands.calibrate import add_arguments

    argv = calibrate_argv("http://127.0.0.1:8000", "/tmp/p.json", "m")
    assert argv[1:4] == ["-m", "servelab.cli", "calibrate"] and "--api-key" not in argv
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[4:])
    assert (args.base_url, args.out, args.budget, args.served_model) == (
        "http://127.0.0.1:8000",
        "/tmp/p.json",
        "120s",
        "m",
    )
    assert (args.max_prompt_tokens, args.max_concurrency, args.repeats) == (256, 4, 2)
