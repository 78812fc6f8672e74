"""`servelab serve` with its default connection limits under a connection attack: while 1,000
connections from two other addresses drip their headers a byte a second or send nothing (and are
opened again as soon as the server cuts them off), a plain 1-token completion from a third
address completes within 2 s at p99 and the server's resident memory stays within 32 MiB of
its idle size (docs/limits-and-safety.md)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from servelab.server.connections import DEFAULT_HEADER_TIMEOUT_S
from tests.server.adversarial import ConnectionAttack, rss_bytes

ATTACKERS = ["127.0.0.2", "127.0.0.3"]  # loopback addresses: to the server, two other clients
SLOW_PER_ADDRESS = 250
IDLE_PER_ADDRESS = 250
ATTACK_S = DEFAULT_HEADER_TIMEOUT_S + 5  # every attacking connection is cut off and opened again
RSS_BOUND_BYTES = 32 * 2**20
P99_BOUND_S = 2.0


def _plain_completion_s(url: str) -> float:
    t0 = time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=30)
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t0


@pytest.mark.slow  # ~30 s: the server's start, then 15 s of attack
def test_a_plain_completion_is_fast_and_memory_bounded_under_a_connection_attack(server_launcher, tiny_model_dir):
    server = server_launcher(tiny_model_dir)  # default limits
    pid = server.proc.pid
    for _ in range(5):  # warm: the first requests' one-time costs are not the attack's
        _plain_completion_s(server.url)
    idle_rss = rss_bytes(pid)
    peak_rss = [idle_rss]
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.wait(0.1):
            peak_rss[0] = max(peak_rss[0], rss_bytes(pid))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    attack = ConnectionAttack(server.port, ATTACKERS, slow=SLOW_PER_ADDRESS, idle=IDLE_PER_ADDRESS).start()
    try:
        opened_at_start = attack.num_open
        latencies_s = []
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            latencies_s.append(_plain_completion_s(server.url))  # a new connection each time
            time.sleep(0.1)
        held_at_end = attack.num_open
    finally:
        attack.stop()
        sampling.set()
        sampler.join()
    attackers = len(ATTACKERS) * (SLOW_PER_ADDRESS + IDLE_PER_ADDRESS)
    # the attack held throughout (at the end, a few may be between a cut-off and their reopening)
    assert opened_at_start == attackers and held_at_end >= attackers - 10 and attack.num_refused == 0
    assert attack.num_closed_by_server >= attackers  # each cut off at the header timeout at least once
    latencies_s.sort()
    p99_s = latencies_s[min(len(latencies_s) - 1, int(0.99 * len(latencies_s)))]
    assert len(latencies_s) >= 20 and p99_s < P99_BOUND_S, latencies_s[-5:]
    growth = peak_rss[0] - idle_rss
    assert growth < RSS_BOUND_BYTES, f"RSS grew {growth / 2**20:.1f} MiB under the attack"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
