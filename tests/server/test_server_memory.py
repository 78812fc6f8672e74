"""A server claims its KV pool's memory at start, so its RSS does not creep up to the pool size
under traffic (docs/benchmarks.md, Soak)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status"),
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_the_kv_pool_is_resident_when_the_server_starts(server_launcher, tiny_model_dir):
    pool = 768 * 2**20  # well above the idle server's own ~400 MB, so a lazy pool cannot pass
    server = server_launcher(tiny_model_dir, "--kv-cache-memory", "768MiB")
    try:
        assert rss_bytes(server.proc.pid) >= pool
    finally:
        server.stop()
