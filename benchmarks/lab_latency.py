"""The lab API's cold answer time per lesson, at its defaults and after one change to new parameters
(nothing cached): the figures in docs/lab.md. Run: PYTHONPATH=. python benchmarks/lab_latency.py"""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app


CHANGES = {"two-workloads": {"prompt_len": 4096}, "batching": {"context": 8192}, "slo": {"rate": 30},
           "chunked-prefill": {"chunk_tokens": 1024}, "disaggregated": {"link_gbps": 5}, "memory": {"context": 32768},
           "request-cost": {"output_len": 1024}, "capacity": {"tpot_ms": 45}}

def main() -> None:
    c = TestClient(create_lab_app())
    c.get("/api/catalog")
    for lesson, change in CHANGES.items():
        out = []
        for params in ({}, change):
            t = time.perf_counter(); r = c.post(f"/api/lessons/{lesson}", json=params); out.append((r.status_code, time.perf_counter() - t))
        print(f"{lesson:16s} load {out[0][1]:.2f} s ({out[0][0]})  change {out[1][1]:.2f} s ({out[1][0]})")
    c.app.state.capacity_planner.close()

if __name__ == "__main__":
    main()
