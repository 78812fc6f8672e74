"""`servelab calibrate`: time the real engine on a grid of step shapes, fit a step-cost model, and
write a profile that `sim`, `plan` and `roofline` read with `--profile`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from servelab.commands._engine_cli import add_engine_arguments, engine_args_from, set_threads
from servelab.errors import InvalidArgument

# A fit that misses its held-out steps by more than this (median) would mislead sim and plan.
DEFAULT_MAX_HELDOUT_ERROR_PCT = 20.0

HELP = "time the engine on a grid of step shapes and write a step-cost profile for sim/plan/roofline"


@dataclass(frozen=True, slots=True)
class Grid:
    chunk: int  # the scheduler's token budget: prompts longer than it prefill in chunks of it
    prefill_lens: tuple[int, ...]  # fresh prompts (one step each when <= chunk, else chunked)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int  # decode steps timed per (batch, context)
    repeats: int  # interleaved passes over every scenario; a step's time is the fastest of them


GRIDS = {
    # Decode scenarios prefill their batch first, which dominates the time: contexts stay short.
    "coarse": Grid(chunk=128, prefill_lens=(16, 64, 128, 256), decode_batches=(1, 4, 8),
                   decode_contexts=(32, 64), decode_steps=3, repeats=5),
    "full": Grid(chunk=512, prefill_lens=(16, 32, 64, 128, 256, 512, 2048), decode_batches=(1, 2, 4, 8, 16, 32),
                 decode_contexts=(64, 256, 1024, 2048), decode_steps=6, repeats=5),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where to write the profile")
    parser.add_argument("--grid", choices=list(GRIDS), default="coarse",
                        help="coarse: about 30 s on the bundled model; full: minutes (default coarse)")
    parser.add_argument("--max-heldout-error", type=float, default=DEFAULT_MAX_HELDOUT_ERROR_PCT, metavar="PCT",
                        help="refuse to write a profile whose median error on held-out steps is above PCT %% "
                             f"(default {DEFAULT_MAX_HELDOUT_ERROR_PCT:g})")
    parser.add_argument("--hardware-out", default=None, metavar="FILE.json|FILE.yaml",
                        help="also measure this host (memory, read bandwidth, matmul rates) and write it as a "
                             "hardware file for --hardware (YAML when FILE ends in .yaml or .yml)")


def _timed(engine: Any, log: list[tuple[tuple[int, int, int, int], float]]) -> None:
    """Wraps the executor so that every step's shape sums and wall time are logged."""
    from servelab.cost.roofline import Roofline

    execute = engine.executor.execute

    def timed_execute(plan):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        result = execute(plan)
        elapsed = time.perf_counter() - t0
        if not plan.is_empty:
            log.append((Roofline.totals(plan.shape()), elapsed))
        return result

    engine.executor.execute = timed_execute


def _scenario(engine: Any, prompts: list[tuple[int, int]], late: list[tuple[int, int]], rng: random.Random) -> None:
    """Runs (prompt length, output tokens) requests to the end; `late` ones join after 2 steps
    (mixed prefill + decode steps)."""
    from servelab.core.sequence import SamplingParams

    def add(n: int, out: int) -> None:
        ids = [rng.randrange(engine.vocab_size) for _ in range(n)]
        engine.add_request(f"cal-{rng.getrandbits(48):x}", ids, SamplingParams(max_tokens=out, ignore_eos=True,
                                                                                temperature=0.0))

    for n, out in prompts:
        add(n, out)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 2:
            for n, out in late:
                add(n, out)


def scenarios(grid: Grid, max_len: int) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    out: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
    out += [([(n, 1)], []) for n in grid.prefill_lens if n + 1 <= max_len]
    for c in grid.decode_contexts:
        if c + grid.decode_steps + 1 > max_len:
            continue
        out += [([(c, grid.decode_steps + 1)] * b, []) for b in grid.decode_batches]
        # mixed: a decode batch that a fresh prompt joins
        out.append(([(c, grid.decode_steps + 3)] * max(grid.decode_batches), [(min(grid.chunk, c), 1)]))
    return out


