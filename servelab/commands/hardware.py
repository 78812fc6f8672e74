"""`servelab hardware`: the accelerator catalog (dense peaks; sources in servelab/spec/hardware.py)."""

from __future__ import annotations

import argparse
import json

HELP = "list the accelerator catalog"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from servelab.commands._table import render_table
    from servelab.spec.hardware import HARDWARE

    if args.json:
        print(json.dumps([{**asdict(h), "ridge_flops_per_byte_bf16": h.ridge_flops_per_byte("bf16")}
                          for h in HARDWARE.values()], indent=2))
        return 0

    def tflops(value: float | None) -> str:
        return f"{value / 1e12:,.0f}" if value else "-"

    headers = ["hardware", "memory GB", "bandwidth TB/s", "bf16 TFLOPS", "fp8 TFLOPS", "int8 TOPS",
               "link GB/s", "ridge bf16", "$/hour", "description"]
    body = [
        [h.name, f"{h.memory_bytes / 1e9:.0f}", f"{h.bandwidth_bytes_per_s / 1e12:.4g}", tflops(h.peak_flops.get("bf16")),
         tflops(h.peak_flops.get("fp8")), tflops(h.peak_flops.get("int8")), f"{h.interconnect_bytes_per_s / 1e9:.0f}",
         f"{h.ridge_flops_per_byte('bf16'):.0f}", f"{h.price_per_hour_usd:.2f}" if h.price_per_hour_usd else "-",
         h.description]
        for h in HARDWARE.values()
    ]
    print(render_table(headers, body, left=(0, 9)))
    print("dense peaks (no 2:4 sparsity); link = one direction of NVLink / Infinity Fabric / PCIe; "
          "$/hour is a rough cloud price guess")
    return 0
