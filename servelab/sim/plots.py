"""PNG plots of a simulation (matplotlib, Agg backend): step timeline, TTFT/TPOT CDFs, KV usage."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from servelab.sim.runner import SimResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(result: SimResult) -> str:
    c = result.config
    layout = f"disagg {c['disagg']}" if c.get("disagg") else f"{c['replicas']} replica(s)"
    return f"{c['model']} on {c['hardware']} (tp={c['tp']}, {layout}, {c['scheduler']})"


def plot_step_timeline(result: SimResult, path: Path) -> None:
    plt = _plt()
    t = result.trace
    start = np.frombuffer(t.start_s, dtype=np.float64)
    dur_ms = np.frombuffer(t.duration_s, dtype=np.float64) * 1e3
    decode = np.frombuffer(t.num_decode, dtype=np.int32)
    seqs = np.frombuffer(t.num_seqs, dtype=np.int32)
    prefill = decode < seqs  # a step that carries any prefill chunk
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.scatter(start[~prefill], dur_ms[~prefill], s=3, label="decode-only step", color="tab:blue")
    ax.scatter(start[prefill], dur_ms[prefill], s=3, label="step with prefill", color="tab:red")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("step duration (ms)")
    ax.set_title("Step durations: " + _title(result), fontsize=9)
    ax.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdfs(result: SimResult, path: Path) -> None:
    plt = _plt()
    ok = [r for r in result.records if r.success]
    ttft = np.sort([r.ttft_s for r in ok if r.ttft_s is not None]) * 1e3
    tpot = np.sort([r.tpot_s for r in ok if r.tpot_s is not None]) * 1e3
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    slo = result.summary.slo
    for ax, values, name, target in (
        (axes[0], ttft, "TTFT", None if slo is None else slo.ttft_s),
        (axes[1], tpot, "TPOT", None if slo is None else slo.tpot_s),
    ):
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        if target is not None:
            ax.axvline(target * 1e3, color="tab:red", linestyle="--", label=f"SLO {target * 1e3:g} ms")
            ax.legend()
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF", fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_usage(result: SimResult, path: Path) -> None:
    plt = _plt()
    t = result.trace
    replica = np.frombuffer(t.replica, dtype=np.int32)
    start = np.frombuffer(t.start_s, dtype=np.float64)
    usage = np.frombuffer(t.kv_usage, dtype=np.float64) * 100
    fig, ax = plt.subplots(figsize=(10, 4))
    for stats in result.replica_stats:
        mask = replica == stats["replica"]
        ax.plot(start[mask], usage[mask], linewidth=0.8, label=f"replica {stats['replica']} ({stats['role']})")
    ax.set_ylim(0, 105)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_title("KV cache usage: " + _title(result), fontsize=9)
    if len(result.replica_stats) <= 8:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: SimResult, plot_dir: str | Path) -> list[Path]:
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "step_timeline.png", out / "latency_cdf.png", out / "kv_usage.png"]
    plot_step_timeline(result, paths[0])
    plot_latency_cdfs(result, paths[1])
    plot_kv_usage(result, paths[2])
    return paths
