"""This host's limits, the denominators of "a fraction of what the machine can do": streaming read
bandwidth and the peak fp32 / bf16 / int8 matmul rates torch reaches here.

    python benchmarks/host_limits.py [--threads N] [--json]

Each rate is the best this host reaches: the fastest of torch.mm, a linear layer and (fp32)
servelab's own panel GEMM for fp32 and bf16, of torch._int_mm and fbgemm's dynamic int8 linear for
int8. On a core without native bf16 that is an emulation, and the figure says so by being low. A
rate no kernel here has is reported as missing, not guessed. These are what the software here
reaches, not the silicon's datasheet peak: a better kernel can beat them (a fraction over 100%
says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

from servelab.runtime import host_probe

# The compute dtypes an engine's arithmetic is priced at (keys of HostLimits.peak_ops_per_s).
COMPUTE_DTYPES = ("fp32", "bf16", "int8")


@dataclass(frozen=True, slots=True)
class HostLimits:
    read_bandwidth_bytes_per_s: float
    peak_ops_per_s: dict[str, float | None]  # FLOP/s (int8: OP/s); None where torch has no kernel
    threads: int

    def bandwidth_fraction(self, bytes_per_s: float) -> float:
        return bytes_per_s / self.read_bandwidth_bytes_per_s

    def compute_fraction(self, ops_per_s: float, dtype: str) -> float | None:
        peak = self.peak_ops_per_s.get(dtype)
        return None if not peak else ops_per_s / peak


def _best_of(*rates: float | None) -> float | None:
    return max((r for r in rates if r is not None), default=None)


def measure_host_limits() -> HostLimits:
    return HostLimits(
        read_bandwidth_bytes_per_s=host_probe.read_bandwidth_bytes_per_s(),
        peak_ops_per_s={
            "fp32": host_probe.peak_float_flops_per_s(torch.float32),
            "bf16": host_probe.peak_float_flops_per_s(torch.bfloat16),
            "int8": _best_of(
                host_probe.peak_rate(lambda n: host_probe.int_mm_ops_per_s(n, repeats=3)),
                host_probe.peak_rate(lambda n: host_probe.fbgemm_int8_ops_per_s(n, repeats=3)),
            ),
        },
        threads=torch.get_num_threads(),
    )


def describe(limits: HostLimits) -> list[str]:
    lines = [f"read bandwidth (streaming sum of 1 GiB): {limits.read_bandwidth_bytes_per_s / 1e9:.1f} GB/s"]
    for dtype in COMPUTE_DTYPES:
        peak = limits.peak_ops_per_s.get(dtype)
        unit = "GOP/s" if dtype == "int8" else "GFLOP/s"
        lines.append(f"peak {dtype} matmul: " + (f"{peak / 1e9:.1f} {unit}" if peak else "no CPU kernel in this torch"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    limits = measure_host_limits()
    print(f"{limits.threads} threads")
    print("\n".join(describe(limits)))
    if args.json:
        print(json.dumps(asdict(limits)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
