"""The native kernels at each ISA level this CPU has, interleaved in one process: the bundled
SmolLM2-135M's 120 layer matrices as packed GGUF blocks (the in-register kernel up to 4 rows,
the panel kernel above), as int8 codes, as bf16 weights under fp32 sums (csrc/half_linear.c: the
GEMV up to 16 rows, the widened-panel GEMM above), in bf16 arithmetic (`bf16dot`,
csrc/bf16_linear.c: vdpbf16ps at avx512_bf16, split FMAs below), and its prefill attention (9 query heads over 3 KV heads,
head_dim 64) for a whole prompt of each --prompts length, once per layer. Optionally another
source tree's kernels at the same levels (`--base TREE`: its servelab/runtime/csrc, or an older
tree's servelab/engine/csrc, built with this tree's flags), for before/after.

    python benchmarks/isa_levels.py [--levels avx2 avx512_vnni] [--base /tmp/old-tree] [--threads 1]
                                    [--kinds gguf int8 bf16 bf16dot attn] [--quick]

Prints the median time over all 120 matrices (or 30 layers) per (kernel, rows) and each build
against the first. `--quick`: the first 2 layers, rows 1 and 16, a 64-token prompt, one round.
On a CPU without AVX-512 only portable and avx2 run; the AVX-512 levels are unmeasured until a
host with them runs this.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

from servelab.runtime import native
from servelab.engine.bundled import bundled_model_path
from servelab.runtime.linear import HalfLinear
from servelab.runtime.loader import load_model
from servelab.runtime.quantization import Bf16Linear, Int8Linear


# An entry point an older tree lacks -> the one its linears called instead.
_OLDER_ENTRY = {"servelab_block_quant_gemm_kmajor_f32": "servelab_block_quant_gemm_f32"}


class _OlderLibrary(ctypes.CDLL):
    """An older tree's library: a missing entry point is _OLDER_ENTRY's stand-in, else a function
    that says so when called."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _OLDER_ENTRY:
                return super().__getattr__(_OLDER_ENTRY[name])

            def missing(*_args):
                raise NotImplementedError(f"{name} is not in this tree")

            return missing


def build_from(tree: Path, level: str) -> native.NativeKernels:
    """`tree`'s kernels at `level`, through native's own build (and cache). A source file the
    tree lacks (an older tree, before a kernel existed) comes from this tree, so that it builds;
    an entry point it lacks is _OLDER_ENTRY's stand-in."""
    with tempfile.TemporaryDirectory() as tmp:
        their_csrc = next((d for d in (tree / "servelab" / "runtime" / "csrc", tree / "servelab" / "engine" / "csrc")
                           if d.is_dir()), tree / "servelab" / "runtime" / "csrc")  # fmt: skip
        for own in resources.files("servelab.runtime").joinpath("csrc").iterdir():
            theirs = their_csrc / own.name
            (Path(tmp) / own.name).write_bytes((theirs if theirs.exists() else own).read_bytes())
        return native.build(level, csrc=Path(tmp), cdll=_OlderLibrary)


def keep_freed_pages() -> None:
    """Each call returns a fresh output (1-6 MB at 512 rows); by default glibc maps such blocks
    anew and unmaps them when freed, so every call would pay page faults (most of a 512-row call's
    system time) that the engine, reusing its buffers, never does. Keep them in the heap instead."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: measure as is
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", default=None, help="default: avx2 and up, those this CPU has")
    parser.add_argument("--base", type=Path, default=None, help="another tree to build at the same levels")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512], help="prefill attention: prompt lengths")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["gguf", "int8", "bf16", "bf16dot", "attn"],
        choices=["gguf", "int8", "bf16", "bf16dot", "attn"],
    )
    parser.add_argument("--quick", action="store_true", help="2 layers, rows 1 and 16, a 64-token prompt, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.prompts, args.rounds = [1, 16], [64], 1
    torch.set_num_threads(args.threads)
    keep_freed_pages()
    levels = args.levels or [lv.name for lv in native.ISA_LEVELS[1:] if native.unavailable_reason(lv.name) is None]
    builds: dict[str, native.NativeKernels] = {}
    for level in levels:
        if args.base is not None:
            builds[f"base-{level}"] = build_from(args.base, level)
        kernels = native.native_kernels(level)
        if kernels is None:
            parser.error(f"level {level}: {native.kernels_unavailable(level)}")
        builds[level] = kernels
    first = next(iter(builds))

    model = load_model(bundled_model_path(), dtype=torch.float32).model
    model_layers = model.layers[:2] if args.quick else model.layers
    packed = [w for layer in model_layers for w in layer.linears()]
    int8 = [Int8Linear.from_weight(w.dequantize(), None) for w in packed]
    bf16 = [HalfLinear(w.dequantize().to(torch.bfloat16), None, kernels=builds[first]) for w in packed]
    bf16dot = [Bf16Linear.from_weight(w.dequantize(), None) for w in packed]
    # (kind, rows) -> one round's work per build: a function of no arguments
    cases: dict[tuple[str, int], dict[str, object]] = {}
    for kind, linears in (("gguf", packed), ("int8", int8), ("bf16", bf16), ("bf16dot", bf16dot)):
        if kind not in args.kinds:
            continue
        for rows in args.rows:
            x = {n: torch.randn(rows, n) for n in {w.shape[1] for w in linears}}
            for name, k in builds.items():
                mine = [replace(w, kernels=k) for w in linears]
                cases.setdefault((kind, rows), {})[name] = lambda mine=mine, x=x: [w(x[w.shape[1]]) for w in mine]
    layers, (heads, kv_heads, dim) = len(model_layers), (9, 3, 64)
    for n in args.prompts if "attn" in args.kinds else []:
        q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        for name, kn in builds.items():
            cases.setdefault(("attn", n), {})[name] = lambda kn=kn, q=q, k=k, v=v: [
                native.prefill_attention(kn, q, k, v, 0, dim**-0.5) for _ in range(layers)
            ]
    times: dict[tuple[str, int, str], list[float]] = {}
    for (kind, rows), per_build in cases.items():
        for r in range(args.rounds):
            order = list(per_build) if r % 2 == 0 else list(reversed(per_build))  # alternate who goes first
            for name in order:
                start = time.perf_counter()
                per_build[name]()
                times.setdefault((kind, rows, name), []).append(time.perf_counter() - start)
    print(
        f"{args.threads} thread(s), {args.rounds} rounds, median ms over {len(packed)} matrices "
        f"(attn: {layers} layers, prompt of n tokens); vs {first}"
    )
    for kind, rows in cases:
        cells = []
        for name in builds:
            ms = statistics.median(times[(kind, rows, name)]) * 1e3
            ratio = ms / (statistics.median(times[(kind, rows, first)]) * 1e3)
            cells.append(f"{name} {ms:7.2f} ({ratio:.3f})")
        print(f"{kind} {'n' if kind == 'attn' else 'rows'} {rows:3d}: " + "  ".join(cells))
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
