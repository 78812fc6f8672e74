"""The simulator lessons as a web server must run them: a JSON POST (a GET is 405, other content
types 415), a time and a memory budget per lesson with a clear error past either, a cache bounded
in bytes, and a stop that ends running simulations within milliseconds, in-process and when a
real `servelab lab` process gets SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app
from servelab.lab.capacity_lesson import CapacityPlanner
from servelab.lab.simulations import ResultCache, Simulations

REPO = Path(__file__).resolve().parents[2]
# The slo lesson at its largest inputs: minutes of CPU and gigabytes if it ran.
MAXIMAL_SLO = {"rate": 1000, "prompt_len": 1024, "output_len": 8192}
# A run of several seconds on one core, within the memory budget.
LONG_SLO = {"rate": 30, "prompt_len": 512, "output_len": 4096}


def test_a_lesson_is_a_json_post_and_a_get_is_405():
    client = TestClient(create_lab_app(max_request_bytes=2**20))
    got = client.get("/api/lessons/slo", params={"rate": 10})
    assert got.status_code == 405 and got.headers["allow"] == "POST"
    assert "POST /api/lessons/slo" in got.json()["error"]["message"]
    form = client.post("/api/lessons/batching", content=b"batch=8", headers={"Content-Type": "text/plain"})
    assert form.status_code == 415  # what another site's page could send without a preflight
    not_object = client.post("/api/lessons/batching", json=[1, 2])
    assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]
    assert client.post("/api/lessons/batching", json={"batch": 8}).json()["config"]["batch"] == 8


def test_a_run_past_the_memory_budget_is_refused_before_it_starts():
    sims = Simulations()
    client = TestClient(create_lab_app(simulations=sims))
    start = time.monotonic()
    r = client.post("/api/lessons/slo", json=MAXIMAL_SLO)
    assert time.monotonic() - start < 5.0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "MiB per run" in error["message"] and "lower rate, prompt_len or output_len" in error["message"]
    assert error["param"] == "output_len" and error["code"] == "simulation_over_budget"
    assert len(sims.cache) == 0


def test_a_run_past_the_time_budget_ends_with_a_clear_error_and_frees_its_slot():
    sims = Simulations(time_budget_s=0.2)
    client = TestClient(create_lab_app(simulations=sims))
    start = time.monotonic()
    r = client.post("/api/lessons/slo", json=LONG_SLO)
    assert time.monotonic() - start < 5.0
    assert r.status_code == 400, r.text
    assert "time budget of 0.2 s" in r.json()["error"]["message"]
    for _ in range(sims.max_running):  # every slot is free again
        assert sims._slots.acquire(blocking=False)


def _count_simulations(monkeypatch) -> list[int]:
    from servelab.lab import sim_lessons

    calls = []
    real = sim_lessons.simulate
    monkeypatch.setattr(sim_lessons, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_the_result_cache_stays_under_its_bound_in_bytes(monkeypatch):
    calls = _count_simulations(monkeypatch)
    sims = Simulations(cache_bytes=3 * 2**20)
    app = create_lab_app(simulations=sims)
    app.state.capacity_planner = CapacityPlanner(max_running=0)  # the in-process runs only: no sweep
    client = TestClient(app)
    for rate in (4, 8, 16, 32):
        # The chosen rate's run is the lesson's in-process simulation (202: the sweep would follow).
        assert client.post("/api/lessons/slo", json={"rate": rate, "output_len": 256}).status_code == 202
        assert 0 < sims.cache.bytes <= 3 * 2**20
    assert 0 < len(sims.cache) < len(calls)  # some results did not fit and were dropped


def test_a_repeated_lesson_answers_from_the_cache(monkeypatch):
    calls = _count_simulations(monkeypatch)
    app = create_lab_app(simulations=Simulations())
    app.state.capacity_planner = CapacityPlanner(max_running=0)
    client = TestClient(app)
    first = client.post("/api/lessons/slo", json={"rate": 8, "output_len": 64}).json()
    simulated = len(calls)
    assert simulated > 0
    assert client.post("/api/lessons/slo", json={"rate": 8, "output_len": 64}).json() == first
    assert len(calls) == simulated


def test_result_cache_evicts_the_least_recently_used():
    cache = ResultCache(max_bytes=100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 40)
    assert cache.get("a") == 1  # now b is the oldest
    cache.put("c", 3, 40)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3) and cache.bytes == 80
    cache.put("huge", 4, 101)  # larger than the whole bound: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 2


def test_stop_ends_a_running_simulation_within_a_second():
    app = create_lab_app()
    client = TestClient(app)
    answers = []
    runner = threading.Thread(target=lambda: answers.append(client.post("/api/lessons/slo", json=LONG_SLO)))
    runner.start()
    time.sleep(0.5)
    assert runner.is_alive(), "the simulation finished before it could be stopped: make LONG_SLO longer"
    stopped = time.monotonic()
    app.state.stop()
    runner.join(timeout=5)
    assert time.monotonic() - stopped < 1.0
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]
    refused = client.post("/api/lessons/chunked-prefill", json={})
    assert refused.status_code == 503


@pytest.mark.slow
def test_sigterm_during_a_simulation_exits_promptly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "servelab", "lab", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/api/health", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the lab did not start"
                time.sleep(0.2)
        answers = []
        runner = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/api/lessons/slo", json=LONG_SLO, timeout=60))
        )
        runner.start()
        time.sleep(1.0)
        assert runner.is_alive()
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 5.0
        runner.join(timeout=10)
        assert answers and answers[0].status_code == 503
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_to_servelab_serve_during_a_lab_simulation_exits_within_the_drain_timeout(tmp_path):
    from tests.server.conftest import launch_server
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny-llama")
    server = launch_server(model, tmp_path / "logs", "--shutdown-timeout", "5s", lab=True)
    try:
        answers = []
        runner = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{server.url}/lab/api/lessons/slo", json=LONG_SLO, timeout=60))
        )
        runner.start()
        time.sleep(1.0)
        assert runner.is_alive()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0, server.log()
        assert time.monotonic() - start < 5.0, server.log()
        runner.join(timeout=10)
        assert answers and answers[0].status_code == 503
    finally:
        server.stop()
