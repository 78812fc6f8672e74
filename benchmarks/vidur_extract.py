"""Extract Vidur's published per-operator GPU profiles into benchmarks/data/vidur_profiles.json.

Vidur (github.com/microsoft/vidur, MIT licence, Copyright (c) Microsoft Corporation) publishes
operator timings measured on A100 and H100: the linear layers of several models by tokens in the
step and tensor-parallel degree, attention prefill and decode, all-reduce and send/recv by message
size per topology, and the host's per-step overheads. This script reads them from a git clone of
that repository and keeps a subsample (the medians only, at roughly geometric token counts and
message sizes), each table with the repository, commit and path it came from.

    git clone https://github.com/microsoft/vidur /tmp/vidur
    python benchmarks/vidur_extract.py /tmp/vidur            # writes benchmarks/data/vidur_profiles.json

Times are in seconds (Vidur's CSVs hold milliseconds). benchmarks/gpu_kernels_fit.py fits the
cost model's GEMM efficiencies to the linear-layer tables.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
from pathlib import Path

REPO = "microsoft/vidur"
OUT = Path(__file__).parent / "data" / "vidur_profiles.json"
# The newest commit holds the per-model linear and network tables; attention and the host
# overheads survive only in these earlier commits (later versions of the attention tables are
# larger than the mirror keeps).
ATTENTION_AT = ("e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a", "data/profiling/a100/attention.csv")
CPU_OVERHEADS_AT = ("6d98aa8f71696520acc603d87439e77cc78160a7", "data/profiling/a100/cpu_overheads.csv")
TOKENS = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
MS = 1e-3


def git_show(clone: Path, commit: str, path: str) -> list[dict[str, str]]:
    done = subprocess.run(["git", "-C", str(clone), "show", f"{commit}:{path}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{clone} has no {path} at {commit} (a clone of {REPO}?): {done.stderr.strip()}")
    return list(csv.DictReader(io.StringIO(done.stdout)))


def linear_shapes(row: dict[str, str]) -> dict[str, tuple[int, int]]:
    """(N, K) per device of each linear layer, from the profiled model's dimensions."""
    heads, kv_heads, hidden = int(row["n_head"]), int(row["n_kv_head"]), int(row["n_embd"])
    ffn, tp = int(row["n_expanded_embd"]), int(row["num_tensor_parallel_workers"])
    head_dim = hidden // heads
    up = ffn * (2 if row["use_gated_mlp"] == "True" else 1)
    return {
        "attn_pre_proj": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "attn_post_proj": (hidden, heads * head_dim // tp),
        "mlp_up_proj": (up // tp, hidden),
        "mlp_down_proj": (hidden, ffn // tp),
    }


def linear_tables(clone: Path, commit: str) -> list[dict[str, object]]:
    listing = subprocess.run(
        ["git", "-C", str(clone), "ls-tree", "-r", "--name-only", commit], check=True, capture_output=True, text=True
    ).stdout.split()
    tables = []
    for path in sorted(p for p in listing if p.startswith("data/profiling/compute/") and p.endswith("/mlp.csv")):
        gpu = path.split("/")[3]
        if gpu not in ("a100", "h100"):
            continue
        rows = []
        for row in git_show(clone, commit, path):
            m = int(row["num_tokens"])
            if m not in TOKENS:
                continue
            for op, (n, k) in linear_shapes(row).items():
                rows.append(
                    [
                        op,
                        m,
                        n,
                        k,
                        int(row["num_tensor_parallel_workers"]),
                        round(float(row[f"time_stats.{op}.median"]) * MS, 9),
                    ]
                )
        tables.append(
            {
                "gpu": gpu,
                "model": path.split("/", 4)[4].rsplit("/", 1)[0],
                "source": source(commit, path),
                "columns": ["op", "m", "n", "k", "tp", "time_s"],
                "rows": sorted(rows),
            }
        )
    return tables


def network_tables(clone: Path, commit: str) -> list[dict[str, object]]:
    tables = []
    for topology in ("a100_pairwise_nvlink", "a100_dgx", "h100_pairwise_nvlink", "h100_dgx"):
        for op in ("all_reduce", "send_recv"):
            path = f"data/profiling/network/{topology}/{op}.csv"
            rows = []
            for row in git_show(clone, commit, path):
                size = int(row["size"])
                if size & (size - 1) == 0 or size == 2048:  # powers of two: a geometric subsample
                    rows.append(
                        [
                            int(row["num_workers"]),
                            int(row["devices_per_node"]),
                            size,
                            round(float(row[f"time_stats.{op}.median"]) * MS, 9),
                        ]
                    )
            tables.append(
                {
                    "topology": topology,
                    "op": op,
                    "source": source(commit, path),
                    "columns": ["num_workers", "devices_per_node", "size_bytes", "time_s"],
                    "rows": sorted(set(map(tuple, rows))),
                }
            )
    return tables


def attention_table(clone: Path, commit: str) -> dict[str, object]:
    path = ATTENTION_AT[1]
    rows = []
    for row in git_show(clone, commit, path):
        batch, kv = int(row["batch_size"]), int(row["kv_cache_size"])
        if row["is_prefill"] == "True":
            chunk = int(row["prefill_chunk_size"])
            if chunk in TOKENS and (kv == 0 or kv in TOKENS):
                rows.append(["prefill", batch, chunk, kv, round(float(row["time_stats.attn_prefill.median"]) * MS, 9)])
        elif batch in TOKENS and kv in TOKENS:
            rows.append(["decode", batch, 1, kv, round(float(row["time_stats.attn_decode.median"]) * MS, 9)])
    first = git_show(clone, commit, path)[0]
    return {
        "gpu": "a100",
        "source": source(commit, path),
        "config": {k: int(first[k]) for k in ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers")},
        "note": "kv_tokens is the KV cache size of the step (Vidur's kv_cache_size)",
        "columns": ["phase", "batch", "query_tokens", "kv_tokens", "time_s"],
        "rows": sorted(rows),
    }


def cpu_overhead_table(clone: Path, commit: str) -> dict[str, object]:
    path = CPU_OVERHEADS_AT[1]
    stages = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")
    rows = [
        [
            row["model_name"],
            int(row["batch_size"]),
            int(row["tensor_parallel_degree"]),
            *(round(float(row[f"{s}_median"]) * MS, 9) for s in stages),
        ]
        for row in git_show(clone, commit, path)
    ]
    return {
        "gpu": "a100",
        "source": source(commit, path),
        "columns": ["model", "batch", "tp", *(f"{s}_s" for s in stages)],
        "rows": sorted(rows),
    }


def source(commit: str, path: str) -> dict[str, str]:
    return {"repo": REPO, "commit": commit, "path": path}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("clone", type=Path, help="a git clone (or bare mirror) of github.com/microsoft/vidur")
    parser.add_argument("--commit", default="HEAD", help="where the linear and network tables are read")
    parser.add_argument("--attention-commit", default=ATTENTION_AT[0], help=f"where {ATTENTION_AT[1]} is read")
    parser.add_argument(
        "--cpu-overheads-commit", default=CPU_OVERHEADS_AT[0], help=f"where {CPU_OVERHEADS_AT[1]} is read"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(args.clone), "rev-parse", args.commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    data = {
        "about": "Subsample of Vidur's published operator profiles (medians, seconds); "
        "see benchmarks/vidur_extract.py.",
        "licence": "MIT, Copyright (c) Microsoft Corporation (github.com/microsoft/vidur/blob/main/LICENSE)",
        "dtype": "float16 (Vidur profiles the models in fp16)",
        "linear": linear_tables(args.clone, commit),
        "attention": [attention_table(args.clone, args.attention_commit)],
        "network": network_tables(args.clone, commit),
        "cpu_overheads": [cpu_overhead_table(args.clone, args.cpu_overheads_commit)],
    }
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
