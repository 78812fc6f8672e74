"""Opening the bundled SmolLM2-135M GGUF (98 MB): servelab's one reader (spec/gguf_reader.py:
header, metadata and tensor index, no tensor data) against the gguf package's GGUFReader (what
`ModelSpec.from_gguf` used before), and the time from the path to a ModelSpec with each. The
readers run in turn each round, in one process.

    .venv/bin/python benchmarks/gguf_open.py --rounds 7

Prints the median of each and the ratio GGUFReader / servelab (above 1: servelab faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from gguf import GGUFReader

from servelab.engine.bundled import bundled_model_path
from servelab.spec.gguf_reader import read_gguf
from servelab.spec.model import ModelSpec


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    path = bundled_model_path()
    runs: dict[str, list[float]] = {"servelab read_gguf": [], "gguf GGUFReader": [], "ModelSpec.from_gguf": []}
    for _ in range(args.rounds):
        runs["servelab read_gguf"].append(timed(lambda: read_gguf(path)))
        runs["gguf GGUFReader"].append(timed(lambda: GGUFReader(str(path), "r")))
        runs["ModelSpec.from_gguf"].append(timed(lambda: ModelSpec.from_gguf(path)))
    print(f"{path.name}: {path.stat().st_size / 1e6:.1f} MB, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    medians = {name: statistics.median(times) for name, times in runs.items()}
    for name, median in medians.items():
        print(f"  {name:22s} median {median * 1e3:8.1f} ms  (min {min(runs[name]) * 1e3:.1f} ms)")
    print(f"  GGUFReader / read_gguf: {medians['gguf GGUFReader'] / medians['servelab read_gguf']:.1f}x")


if __name__ == "__main__":
    main()
