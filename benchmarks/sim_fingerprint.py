"""Fingerprints of seeded simulator runs, to show that a speed change changed no result.

Runs a fixed set of seeded configurations (colocated chunked with a shared prefix, prefill-first,
disaggregated, a KV pool small enough to preempt, a closed loop over two replicas, mixed lengths)
and prints, per configuration, the step count, preemptions, TTFT/TPOT/ITL percentiles and a
SHA-256 over every record (all token times included), the step trace and the replica stats.
Run it before and after a change and diff the output: any difference is a semantic change.

    .venv/bin/python benchmarks/sim_fingerprint.py > before.txt
    ... change ...
    .venv/bin/python benchmarks/sim_fingerprint.py > after.txt && diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from typing import Any

from servelab.core.config import SchedulerConfig
from servelab.sim import SimConfig, simulate
from servelab.workload import WorkloadSpec


def configs(n: int) -> dict[str, tuple[SimConfig, WorkloadSpec]]:
    return {
        "chunked-shared-prefix": (
            SimConfig(),
            WorkloadSpec(
                n,
                rate=30.0,
                input_len="1024",
                output_len="256",
                shared_prefix_fraction=0.5,
                num_prefix_groups=4,
                seed=1,
            ),
        ),
        "prefill-first": (
            SimConfig(scheduler=SchedulerConfig(policy="prefill-first")),
            WorkloadSpec(n, rate=20.0, input_len="512-2048", output_len="lognormal:200,0.6", seed=2),
        ),
        "disaggregated-2:1": (
            SimConfig(disagg=(2, 1), router="least-outstanding"),
            WorkloadSpec(n, rate=25.0, input_len="1024", output_len="256", shared_prefix_fraction=0.25, seed=3),
        ),
        "preempting": (
            SimConfig(scheduler=SchedulerConfig(num_blocks=1200, max_num_batched_tokens=1024)),
            WorkloadSpec(n, rate=None, concurrency=None, input_len="lognormal:700,0.5", output_len="64-600", seed=4),
        ),
        "closed-loop-2-replicas": (
            SimConfig(replicas=2, router="least-kv", scheduler=SchedulerConfig(block_size=32)),
            WorkloadSpec(n, concurrency=96, input_len="uniform:100,3000", output_len="1-400", seed=5),
        ),
    }


def fingerprint(config: SimConfig, workload: WorkloadSpec) -> dict[str, Any]:
    result = simulate(config, workload)
    digest = hashlib.sha256()
    for r in sorted(result.records, key=lambda r: int(r.request_id)):
        d = r.to_dict()
        times = d.pop("token_times_s")
        digest.update(json.dumps(d, sort_keys=True).encode())
        digest.update(struct.pack(f"{len(times)}d", *times))
    trace = result.trace
    for name in ("replica", "start_s", "duration_s", "num_seqs", "num_decode", "num_tokens", "kv_usage"):
        digest.update(getattr(trace, name).tobytes())
    digest.update(json.dumps(result.replica_stats, sort_keys=True).encode())
    s = result.summary
    summary = s.to_dict()
    return {
        "steps": result.num_steps,
        "completed": s.completed,
        "preemptions": sum(r["preemptions"] for r in result.replica_stats),
        "ttft_ms": [round(getattr(s.ttft_s, p) * 1e3, 6) for p in ("mean", "p50", "p90", "p99")],
        "tpot_ms": [round(getattr(s.tpot_s, p) * 1e3, 6) for p in ("mean", "p50", "p90", "p99")],
        "itl_ms": [round(getattr(s.itl_s, p) * 1e3, 6) for p in ("mean", "p50", "p90", "p99")],
        "summary_sha": hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "records_trace_sha": digest.hexdigest()[:16],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--quick", action="store_true", help="60 requests a configuration (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests = 60
    for name, (config, workload) in configs(args.num_requests).items():
        print(name, json.dumps(fingerprint(config, workload)))


if __name__ == "__main__":
    main()
