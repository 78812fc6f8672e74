"""What the end-to-end cluster tests read from a running `servelab serve`: per-worker metrics,
whether processes are gone, and two long streams across a worker's death; and external workers
started on their own, as on other hosts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def metric(text: str, name: str) -> dict[str, float]:
    """worker label -> value of `name` (the unlabelled total under key "")."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line[len(name) :].rsplit(" ", 1)
            worker = next(
                (p.split("=")[1].strip('"}') for p in labels.strip("{}").split(",") if p.startswith("worker=")), ""
            )
            out[worker] = float(value)
    return out


def reaped(pid: int, timeout_s: float) -> bool:
    """The process is gone and its parent has collected it: no zombie is left in the table."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (a worker's grammar workers and
    tensor-parallel ranks; not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                children.append(int(child))
    return children


def is_grammar_worker(pid: int) -> bool:
    """A grammar worker process: it has xgrammar loaded (a tensor-parallel rank does not)."""
    try:
        return "xgrammar" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def grammar_workers(pid: int) -> list[int]:
    return [child for child in spawned_children(pid) if is_grammar_worker(child)]


def gone(pids: list[int], timeout_s: float) -> bool:
    """Every pid exited (a zombie its parent has not reaped yet counts: it runs nothing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.2)


def streams_across_a_kill(url: str, max_tokens: int, kill: Callable[[], None]) -> tuple[list[dict], list[str], float]:
    """Open two long streams (least-outstanding puts one on each of two workers), call `kill`, and
    read both to `[DONE]`: the error objects, the finish reasons, and the seconds the ends took."""
    body = {"prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        streams = []
        for _ in range(2):
            ctx = client.stream("POST", url + "/v1/completions", json=body)
            lines = (line for line in ctx.__enter__().iter_lines() if line)
            streams.append((ctx, [next(lines)], lines))
        assert [w["outstanding"] for w in httpx.get(url + "/health").json()["workers"]] == [1, 1]
        kill()
        t0 = time.monotonic()
        endings = []
        for ctx, events, lines in streams:
            events.extend(lines)
            ctx.__exit__(None, None, None)
            assert events[-1] == "data: [DONE]"
            endings.append(json.loads(events[-2].removeprefix("data: ")))
    errors = [e["error"] for e in endings if "error" in e]
    finished = [e["choices"][0]["finish_reason"] for e in endings if "choices" in e]
    return errors, finished, time.monotonic() - t0


def env_workers(tmp_path: Path, argv: list[str], ranks: tuple[int, ...] = (1, 2)) -> tuple[int, list]:
    """A free port for the front end, and one process per rank running `argv` (cwd: the repo)
    that joins through env:// (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE); logs in worker<rank>.log."""
    import os
    import socket
    import subprocess

    from tests.server.conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = []
    for rank in ranks:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(len(ranks) + 1), PYTHONUNBUFFERED="1")  # fmt: skip
        with open(tmp_path / f"worker{rank}.log", "wb") as log:
            workers.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env))
    return port, workers
