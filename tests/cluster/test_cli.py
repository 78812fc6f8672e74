"""The data-parallel flags of `serve` and `worker`: refused combinations exit 2 with one line
naming the flag, before any port is bound or model loaded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--data-parallel", "0"], "--data-parallel must be >= 1, got 0"),
    (["serve", "--router", "least-kv"], "--router: only with --data-parallel N > 1"),
    (["serve", "--master-port", "29500"], "--master-addr/--master-port: only with --data-parallel N > 1"),
    (["serve", "--external-workers"], "--external-workers: needs --master-port"),
    (["serve", "--data-parallel", "2", "--join-timeout", "soon"], "--join-timeout"),
    (["serve", "--worker-hang-timeout", "60s"], "--worker-hang-timeout: only with --data-parallel N > 1"),
    (["serve", "--data-parallel", "2", "--worker-hang-timeout", "soon"], "--worker-hang-timeout: cannot parse"),
    (["serve", "--worker-restart-limit", "5"], "--worker-restart-limit: only with local workers"),
    (["serve", "--data-parallel", "2", "--worker-restart-limit", "-1"], "--worker-restart-limit: must be >= 0"),
    (["serve", "--disagg", "1:1", "--external-workers", "--master-port", "29500", "--worker-restart-limit", "5"],
     "--worker-restart-limit: only with local workers"),
    (["worker", "--master-addr", "h", "--master-port", "29500", "--world-size", "3", "--rank", "0"],
     "--rank: 0 is the front end"),
    (["worker", "--master-addr", "h", "--master-port", "29500", "--world-size", "3", "--rank", "3"],
     r"rank must be in [0, 2] for world size 3"),
])  # fmt: skip
def test_bad_cluster_flags_exit_2_naming_the_flag(argv, message, capsys, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"servelab {argv[0]}: error:"), err


def test_worker_without_rendezvous_names_the_missing_variable(capsys, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["worker", "--master-port", "29500"]) == 2
    assert "--master-addr is not given and MASTER_ADDR is not set" in capsys.readouterr().err


def test_worker_without_a_front_end_says_so_in_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-m", "servelab", "worker", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--rank", "1", "--world-size", "2", "--join-timeout", "1s"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    # not torch's DistNetworkError traceback and its C++ stack traces (~70 lines)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1] == f"servelab worker: error: no front end at 127.0.0.1:{port} within 1 s", proc.stderr
    assert len(lines) <= 2 and "Traceback" not in proc.stderr  # the "joining" log line, then the error


def test_router_choices_come_from_the_shared_router(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--data-parallel", "2", "--router", "random"])
    assert "prefix-affinity" in capsys.readouterr().err


def test_the_hang_timeout_flag_reaches_the_front_end():
    import argparse

    from servelab.cluster.channel import HANG_TIMEOUT_S
    from servelab.commands._cluster_cli import add_cluster_arguments, hang_timeout_s

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert hang_timeout_s(parser.parse_args([])) == HANG_TIMEOUT_S
    assert hang_timeout_s(parser.parse_args(["--worker-hang-timeout", "90s"])) == 90.0
    assert hang_timeout_s(parser.parse_args(["--worker-hang-timeout", "0"])) is None  # no watchdog
