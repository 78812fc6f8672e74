"""`servelab serve` argument errors: one line on stderr, exit status 2, no traceback, and no
model load before the cheap checks."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from servelab.commands.serve import parse_bytes
from servelab.errors import InvalidArgument


def serve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelab", "serve", *args], capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--shutdown-timeout", "soon"], "--shutdown-timeout"),
        (["--api-key", " "], "--api-key"),
        (["--max-request-bytes", "huge"], "--max-request-bytes"),
        (["--header-timeout", "0"], "--header-timeout: must be > 0"),
        (["--body-timeout", "soon"], "--body-timeout"),
        (["--max-connections-per-client", "-1"], "--max-connections-per-client: must be >= 0"),
        (["--allowed-hosts", ""], "--allowed-hosts"),
        (["--quantization", "int8", "--dtype", "bfloat16"], "quantization 'int8' computes in float32"),
        (["--profile", "/nonexistent/profile.json"], "--profile /nonexistent/profile.json: cannot read it"),
        (["--step-log", "/nonexistent/dir/steps.jsonl"], "--step-log: cannot write /nonexistent/dir/steps.jsonl"),
        (["--step-log", "steps.jsonl", "--data-parallel", "2"], "--step-log: logs one engine's steps"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needle):
    result = serve(*args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("servelab serve: error:")


def test_a_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve("--port", str(port), "--model", "/nonexistent/model", timeout_s=60)
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_model_is_a_one_line_error():
    result = serve("--port", "0", "--model", "/nonexistent/model.gguf")
    assert result.returncode == 2, result.stderr
    assert "/nonexistent/model.gguf" in result.stderr and "Traceback" not in result.stderr


def test_parse_bytes():
    assert parse_bytes("1GiB", name="x") == 1 << 30
    assert parse_bytes("512MB", name="x") == 512_000_000
    assert parse_bytes("4096", name="x") == 4096
    assert parse_bytes("1.5KiB", name="x") == 1536
    for bad in ("", "lots", "-1GiB", "0"):
        with pytest.raises(InvalidArgument, match="x"):
            parse_bytes(bad, name="x")