def measure(engine: Any, grid: Grid, seed: int = 0) -> list[dict[str, Any]]:
    """Every step of every scenario, timed in `grid.repeats` passes after one warm-up run. Each
    pass runs every scenario once, in a new shuffled order, so a slow spell on the host lands on
    different shapes in different passes instead of on all the repeats of a few; each step's time
    is then the fastest of its passes (cost/calibration_stats.py says why)."""
    from servelab.cost.calibration_stats import aggregate

    log: list[tuple[tuple[int, int, int, int], float]] = []
    _timed(engine, log)
    rng = random.Random(seed)
    plan = scenarios(grid, engine.max_model_len)
    if not plan:
        raise InvalidArgument(f"no calibration shape fits max_model_len={engine.max_model_len}")
    _scenario(engine, *plan[0], rng)  # warm-up: first-touch of the KV pool, kernel builds
    runs: list[list[list[tuple[tuple[int, int, int, int], float]]]] = [[] for _ in plan]
    order = list(range(len(plan)))
    for _ in range(grid.repeats):
        rng.shuffle(order)
        for i in order:
            log.clear()
            _scenario(engine, *plan[i], rng)
            runs[i].append(list(log))
    measurements: list[dict[str, Any]] = []
    for scenario_runs in runs:
        for steps in zip(*scenario_runs):
            if len({s for s, _ in steps}) != 1:  # a pass scheduled differently: not one shape
                continue
            tokens, seqs, ctx, pairs = steps[0][0]
            measurements.append({"num_tokens": tokens, "num_seqs": seqs, "context_tokens": ctx, "pairs": pairs,
                                 "samples_s": [t for _, t in steps]})
    return aggregate(measurements)


def host_info() -> dict[str, Any]:
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu == (platform.processor() or platform.machine()):
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value
    except OSError:
        pass
    wanted = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "f16c", "fma", "neon", "asimd")
    import torch

    return {"cpu": cpu, "flags": [f for f in wanted if f in flags.split()], "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def build_profile(engine: Any, args: argparse.Namespace, grid_name: str, measurements: list[dict[str, Any]],
                  wall_s: float, noise: dict[str, Any]) -> dict[str, Any]:
    from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION, fit

    model = getattr(engine.executor, "model", None)
    spec = engine.model_spec
    kv = getattr(getattr(engine.executor, "kv_cache", None), "dtype", None)
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_info(),
        "device": args.device,
        "model": spec.name if spec is not None else engine.model_name,
        "model_path": args.model,
        "num_layers": None if spec is None else spec.num_layers,
        "dtype": str(getattr(model, "dtype", args.dtype)).removeprefix("torch."),
        "quantization": args.quantization,
        "kv_cache_dtype": str(kv).removeprefix("torch."),
        "engine_flags": {k: getattr(args, k) for k in ("model", "dtype", "device", "max_model_len", "threads",
                                                        "quantization", "kv_cache_dtype", "deterministic")},
        "grid": grid_name,
        "calibration_wall_s": wall_s,
        "passes": GRIDS[grid_name].repeats,
        "step_time_statistic": "fastest of the interleaved passes",
        "host_noise": noise,
        "fit": fit(measurements),
        "measurements": measurements,
    }


