"""The lab API's cold answer time per lesson, at its defaults and after one change to new parameters
(nothing cached): the figures in docs/lab.md.

    PYTHONPATH=. python benchmarks/lab_latency.py [--quick]

Exits 1 if a lesson does not answer 200 (or 202, where it plans in the background)."""

from __future__ import annotations

import argparse
import time

from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app


CHANGES = {
    "two-workloads": {"prompt_len": 4096},
    "batching": {"context": 8192},
    "slo": {"rate": 30},
    "chunked-prefill": {"chunk_tokens": 1024},
    "disaggregated": {"link_gbps": 5},
    "memory": {"context": 32768},
    "request-cost": {"output_len": 1024},
    "capacity": {"tpot_ms": 45},
    "speculative": {"acceptance": 0.9},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each lesson at its defaults only (a smoke test)")
    args = ap.parse_args(argv)
    c = TestClient(create_lab_app())
    c.get("/api/catalog")
    ok = True
    for lesson, change in CHANGES.items():
        out = []
        for params in ({},) if args.quick else ({}, change):
            t = time.perf_counter()
            r = c.post(f"/api/lessons/{lesson}", json=params)
            out.append((r.status_code, time.perf_counter() - t))
            ok &= r.status_code in (200, 202)
        print(
            f"{lesson:16s} "
            + "  ".join(f"{label} {s:.2f} s ({code})" for label, (code, s) in zip(("load", "change"), out))
        )
    c.app.state.capacity_planner.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
