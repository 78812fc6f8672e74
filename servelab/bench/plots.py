"""PNG plots of a bench run and of a capacity search (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from servelab.bench.capacity import CapacityResult
from servelab.bench.pareto import ParetoCurve
from servelab.metrics import RequestRecord


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_run_plots(records: Sequence[RequestRecord], plot_dir: str | Path, title: str = "") -> list[Path]:
    """latency_cdfs.png (TTFT, TPOT, E2E) and timeline.png (TTFT and TPOT against send time, so
    a queue building up over the run is visible)."""
    plt = _plt()
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.success]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, name in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
        values = sorted(v * 1e3 for v in (getattr(r, name) for r in ok) if v is not None)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_xlabel(name[:-2].upper() + " (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    paths.append(out / "latency_cdfs.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    sent = [r.arrival_s for r in ok]
    ax.scatter(sent, [(r.ttft_s or 0) * 1e3 for r in ok], s=6, label="TTFT (ms)")
    tpot = [(r.arrival_s, r.tpot_s * 1e3) for r in ok if r.tpot_s is not None]
    if tpot:
        ax.scatter(*zip(*tpot), s=6, label="TPOT (ms)")
    failed = [r.arrival_s for r in records if not r.success]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(title or "latency over the run")
    fig.tight_layout()
    paths.append(out / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_capacity_plot(result: CapacityResult, path: str | Path) -> Path:
    """Per-device throughput and the percentile latencies against load, passing levels filled."""
    plt = _plt()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    levels = sorted(result.levels, key=lambda lv: lv.load)
    key = f"p{result.percentile}"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for lv in levels:
        style = dict(
            color="tab:green" if lv.passed else "tab:red", marker="o", fillstyle="full" if lv.passed else "none"
        )
        ax1.plot([lv.load], [lv.summary.output_throughput_per_device], **style)
        tpot = getattr(lv.summary.tpot_s, key)
        if tpot is not None:
            ax2.plot([lv.load], [tpot * 1e3], **style)
    ax1.plot(
        [lv.load for lv in levels], [lv.summary.output_throughput_per_device for lv in levels], color="grey", lw=0.8
    )
    ax1.set_xlabel(result.mode)
    ax1.set_ylabel("output tok/s per device")
    ax2.set_xlabel(result.mode)
    ax2.set_ylabel(f"{key} TPOT (ms)")
    if result.slo.tpot_s is not None:
        ax2.axhline(result.slo.tpot_s * 1e3, color="k", ls="--", lw=0.8, label="target")
        ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(result.describe(), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_frontier_plot(
    curves: Sequence[ParetoCurve], path: str | Path, *, tpot_target_s: float | None, percentile: int, title: str = ""
) -> Path:
    """The throughput-interactivity frontier (`servelab.bench.pareto`): per accelerator, its
    Pareto-optimal levels joined, the others faint, the TPOT target a vertical line and the
    capacity read off it starred with its $/M tokens. The format follows the file's extension."""
    plt = _plt()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for curve in curves:
        if not curve.points:
            continue
        front = curve.front
        (line,) = ax.plot(
            [p.tokens_per_s_per_user for p in front],
            [p.level.tokens_per_s_per_device for p in front],
            marker="o",
            ms=4,
            lw=1.5,
            label=curve.hardware,
        )
        rest = [p for p in curve.points if not p.pareto]
        ax.scatter(
            [p.tokens_per_s_per_user for p in rest],
            [p.level.tokens_per_s_per_device for p in rest],
            color=line.get_color(),
            alpha=0.25,
            s=14,
        )
        cap = curve.capacity
        if cap is not None:
            ax.scatter([cap.tokens_per_s_per_user], [cap.level.tokens_per_s_per_device], color=line.get_color(),
                       marker="*", s=160, edgecolors="k", linewidths=0.6, zorder=5)  # fmt: skip
            cost = "" if cap.usd_per_million_tokens is None else f", ${cap.usd_per_million_tokens:.3f}/M tok"
            ax.annotate(
                f"{cap.level.tokens_per_s_per_device:,.0f} tok/s/GPU at {cap.level.concurrency} users{cost}",
                (cap.tokens_per_s_per_user, cap.level.tokens_per_s_per_device),
                xytext=(8, 4),
                textcoords="offset points",
                fontsize=8,
            )
    if tpot_target_s is not None:
        x = 1.0 / tpot_target_s
        ax.axvline(x, color="k", ls="--", lw=0.9)
        ax.annotate(f"TPOT target {tpot_target_s * 1e3:g} ms", (x, 0.98), xycoords=("data", "axes fraction"),
                    xytext=(4, 0), textcoords="offset points", fontsize=8, va="top")  # fmt: skip
    ax.set_xlabel(f"output tokens/s per user (1 / p{percentile} TPOT)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(title or "throughput per device against speed per user (line: Pareto-optimal levels)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