def run(args: argparse.Namespace) -> int:
    from servelab.commands._outputs import check_output_file
    from servelab.cost.calibration_stats import host_noise
    from servelab.engine.host_probe import OtherLoadMeter
    from servelab.engine.llm_engine import LLMEngine

    check_output_file(args.out, "--out")
    check_output_file(args.hardware_out, "--hardware-out")
    if not args.max_heldout_error > 0:
        raise InvalidArgument(f"--max-heldout-error must be > 0 (a %), got {args.max_heldout_error:g}")
    grid = GRIDS[args.grid]
    # the same shapes every repeat: no prefix cache, the grid's budget
    engine_args = engine_args_from(args, max_num_batched_tokens=grid.chunk, enable_prefix_caching=False)
    # as `serve` runs: the KV pool claimed up front, so no step pays first-touch page faults
    engine_args = replace(engine_args, kv_cache_prefault=True)
    set_threads(args)
    engine = LLMEngine.from_args(engine_args)
    try:
        t0 = time.perf_counter()
        meter = OtherLoadMeter()
        measurements = measure(engine, grid)
        noise = host_noise([m["samples_s"] for m in measurements], other_cpus=meter.other_cpus(),
                           cpus=os.cpu_count(), load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
        profile = build_profile(engine, args, args.grid, measurements, time.perf_counter() - t0, noise.to_dict())
    finally:
        engine.close()
    f_ = profile["fit"]
    print(f"{profile['model']} ({profile['dtype']}, KV {profile['kv_cache_dtype']}) on {profile['host']['cpu']}: "
          f"{len(measurements)} step shapes, fastest of {grid.repeats} interleaved passes, "
          f"in {profile['calibration_wall_s']:.1f} s")
    print(noise.describe())
    for name, value in f_["coefficients"].items():
        print(f"  {name:<20} {value * 1e6:12.4f} µs   ({f_['units'][name]})")
    h = f_["heldout"]
    print(f"held-out error ({h['count']} steps, every {f_['holdout_every']}th): median {h['median_abs_pct']:.1f}%, "
          f"max {h['max_abs_pct']:.1f}%; {len(f_['outliers_dropped'])} training step(s) dropped as outliers")
    if noise.noisy:
        print(f"servelab calibrate: warning: the host was noisy ({noise.describe()}); step times include other "
              f"processes' interference, so expect them to differ from a run on a quiet host", file=sys.stderr)
    if h["median_abs_pct"] > args.max_heldout_error:
        print(f"servelab calibrate: error: the fit's median error on {h['count']} held-out steps is "
              f"{h['median_abs_pct']:.1f}%, above --max-heldout-error {args.max_heldout_error:g}%: not writing "
              f"{args.out}. {noise.describe()}. Rerun on a quieter host, or with more passes (--grid full), or raise "
              f"--max-heldout-error to accept it", file=sys.stderr)
        return 1
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {args.out}")
    if args.hardware_out:
        write_hardware_file(args.hardware_out, profile["host"])
    return 0


def write_hardware_file(path: str, host: dict[str, Any]) -> None:
    """This host as a hardware file, checked by the same parser that reads --hardware files."""
    import re

    from servelab.engine.host_probe import probe_hardware
    from servelab.spec.hardware_file import YAML_SUFFIXES, parse_hardware

    name = "host-" + (re.sub(r"[^a-z0-9]+", "-", host["cpu"].lower()).strip("-") or "cpu")
    data = probe_hardware(name, f"measured by servelab calibrate on {time.strftime('%Y-%m-%d')} with "
                                f"{host['torch_threads']} threads: a streaming read and the best torch matmul (achieved "
                                f"rates, not datasheet peaks)")
    spec = parse_hardware(data, source=path, default_name=name)
    with open(path, "w", encoding="utf-8") as f:
        if path.lower().endswith(YAML_SUFFIXES):
            import yaml

            yaml.safe_dump(data, f, sort_keys=False)
        else:
            json.dump(data, f, indent=1)
    print(f"{spec.name}: {spec.memory_bytes / 1e9:.1f} GB, read bandwidth {spec.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
          f"matmul fp32 {spec.peak_flops['fp32'] / 1e9:.0f} GFLOP/s, bf16 {spec.peak_flops['bf16'] / 1e9:.0f} GFLOP/s")
    print(f"wrote {path} (use it with --hardware {path})")
