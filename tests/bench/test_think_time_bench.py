"""`bench`'s closed loop with a think time, against the mock server: a worker pauses after each
request before it takes the next (not before its first, not after its last), and a pausing worker
stops at once on an abort or the deadline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servelab.bench.client import BenchRequest, OpenAIStreamClient
from servelab.bench.runner import run_load
from servelab.cli import main as cli_main

MOCK = Path(__file__).with_name("mock_openai_server.py")


@pytest.fixture(scope="module")
def url():
    proc = subprocess.Popen(
        [sys.executable, str(MOCK), "--ttft-ms", "20", "--tpot-ms", "10"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
    finally:
        proc.kill()
        proc.wait()


async def _run(url: str, n: int, concurrency: int, think_s: float, **kw):  # noqa: ANN003, ANN202
    requests = [BenchRequest(i, f"think-{i} hello", 2, 3, think_s=think_s) for i in range(n)]
    async with OpenAIStreamClient(url, model="mock-model", endpoint="completions", max_connections=concurrency) as c:
        return await asyncio.wait_for(run_load(c, iter(requests), concurrency=concurrency, **kw), timeout=10)


def test_a_worker_thinks_between_its_requests_not_before_its_first(url):
    think_s, c, n = 0.15, 2, 8
    start = time.perf_counter()
    out = asyncio.run(_run(url, n, c, think_s))
    results = sorted(out.results, key=lambda r: r.send_s)
    assert len(results) == n and all(r.success for r in results)
    assert results[c - 1].send_s - out.start_s < 0.05  # the first wave leaves at once
    # Each follow-up leaves at least a think time after some request of its worker ended; matched
    # in order, the k-th follow-up's send and the k-th end keep that gap.
    sends = [r.send_s for r in results[c:]]
    ends = sorted(r.end_s for r in results)[: n - c]
    gaps = [s - e for s, e in zip(sends, ends)]
    assert min(gaps) >= think_s
    assert max(gaps) < think_s + 0.1  # ... and not much more: the pause is the think time
    # The last requests' clients have nothing left to take: the run ends without their thinks.
    assert time.perf_counter() - start < max(r.end_s for r in results) - out.start_s + think_s


def test_an_abort_ends_a_thinking_worker_at_once(url):
    start = time.perf_counter()
    out = asyncio.run(_run(url, 6, 2, 30.0, should_abort=lambda done, _in_flight, _now: "enough" if done else ""))
    assert out.aborted and time.perf_counter() - start < 3.0


def test_an_open_loop_waiting_for_a_slot_sends_nothing_after_an_abort(url):
    # Every request due at once, one slot: the second waits for the first's slot, and the abort on
    # the first's result must stop it there rather than send it and cut it off.
    requests = [BenchRequest(i, f"slot-{i} hello", 2, 3, planned_send_s=0.0) for i in range(4)]

    async def run():  # noqa: ANN202
        async with OpenAIStreamClient(url, model="mock-model", endpoint="completions", max_connections=1) as c:
            return await run_load(
                c, requests, concurrency=1, should_abort=lambda done, _f, _n: "enough" if done else ""
            )

    out = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert out.aborted and len(out.results) == 1 and out.cancelled == 0


def test_the_deadline_ends_a_thinking_worker_at_once(url):
    start = time.perf_counter()
    out = asyncio.run(_run(url, 6, 2, 30.0, duration_s=0.3))
    assert len(out.results) == 2 and time.perf_counter() - start < 3.0


def test_cli_records_the_think_time_and_refuses_it_with_a_rate(url, capsys):
    argv = ["bench", "--base-url", url, "--input-len", "8", "--output-len", "3", "--num-requests", "4", "--json"]
    assert cli_main([*argv, "--concurrency", "2", "--think-time", "20ms"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["workload"]["think_time_s"] == pytest.approx(0.02) and data["summary"]["completed"] == 4
    assert cli_main([*argv, "--rate", "5", "--think-time", "20ms"]) == 2
    err = capsys.readouterr().err
    assert "--think-time" in err and "--rate" in err
    assert cli_main([*argv, "--find-capacity", "--search", "rate", "--slo-tpot", "1s", "--think-time", "1s"]) == 2
    assert "--search rate" in capsys.readouterr().err
