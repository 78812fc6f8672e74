"""`servelab hardware`: the accelerator catalog (dense peaks; sources in servelab/spec/hardware.py),
or the resolved spec of the catalog names and JSON or YAML hardware files given."""

from __future__ import annotations

import argparse
import json

HELP = "list the accelerator catalog, or show hardware files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "hardware",
        nargs="*",
        metavar="NAME_OR_FILE",
        help="catalog names or JSON or YAML hardware files to show (default: the whole catalog)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from servelab.commands._table import render_table
    from servelab.spec.hardware import HARDWARE, get_hardware
    from servelab.spec.hardware_file import shipped_files

    specs = [get_hardware(h) for h in args.hardware] if args.hardware else list(HARDWARE.values())
    if args.json:
        # The measured-kernel fits are summarised by their provenance, not dumped whole.
        print(json.dumps([{**{f.name: getattr(h, f.name) for f in fields(h) if f.name != "kernels"},
                           "ridge_flops_per_byte_bf16": h.ridge_flops_per_byte("bf16"), "provenance": h.provenance}
                          for h in specs], indent=2))  # fmt: skip
        return 0

    def tflops(value: float | None) -> str:
        if not value:
            return "-"
        return f"{value / 1e12:,.0f}" if value >= 1e12 else f"{value / 1e12:.3g}"

    headers = [
        "hardware",
        "memory GB",
        "bandwidth TB/s",
        "bf16 TFLOPS",
        "fp8 TFLOPS",
        "int8 TOPS",
        "fp32 TFLOPS",
        "link GB/s",
        "ridge bf16",
        "$/hour",
        "description",
    ]
    body = [
        [
            h.name,
            f"{h.memory_bytes / 1e9:.0f}",
            f"{h.bandwidth_bytes_per_s / 1e12:.4g}",
            tflops(h.peak_flops.get("bf16")),
            tflops(h.peak_flops.get("fp8")),
            tflops(h.peak_flops.get("int8")),
            tflops(h.peak_flops.get("fp32")),
            f"{h.interconnect_bytes_per_s / 1e9:.0f}" if h.interconnect_bytes_per_s else "-",
            f"{h.ridge_flops_per_byte('bf16'):.0f}",
            f"{h.price_per_hour_usd:.2f}" if h.price_per_hour_usd else "-",
            h.description,
        ]
        for h in specs
    ]
    print(render_table(headers, body, left=(0, 10)))
    print(
        "dense peaks (no 2:4 sparsity); fp32 '-' = TF32 tensor cores, half the bf16 rate; link = one direction "
        "of NVLink / Infinity Fabric / PCIe; $/hour is a rough cloud price guess"
    )
    if not args.hardware:
        print(
            f"--hardware also takes a JSON or YAML hardware file; shipped: {', '.join(shipped_files())} "
            "(`servelab hardware FILE` shows one)"
        )
    return 0
