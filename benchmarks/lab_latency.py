"""The lab API's cold answer time per lesson: at its defaults, then for several fresh inputs (each
a parameter set not asked before, so nothing is cached), with the p90 over those fresh answers:
the figures in docs/lab.md.

    PYTHONPATH=. python benchmarks/lab_latency.py [--quick]

Exits 1 if a lesson does not answer 200 (or 202, where it plans in the background)."""

from __future__ import annotations

import argparse
import time

import numpy as np
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app

# lesson -> fresh inputs, one change from the defaults each (the first is the one the docs quote).
CHANGES: dict[str, list[dict]] = {
    "two-workloads": [{"prompt_len": 4096}, {"batch": 64}, {"hardware": "a100-80gb"}],
    "batching": [{"context": 8192}, {"batch": 16}, {"model": "llama-2-7b"}],
    "slo": [
        {"rate": 30},
        {"prompt_len": 2048},
        {"output_len": 256},
        {"hardware": "h200"},
        {"model": "llama-2-7b"},
        {"prompt_len": 512, "output_len": 512},
    ],
    "chunked-prefill": [{"chunk_tokens": 1024}, {"prompt_len": 16384}, {"decode_batch": 48}],
    "disaggregated": [{"link_gbps": 5}, {"rate": 10}, {"prompt_len": 4096}],
    "memory": [{"context": 32768}, {"tpot_ms": 30}, {"hardware": "l40s"}],
    "request-cost": [{"output_len": 1024}, {"batch": 8}, {"prompt_len": 8192}],
    "limits": [{"output_cap": 256}, {"rate": 6}, {"prompt_len": 4096}, {"hardware": "h200"}],
    "qps-vs-tokens": [{"qps": 20}, {"b_prompt_len": 32768}, {"tpot_ms": 30}],
    "decode-chain": [{"output_len": 64}, {"batch": 64}, {"prompt_len": 8192}],
    "capacity": [{"tpot_ms": 45}],
    "capacity-pareto": [
        {"tpot_ms": 40},
        {"accelerators": "h200,l40s"},
        {"output_len": 64},
        {"prompt_len": 2048},
        {"ttft_ms": 500},
    ],
    "speculative": [{"acceptance": 0.9}],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each lesson at its defaults only (a smoke test)")
    args = ap.parse_args(argv)
    c = TestClient(create_lab_app())
    c.get("/api/catalog")
    ok = True
    for lesson, changes in CHANGES.items():
        times, codes = [], []
        for params in [{}] if args.quick else [{}, *changes]:
            t = time.perf_counter()
            r = c.post(f"/api/lessons/{lesson}", json=params)
            times.append(time.perf_counter() - t)
            codes.append(r.status_code)
            ok &= r.status_code in (200, 202)
        line = f"{lesson:16s} load {times[0]:.2f} s ({codes[0]})"
        if len(times) > 1:
            fresh = times[1:]
            line += (
                f"  change {fresh[0]:.2f} s  fresh p90 {np.percentile(fresh, 90):.2f} s, max {max(fresh):.2f} s "
                f"over {len(fresh)} ({', '.join(f'{s:.2f}' for s in fresh)})"
            )
        print(line, flush=True)
    c.app.state.capacity_planner.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
