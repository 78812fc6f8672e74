"""`servelab bench` against a real `servelab serve` process with a tiny random model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servelab.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
_SERVING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.tiny_models import write_tiny_llama

    root = tmp_path_factory.mktemp("bench-real")
    model_dir = write_tiny_llama(root / "tiny-llama")
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servelab", "serve", "--model", str(model_dir), "--port", "0", "--no-access-log",
             "--no-lab"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        port = None
        while port is None and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log_path.read_text(errors='replace')}")
            match = _SERVING.search(log_path.read_text(errors="replace"))
            port = int(match.group(1)) if match else None
            time.sleep(0.2)
        assert port is not None, log_path.read_text(errors="replace")
        yield f"http://127.0.0.1:{port}", model_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_fifty_requests_complete_and_usage_matches(tiny_server, tmp_path, capsys):
    url, model_dir = tiny_server
    requests_out = tmp_path / "requests.jsonl"
    rc = cli_main(
        [
            "bench",
            "--base-url",
            url,
            "--concurrency",
            "8",
            "--num-requests",
            "50",
            "--input-len",
            "16-48",
            "--output-len",
            "4-12",
            "--tokenizer",
            str(model_dir),
            "--warmup",
            "2",
            "--json",
            "--requests-out",
            str(requests_out),
        ]
    )
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    summary, client = data["summary"], data["client"]
    assert (summary["completed"], summary["failed"]) == (50, 0)
    assert client["output_tokens_source"]["usage"] == 50  # the server's usage is what was counted
    assert client["output_shorter_than_requested"] == 0  # ignore_eos honoured: lengths follow the workload
    assert client["prompt_tokens_mismatch"]["requests"] == 0  # same tokenizer: prompt lengths exact
    rows = [json.loads(line) for line in requests_out.read_text().splitlines()]
    assert len(rows) == 50
    for row in rows:
        assert row["usage_output_tokens"] == row["planned_output_tokens"] == row["output_tokens"]
        assert row["usage_prompt_tokens"] == row["planned_prompt_tokens"]
        assert len(row["token_times_s"]) == row["output_tokens"]
    # A tiny model's tokens can reach the client in one read (TPOT 0), so only order is asserted.
    assert summary["e2e_s"]["p50"] >= summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p50"] >= 0


@pytest.mark.slow
def test_a_repeated_seed_is_reported_as_prefix_cache_hits(tiny_server, capsys):
    url, model_dir = tiny_server
    argv = ["bench", "--base-url", url, "--concurrency", "4", "--num-requests", "6", "--input-len", "40-60",
            "--output-len", "2", "--tokenizer", str(model_dir), "--json", "--seed", "4242"]  # fmt: skip

    def run(*extra: str) -> tuple[dict, str]:
        assert cli_main(argv + list(extra)) == 0
        captured = capsys.readouterr()
        return json.loads(captured.out)["server_prefix_cache"], captured.err

    first, err = run()
    assert first["hit_tokens"] == 0 and first["query_tokens"] > 0 and "warning" not in err
    second, err = run()  # the same prompts again
    assert second["unexpected"] and second["hit_tokens"] >= 6 * 32 and "--seed" in err
    third, err = run("--seed", "4243")
    assert third["hit_tokens"] == 0 and "warning" not in err
