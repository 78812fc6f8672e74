"""`calibrate --base-url`: a profile fitted from outside a server whose step cost and settings
are known (a real engine and HTTP server over an executor that takes a set time per step)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.bench.timed_server import CHUNK, MAX_MODEL_LEN, MAX_SEQS, NUM_BLOCKS, SEQ_S, STEP_S, TOKEN_S

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory):
    from tests.tiny_models import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("timed-model") / "tiny-llama")
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.timed_server", str(model_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    url = proc.stdout.readline().strip()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the timed server did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(30)


def _calibrate(url: str, out, *extra: str) -> int:
    from servelab.cli import main

    return main(["calibrate", "--base-url", url, "--out", str(out), "--max-prompt-tokens", "400",
                 "--max-concurrency", "8", "--repeats", "3", "--no-progress", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def black_box_profile(timed_server, tmp_path_factory) -> Path:
    """One calibration from outside, the server's /metrics hidden throughout: the settings must
    come from the measurements alone. Two tests read it."""
    out = tmp_path_factory.mktemp("black-box") / "p.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("servelab.bench.client.OpenAIStreamClient.metrics_text", _no_metrics)
        assert _calibrate(timed_server, out) == 0
    return out


def test_a_profile_fitted_from_outside_recovers_the_servers_cost_and_settings(timed_server, black_box_profile,
                                                                              monkeypatch):  # fmt: skip
    from servelab.bench import blackbox as bb
    from servelab.cost.profile import ProfileStepCost, load_profile

    url = timed_server
    monkeypatch.setattr("servelab.bench.client.OpenAIStreamClient.metrics_text", _no_metrics)
    out = black_box_profile
    profile = load_profile(str(out))
    c = profile["fit"]["coefficients"]
    assert profile["fit"]["heldout"]["median_abs_pct"] < 15
    noise = profile["host_noise"]  # the panel shows it beside the held-out error
    assert isinstance(noise["noisy"], bool) and noise["measured_on"].startswith("the repeated single-request")
    # The fit prices what the server does beyond the executor (HTTP, tokenizing, scheduling), so it
    # is judged by its prices, against the executor's: never below them, and not far above.
    cost = ProfileStepCost.from_profile(profile)
    decode = STEP_S + MAX_SEQS * (TOKEN_S + SEQ_S)
    assert decode < cost.step_time_s([(1, 200)] * MAX_SEQS) < 1.5 * decode
    prefill = 3 * STEP_S + 300 * TOKEN_S + 3 * SEQ_S  # 300 tokens in chunks of 128
    priced = sum(cost.step_time_s([(n, done + n)]) for done, n in ((0, 128), (128, 128), (256, 44)))
    assert prefill < priced < 1.6 * prefill
    settings = profile["server_settings"]
    assert settings["max_num_seqs"]["value"] == MAX_SEQS and settings["max_num_seqs"]["source"] == "inferred"
    assert settings["max_num_batched_tokens"]["value"] == CHUNK, profile["inferred"]["chunk_budget"]
    assert settings["max_model_len"]["value"] == MAX_MODEL_LEN  # /v1/models says so
    assert settings["num_blocks"]["source"] == "assumed"
    # nothing left in the server: every request ended, every block back
    metrics = httpx.get(url + "/metrics").text
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'servelab:{family}{{model_name="timed-model"}} 0.0' in metrics, family
    # the partial results hold every point, so a resumed run measures nothing new
    lines = out.with_name("p.json.partial.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["phase"] == "header"
    t0 = time.perf_counter()
    assert _calibrate(url, out, "--resume") == 0
    assert time.perf_counter() - t0 < 5
    again = load_profile(str(out))
    assert again["run"]["measured"] == again["run"]["resumed"] == again["run"]["points"]
    assert again["fit"]["coefficients"] == c
    assert bb.sim_server_config(again["server_settings"])["max_num_seqs"] == str(MAX_SEQS)


async def _no_metrics(self):
    return None


def test_metrics_give_the_settings_exactly(timed_server, tmp_path):
    from servelab.cost.profile import load_profile

    url = timed_server
    out = tmp_path / "p.json"
    assert _calibrate(url, out, "--repeats", "1", "--max-prompt-tokens", "200", "--max-concurrency", "4") == 0
    settings = load_profile(str(out))["server_settings"]
    assert {k: (v["value"], v["source"]) for k, v in settings.items()} == {
        "max_model_len": (MAX_MODEL_LEN, "metrics"), "max_num_seqs": (MAX_SEQS, "metrics"),
        "max_num_batched_tokens": (CHUNK, "metrics"), "block_size": (16, "metrics"),
        "num_blocks": (NUM_BLOCKS, "metrics"), "enable_prefix_caching": (False, "metrics"),
    }  # fmt: skip


def test_a_budget_too_short_fits_nothing_and_says_how_to_go_on(timed_server, tmp_path, capsys):
    from servelab.cli import main

    url = timed_server
    code = main(["calibrate", "--base-url", url, "--out", str(tmp_path / "p.json"), "--budget", "0.05s",
                 "--no-progress"])  # fmt: skip
    assert code != 0
    err = capsys.readouterr().err
    assert "--budget" in err and "--resume" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_a_server_that_is_not_there_is_a_clear_error(tmp_path, capsys):
    from servelab.cli import main

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert main(["calibrate", "--base-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "p.json")]) != 0
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err


def test_validate_predicts_an_unseen_load_from_the_black_box_profile(timed_server, black_box_profile, monkeypatch,
                                                                    capsys):  # fmt: skip
    """Calibrated from outside, with the server's /metrics hidden throughout: validate at a
    concurrency and lengths the calibration never ran predicts p50 TPOT and throughput within
    15%, and p50 TTFT within 25%."""
    from servelab.cli import main

    url = timed_server
    monkeypatch.setattr("servelab.bench.client.OpenAIStreamClient.metrics_text", _no_metrics)
    profile = black_box_profile
    capsys.readouterr()
    assert main(["validate", "--base-url", url, "--profile", str(profile), "--sim-model", "smollm2-135m",
                 "--concurrency", "3", "--input-len", "150", "--output-len", "40", "--num-requests", "30",
                 "--warmup", "3", "--json", "--no-progress"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in result["comparison"]}
    errors = {name: rows[name]["error_pct"] for name in ("TPOT p50", "output tok/s", "TTFT p50")}
    assert abs(errors["TPOT p50"]) < 15 and abs(errors["output tok/s"]) < 15, errors
    assert abs(errors["TTFT p50"]) < 25, errors
    assert result["config"]["server"]["max_num_seqs"] == str(MAX_SEQS)


def test_host_noise_is_the_spread_of_repeated_prefills():
    from servelab.bench.blackbox import Results, prefill_noise

    def results(*ttfts_by_len: tuple[float, ...]) -> Results:
        r = Results(None)
        for n, ttfts in zip((64, 128), ttfts_by_len):
            for rep, t in enumerate(ttfts):
                r.add({"phase": "prefill", "batch": 1, "target": n, "repeat": rep, "ttft_s": t})
        return r

    quiet = prefill_noise(results((0.100, 0.102, 0.101), (0.200, 0.204, 0.201)))
    assert quiet["noisy"] is False and quiet["spread_median_pct"] == pytest.approx(0.75)  # 1% and 0.5%
    noisy = prefill_noise(results((0.100, 0.130, 0.125), (0.200, 0.260, 0.250)))
    assert noisy["noisy"] is True and "NOISY" in noisy["describe"]
    once = prefill_noise(results((0.100,), (0.200,)))
    assert once["noisy"] is None and "not measured" in once["describe"]


def test_progress_is_one_line_a_point_off_a_terminal(capsys):
    from servelab.bench.blackbox import progress_printer

    show = progress_printer(True, bar=False)
    show("prefill b=1 L=64", 1, 40)
    show("burst b=8 L=64", 2, 40)
    assert capsys.readouterr().err.splitlines() == ["progress 1/40 prefill b=1 L=64", "progress 2/40 burst b=8 L=64"]
    assert progress_printer(False) is None
