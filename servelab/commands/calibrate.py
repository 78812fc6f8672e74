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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from servelab.commands._engine_cli import add_engine_arguments, engine_args_from, set_threads
from servelab.cost.calibration_stats import DEFAULT_STATISTIC, NOISY_OTHER_CPUS, STATISTICS
from servelab.engine.speculative import DEFAULT_PREDICTION_TOKENS
from servelab.errors import InvalidArgument
from servelab.units import parse_duration_s
from servelab.workload.arrivals import describe_think_time, parse_think_time

# A fit that misses its held-out steps by more than this (median) would mislead sim and plan.
DEFAULT_MAX_HELDOUT_ERROR_PCT = 20.0

# --base-url's bearer token when --api-key is not given (the lab's background calibrate sets it).
API_KEY_ENV = "SERVELAB_API_KEY"

QUIET_WINDOW_S = 1.0  # --quiet-wait samples the host's other load over windows this long

# --server-term's closed-loop runs: (concurrency, measured requests), and their lengths. The server
# logs every step it runs (serve --step-log); the term is fitted from those steps, so the runs span
# the sequence counts a step can hold, and the runs themselves, replayed with the term, check it.
SERVER_RUNS = ((1, 8), (4, 24), (8, 32), (16, 48))
SERVER_INPUT_LEN, SERVER_OUTPUT_LEN = 64, 32
# Each client pauses between requests, a seeded exponential draw the check's replay takes too: its
# clients then drift apart as the server's do, rather than staying in lockstep (docs/fidelity.md,
# "Closed loops: the client's round trip" and "The serving term").
SERVER_THINK_TIME = "exp:50ms"
SERVER_START_TIMEOUT_S = 300.0

HELP = "time the engine on a grid of step shapes and write a step-cost profile for sim/plan/roofline"


@dataclass(frozen=True, slots=True)
class Grid:
    chunk: int  # the scheduler's token budget: prompts longer than it prefill in chunks of it
    prefill_lens: tuple[int, ...]  # fresh prompts (one step each when <= chunk, else chunked)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int  # decode steps timed per (batch, context)
    repeats: int  # interleaved passes over every scenario; a step's time is a statistic of them
    # At the serving budget (`serve`'s max_num_batched_tokens): k prompts of `chunk` tokens in one
    # step for each k here (up to budget / chunk), and decode batches of these sizes joined by a
    # whole `chunk`-token prompt: the steps a served closed loop or a rate run makes.
    together: tuple[int, ...] = ()
    joined_batches: tuple[int, ...] = ()
    # Verification steps (speculative decoding) at each (batch, context) here: every sequence
    # carries its own greedy output as a `prediction`, so each step after the prefill (one step,
    # not timed) runs K + 1 rows per sequence over the same KV. Beside the decodes, whose rows
    # each read their own context, they separate the KV read (per context token) from the
    # attention arithmetic (per pair).
    verify_batches: tuple[int, ...] = ()
    verify_contexts: tuple[int, ...] = ()


GRIDS = {
    # Decode scenarios prefill their batch first, which dominates the time: contexts stay short.
    # coarse reaches batch 16 and 160-token contexts so that batch and context separate in the fit.
    "coarse": Grid(
        chunk=128,
        prefill_lens=(16, 64, 128, 256),
        decode_batches=(1, 4, 8, 16),
        decode_contexts=(32, 160),
        decode_steps=3,
        repeats=5,
        together=(2, 4, 8, 16),
        joined_batches=(1, 3),
        verify_batches=(1, 4, 16),
        verify_contexts=(160, 512),
    ),
    "full": Grid(
        chunk=512,
        prefill_lens=(16, 32, 64, 128, 256, 512, 2048),
        decode_batches=(1, 2, 4, 8, 16, 32),
        decode_contexts=(64, 256, 1024, 2048),
        decode_steps=6,
        repeats=5,
        together=(2, 4),
        joined_batches=(1, 3, 15),
        verify_batches=(1, 4, 16),
        verify_contexts=(256, 1024),
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, decoding=False)
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where to write the profile")
    parser.add_argument(
        "--grid",
        choices=list(GRIDS),
        default="coarse",
        help="coarse: about 4 min on the bundled model on an idle 2-core host; full: longer (default coarse)",
    )
    parser.add_argument(
        "--max-heldout-error",
        type=float,
        default=DEFAULT_MAX_HELDOUT_ERROR_PCT,
        metavar="PCT",
        help="refuse to write a profile whose median error on held-out steps is above PCT %% "
        f"(default {DEFAULT_MAX_HELDOUT_ERROR_PCT:g})",
    )
    parser.add_argument(
        "--quiet-wait",
        default="0s",
        metavar="DURATION",
        help="before each pass, wait up to this long (e.g. 60s) for other processes to leave the "
        f"CPUs (under {NOISY_OTHER_CPUS:g} of a CPU busy over {QUIET_WINDOW_S:g} s) (default 0s: "
        "do not wait)",
    )
    parser.add_argument(
        "--step-time-statistic",
        choices=list(STATISTICS),
        default=DEFAULT_STATISTIC,
        help="a step's time from its interleaved passes: fastest (what an idle host would run) or "
        f"median (what a live server typically sees) (default {DEFAULT_STATISTIC}; "
        'docs/fidelity.md, "Repeatable calibration")',
    )
    parser.add_argument(
        "--server-term",
        action="store_true",
        help="also measure the serving term: start `servelab serve --step-log` with these engine "
        f"flags, run closed loops at concurrency {', '.join(str(c) for c, _ in SERVER_RUNS)} "
        f"(clients pausing {describe_think_time(*parse_think_time(SERVER_THINK_TIME))} between "
        "requests), and fit the time the server's work (HTTP, detokenize, SSE) adds to each step "
        "it ran beyond the profile's price, per step and per sequence; about a minute",
    )
    parser.add_argument(
        "--sim-model",
        default=None,
        metavar="NAME",
        help="--server-term: catalog model the serving term's simulator runs (default: the one the "
        "model's name matches; name one for a model outside the catalog)",
    )
    parser.add_argument(
        "--hardware-out",
        default=None,
        metavar="FILE.json|FILE.yaml",
        help="also measure this host (memory, read bandwidth, matmul rates) and write it as a "
        "hardware file for --hardware (YAML when FILE ends in .yaml or .yml)",
    )
    b = parser.add_argument_group(
        "any running server (--base-url): fit the profile from outside, over HTTP; the engine flags above do not apply"
    )
    b.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="calibrate the OpenAI-compatible server at URL (vLLM, SGLang, llama.cpp, servelab) from "
        "its TTFT and token times, instead of timing servelab's engine here",
    )
    b.add_argument(
        "--served-model",
        default=None,
        metavar="NAME",
        help="the model name to request (default: the first one /v1/models lists)",
    )
    b.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token for the server (default: ${API_KEY_ENV}, which keeps it off the process list)",
    )
    b.add_argument(
        "--budget",
        default="10m",
        metavar="DURATION",
        help="bound on the whole run; it stops starting points past it and fits what it has (default 10m)",
    )
    b.add_argument(
        "--resume",
        action="store_true",
        help="keep the points saved in OUT.partial.jsonl by an earlier, interrupted run against the "
        "same server and measure only the rest",
    )
    b.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="longest prompt of the prefill sweep (default 2048, capped by the server's context)",
    )
    b.add_argument(
        "--max-concurrency",
        type=int,
        default=32,
        metavar="N",
        help="largest decode burst: requests sent together (default 32)",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=3,
        metavar="N",
        help="passes over every point; each point's value is the median (default 3)",
    )
    b.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help='fields added to every request, e.g. \'{"logit_bias": {"2": -100}}\' where the '
        "server does not honour ignore_eos",
    )
    b.add_argument("--request-timeout", default="10m", metavar="DURATION", help="per request (default 10m)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


StepKey = tuple[int, int, int, int, int]  # query tokens, sequences, Σ context, Σ pairs, logit rows


def _timed(engine: Any, log: list[tuple[StepKey, float]]) -> None:
    """Wraps the executor so that every step's shape sums, its logit rows (one per sequence plus
    its drafts) and its wall time are logged."""
    execute = engine.executor.execute

    def timed_execute(plan):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        result = execute(plan)
        elapsed = time.perf_counter() - t0
        if not plan.is_empty:
            tokens, seqs, context, pairs, _ = plan.shape_totals()
            log.append(((tokens, seqs, context, pairs, plan.logit_rows()), elapsed))
        return result

    engine.executor.execute = timed_execute


@dataclass(frozen=True, slots=True)
class Scenario:
    """Requests run to the end: (prompt length, output tokens) each; `late` ones join after
    `join_step` steps (mixed prefill + decode steps)."""

    prompts: tuple[tuple[int, int], ...]
    late: tuple[tuple[int, int], ...] = ()
    join_step: int = 2
    budget: int | None = None  # the scheduler's token budget for this scenario (None: the grid's chunk)
    # Verification steps: the same prompts every pass, each with its greedy output as a prediction;
    # only the steps that verify drafts are kept.
    predicted: bool = False


@dataclass(slots=True)
class Predictions:
    """A predicted scenario's fixed prompts and each one's greedy output, learned in a run before
    the timed passes (prefix caching is off, so a repeated prompt is computed afresh)."""

    prompts: list[list[int]]
    outputs: list[list[int]]


def _scenario(
    engine: Any, scenario: Scenario, rng: random.Random, chunk: int, predictions: Predictions | None = None
) -> list[list[int]]:
    """Runs the scenario to the end; the output tokens of its first requests, in order. With
    `predictions`, its first requests are those prompts, and each carries its output (where known)
    as a `prediction`."""
    from servelab.core.sequence import SamplingParams

    # the scheduler reads its budget at every schedule(): one engine serves every scenario's
    engine.scheduler.config.max_num_batched_tokens = scenario.budget or chunk
    outputs: dict[str, list[int]] = {}

    def add(n: int, out: int, i: int | None = None) -> None:
        if predictions is not None and i is not None:
            ids = predictions.prompts[i]
            predicted = predictions.outputs[i] if i < len(predictions.outputs) else None
        else:
            ids, predicted = [rng.randrange(engine.vocab_size) for _ in range(n)], None
        request_id = f"cal-{rng.getrandbits(48):x}"
        if i is not None:
            outputs[request_id] = []
        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0, prediction=predicted)
        engine.add_request(request_id, ids, params)

    for i, (n, out) in enumerate(scenario.prompts):
        add(n, out, i)
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in outputs:
                outputs[o.request_id] += o.new_token_ids
        steps += 1
        if steps == scenario.join_step:
            for n, out in scenario.late:
                add(n, out)
    return list(outputs.values())


def prefill_steps(grid: Grid, batch: int, context: int) -> int:
    """At most how many steps `batch` prompts of `context` tokens take to prefill, when the
    batch's decodes share each step's token budget with the prompts' chunks."""
    return -(-batch * context // max(1, grid.chunk - batch))


def serving_budget() -> int:
    """The token budget `servelab serve` runs with (its default: calibrate's server term and
    validate's server use it), the largest step the grid must time."""
    from servelab.core.config import SchedulerConfig

    return SchedulerConfig().max_num_batched_tokens


def scenarios(grid: Grid, max_len: int, budget: int | None = None) -> list[Scenario]:
    """Fresh prompts; decode batches whose sequences all still decode for `decode_steps` steps
    once the whole batch is prefilled (decode-only steps at the full batch, then a shrinking
    one); a full decode batch that a fresh prompt joins (mixed steps); and, at the serving
    `budget`, prompts prefilled together (steps up to the budget) and small decode batches
    joined by a whole prompt (mixed steps past the packed kernels' rows)."""
    budget = serving_budget() if budget is None else budget
    out = [Scenario(((n, 1),)) for n in grid.prefill_lens if n + 1 <= max_len]
    for c in grid.decode_contexts if grid.decode_batches else ():
        for b in grid.decode_batches:
            steps = prefill_steps(grid, b, c) + grid.decode_steps
            if c + steps + 1 <= max_len:
                out.append(Scenario(((c, steps + 1),) * b))
        b = max(grid.decode_batches)
        prefilled = prefill_steps(grid, b, c)
        steps = prefilled + grid.decode_steps + 3
        if c + steps + 1 <= max_len:
            out.append(Scenario(((c, steps + 1),) * b, ((min(grid.chunk, c), 1),), join_step=prefilled + 1))
    if grid.chunk + 1 <= max_len:
        out += [Scenario(((grid.chunk, 1),) * k, budget=budget) for k in grid.together if k * grid.chunk <= budget]
        c = min(grid.decode_contexts, default=0)
        fits = c and c + grid.decode_steps + 4 <= max_len
        out += [
            Scenario(((c, grid.decode_steps + 3),) * b, ((grid.chunk, 1),), join_step=2, budget=budget)
            for b in grid.joined_batches
            if fits and b * c + grid.chunk <= budget
        ]
    # each verification step takes up to K + 1 tokens a sequence: a prediction's K at most
    # DEFAULT_PREDICTION_TOKENS (or --speculative-config's, which may be larger: more steps then)
    out_len = grid.decode_steps * (DEFAULT_PREDICTION_TOKENS + 1) + 1
    out += [
        Scenario(((c, out_len),) * b, budget=max(b * c, b * (DEFAULT_PREDICTION_TOKENS + 1)), predicted=True)
        for c in grid.verify_contexts
        for b in grid.verify_batches
        if c + out_len + 1 <= max_len
    ]
    return out


def measure(
    engine: Any,
    grid: Grid,
    seed: int = 0,
    before_pass: Callable[[], None] | None = None,
    statistic: str = DEFAULT_STATISTIC,
) -> list[dict[str, Any]]:
    """Every step of every scenario, timed in `grid.repeats` passes after a warm-up. Each pass
    runs every scenario once, in a new shuffled order, so a slow spell on the host lands on
    different shapes in different passes instead of on all the repeats of a few; each step's time
    is then the `statistic` of its passes (cost/calibration_stats.py says which and why)."""
    from servelab.cost.calibration_stats import aggregate

    log: list[tuple[StepKey, float]] = []
    _timed(engine, log)
    rng = random.Random(seed)
    plan = scenarios(grid, engine.max_model_len)
    proposers = getattr(getattr(engine, "core", None), "proposers", None)
    if proposers is None or not proposers.predictions:  # this engine ignores predictions (CUDA, TP)
        plan = [sc for sc in plan if not sc.predicted]
    if not plan:
        raise InvalidArgument(f"no calibration shape fits max_model_len={engine.max_model_len}")
    biggest = max(plan, key=lambda sc: sum(n for n, _ in sc.prompts))
    for warm in [plan[0]] + ([biggest] if biggest != plan[0] else []):
        _scenario(engine, warm, rng, grid.chunk)  # warm-up: first touch of the KV pool, kernel builds
    predictions: dict[int, Predictions] = {}
    for i, sc in enumerate(plan):
        if sc.predicted:  # the greedy outputs the timed passes then predict
            fixed = Predictions([[rng.randrange(engine.vocab_size) for _ in range(n)] for n, _ in sc.prompts], [])
            fixed.outputs = _scenario(engine, sc, rng, grid.chunk, fixed)
            predictions[i] = fixed
    runs: list[list[list[tuple[StepKey, float]]]] = [[] for _ in plan]
    order = list(range(len(plan)))
    for _ in range(grid.repeats):
        if before_pass is not None:
            before_pass()
        rng.shuffle(order)
        for i in order:
            log.clear()
            _scenario(engine, plan[i], rng, grid.chunk, predictions.get(i))
            runs[i].append(list(log))
    measurements: list[dict[str, Any]] = []
    for scenario, scenario_runs in zip(plan, runs):
        for steps in zip(*scenario_runs):
            if len({s for s, _ in steps}) != 1:  # a pass scheduled differently: not one shape
                continue
            tokens, seqs, ctx, pairs, logit_rows = steps[0][0]
            if scenario.predicted and logit_rows == seqs:  # its whole-batch prefill: not what it is for
                continue
            measurements.append(
                {
                    "num_tokens": tokens,
                    "num_seqs": seqs,
                    "context_tokens": ctx,
                    "pairs": pairs,
                    "logit_rows": logit_rows,
                    "samples_s": [t for _, t in steps],
                }
            )
    return aggregate(measurements, statistic)


def kernel_rows_of(engine: Any) -> dict[str, Any] | None:
    """Where the loaded model's linears change kernel by rows (the profile's `kernel_rows`), read
    from what the engine loaded: GGUF blocks kept packed switch at block_quant.FUSED_MAX_ROWS (to
    the panel kernel; only formats with the in-register kernel) and past
    block_quant.same_order_max_rows (to MKL up to AVX2, to the k-major panel at the AVX-512
    levels; decode-only steps leave the stack there), or with the default's int8 dot products
    (block_quant.with_q8) once, below their first row count, 16-bit weights at linear.HALF_GEMV_MAX_ROWS and
    HALF_GEMM_MAX_ROWS. None when the linears have no
    such switch or mix kinds: dense fp32 and int8 (one kernel at every row count), deterministic
    mode (the panel kernel for every row count), tensor-parallel wrappers, CUDA."""
    from servelab.runtime import block_quant
    from servelab.runtime.linear import HALF_GEMM_MAX_ROWS, HALF_GEMV_MAX_ROWS, HalfLinear

    model = getattr(engine.executor, "model", None)
    linears = [lin for layer in getattr(model, "layers", None) or () for lin in layer.linears()]
    if not linears or any(getattr(lin, "invariant", False) for lin in linears):
        return None
    if all(isinstance(lin, block_quant.BlockQuantLinear) for lin in linears):
        fused = all(block_quant.fused_formats(lin) for lin in linears)
        formats = sorted({lin.format_name for lin in linears})
        q8_rows = {lin.q8_min_rows if lin.q8 is not None else None for lin in linears}
        if len(q8_rows) == 1 and (q8_min_rows := q8_rows.pop()) is not None:
            # the default's int8 dot products: one kernel from q8_min_rows rows on, on the stack too
            return {
                "fused_max_rows": q8_min_rows - 1,
                "max_rows": None,
                "linears": f"GGUF blocks kept packed ({', '.join(formats)}), int8 dot products from {q8_min_rows} rows",
            }
        return {
            "fused_max_rows": block_quant.FUSED_MAX_ROWS if fused else None,
            "max_rows": block_quant.same_order_max_rows(linears[0].kernels),
            "linears": f"GGUF blocks kept packed ({', '.join(formats)})",
        }
    if all(isinstance(lin, HalfLinear) for lin in linears):
        return {
            "fused_max_rows": HALF_GEMV_MAX_ROWS,
            "max_rows": HALF_GEMM_MAX_ROWS,
            "linears": f"16-bit weights ({linears[0].weight.dtype})".replace("torch.", ""),
        }
    return None


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

    return {
        "cpu": cpu,
        "flags": [f for f in wanted if f in flags.split()],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def build_profile(
    engine: Any,
    args: argparse.Namespace,
    grid_name: str,
    measurements: list[dict[str, Any]],
    wall_s: float,
    noise: dict[str, Any],
) -> dict[str, Any]:
    from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION, KernelRows, fit

    model = getattr(engine.executor, "model", None)
    engine_rows = kernel_rows_of(engine)
    fitted = fit(measurements, rows=KernelRows.from_dict(engine_rows))
    # the switches the fit could use (a grid that never went past one prices it as absent), kept
    # once, at the profile's top level, where ProfileStepCost reads them
    reached = fitted.pop("kernel_rows")
    kernel_rows = None if engine_rows is None else {**engine_rows, **reached}
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
        "engine_flags": {
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "device",
                "max_model_len",
                "threads",
                "quantization",
                "kv_cache_dtype",
                "deterministic",
                "tensor_parallel_size",
            )
        },
        "grid": grid_name,
        "calibration_wall_s": wall_s,
        "passes": GRIDS[grid_name].repeats,
        "step_time_statistic": f"{args.step_time_statistic} of the interleaved passes",
        "serving_budget_tokens": serving_budget(),
        "kernel_rows": kernel_rows,
        "host_noise": noise,
        "fit": fitted,
        "measurements": measurements,
    }


def run_black_box(args: argparse.Namespace) -> int:
    """`calibrate --base-url`: the designed experiment against the server, the fit, the profile."""
    import asyncio

    from servelab.bench import blackbox as bb
    from servelab.bench.client import OpenAIStreamClient
    from servelab.bench.prompts import PromptBuilder, load_tokenizer
    from servelab.commands._outputs import check_output_file
    from servelab.commands.bench import parse_extra_body

    check_output_file(args.out, "--out")
    budget_s = parse_duration_s(args.budget, name="--budget")
    if not budget_s > 0:
        raise InvalidArgument(f"--budget must be > 0, got {args.budget!r}")
    for name in ("max_concurrency", "repeats"):
        if getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    extra = parse_extra_body(args.extra_body)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    client = OpenAIStreamClient(args.base_url, model=args.served_model, api_key=api_key,
                                timeout_s=parse_duration_s(args.request_timeout, name="--request-timeout"),
                                extra_body=extra)  # fmt: skip

    async def go() -> dict[str, Any]:
        try:
            server = await bb.probe(client)
            limit = server.max_model_len
            max_prompt = args.max_prompt_tokens if limit is None else min(args.max_prompt_tokens, limit - 2)
            design = bb.make_design(max_prompt, args.max_concurrency, max(4096, 2 * max_prompt), args.repeats)
            path = bb.partial_path(args.out)
            results = bb.Results.resume(path, server) if args.resume else bb.Results(path)
            results.start(server)
            seed = time.time_ns() % (1 << 31)  # new prompts each run: no cache from an earlier one helps
            prober = bb.Prober(client, PromptBuilder(load_tokenizer(None), seed=seed), seed)
            show = bb.progress_printer(not args.no_progress, bar=sys.stderr.isatty())
            run = await bb.measure(prober, design, results, budget_s, show)
            return bb.build_profile(server, results, run, design)
        finally:
            await client.aclose()

    profile = asyncio.run(go())
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    print("\n".join(bb.report_lines(profile)))
    print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    from servelab.commands._outputs import check_output_file

    if args.base_url is not None:
        return run_black_box(args)
    from servelab.cost.calibration_stats import host_noise
    from servelab.runtime.host_probe import OtherLoadMeter
    from servelab.engine.llm_engine import LLMEngine
    from servelab.spec.hardware_file import SUFFIXES as HARDWARE_FILE_SUFFIXES

    check_output_file(args.out, "--out")
    check_output_file(args.hardware_out, "--hardware-out")
    if args.hardware_out is not None and not args.hardware_out.lower().endswith(HARDWARE_FILE_SUFFIXES):
        raise InvalidArgument(
            f"--hardware-out {args.hardware_out!r}: name it FILE.json, FILE.yaml or FILE.yml "
            f"(--hardware reads a file by its suffix)"
        )
    quiet_wait_s = parse_duration_s(args.quiet_wait, name="--quiet-wait")
    if not quiet_wait_s >= 0:
        raise InvalidArgument(f"--quiet-wait must be >= 0, got {args.quiet_wait!r}")
    if not args.max_heldout_error > 0:
        raise InvalidArgument(f"--max-heldout-error must be > 0 (a %), got {args.max_heldout_error:g}")
    if args.sim_model is not None:
        from servelab.spec.model import get_model

        get_model(args.sim_model)  # a misspelt name fails now, not after minutes of timing
    grid = GRIDS[args.grid]
    # the same shapes every repeat: no prefix cache, the grid's budget
    engine_args = engine_args_from(args, max_num_batched_tokens=grid.chunk, enable_prefix_caching=False)
    # as `serve` runs: the KV pool claimed up front, so no step pays first-touch page faults
    engine_args = replace(engine_args, kv_cache_prefault=True)
    set_threads(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InvalidArgument(
                f"calibrate --device cuda: this torch ({torch.__version__}) sees no CUDA device; "
                f"calibrate on the machine that serves, or use --device cpu",
                param="device",
            )
    engine = LLMEngine.from_args(engine_args)
    spec = engine.model_spec
    try:
        t0 = time.perf_counter()
        meter = OtherLoadMeter()
        passes: list[dict[str, float | None]] = []
        measurements = measure(
            engine,
            grid,
            before_pass=lambda: passes.append(wait_for_quiet(quiet_wait_s)),
            statistic=args.step_time_statistic,
        )
        noise = host_noise(
            [m["samples_s"] for m in measurements],
            other_cpus=meter.other_cpus(),
            cpus=os.cpu_count(),
            load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        )
        profile = build_profile(
            engine, args, args.grid, measurements, time.perf_counter() - t0, {**noise.to_dict(), "passes": passes}
        )
    finally:
        engine.close()
    f_ = profile["fit"]
    print(
        f"{profile['model']} ({profile['dtype']}, KV {profile['kv_cache_dtype']}) on {profile['host']['cpu']}: "
        f"{len(measurements)} step shapes, {args.step_time_statistic} of {grid.repeats} interleaved passes, "
        f"in {profile['calibration_wall_s']:.1f} s"
    )
    print(noise.describe())
    if quiet_wait_s > 0:
        print(
            "passes started after waiting "
            + ", ".join(
                f"{p['waited_s']:.0f} s" + ("" if p["other_cpus"] is None else f" (others {p['other_cpus']:.2f} CPUs)")
                for p in passes
            )
            + f" (--quiet-wait {args.quiet_wait})"
        )
    for name, value in f_["coefficients"].items():
        print(f"  {name:<20} {value * 1e6:12.4f} µs   ({f_['units'][name]})")
    h = f_["heldout"]
    print(
        f"held-out error ({h['count']} steps, every {f_['holdout_every']}th): median {h['median_abs_pct']:.1f}%, "
        f"max {h['max_abs_pct']:.1f}%; {len(f_['outliers_dropped'])} training step(s) dropped as outliers"
    )
    if noise.noisy:
        print(
            f"servelab calibrate: warning: the host was noisy ({noise.describe()}); step times include other "
            f"processes' interference, so expect them to differ from a run on a quiet host",
            file=sys.stderr,
        )
    if h["median_abs_pct"] > args.max_heldout_error:
        print(
            f"servelab calibrate: error: the fit's median error on {h['count']} held-out steps is "
            f"{h['median_abs_pct']:.1f}%, above --max-heldout-error {args.max_heldout_error:g}%: not writing "
            f"{args.out}. {noise.describe()}. Rerun on a quieter host, or with more passes (--grid full), or raise "
            f"--max-heldout-error to accept it",
            file=sys.stderr,
        )
        return 1
    if args.tensor_parallel_size > 1:
        profile["tp"] = measure_tp_term(args, spec)
        t = profile["tp"]
        bw = t["allreduce_bytes_per_s"]
        print(
            f"  tp term, gloo all-reduce among {t['ranks']} ranks: latency {t['allreduce_latency_s'] * 1e6:.1f} µs, "
            f"bandwidth {'-' if bw is None else f'{bw / 1e6:,.0f} MB/s'}; {t['collectives_per_step']} collectives "
            f"a step = {t['collectives_per_step'] * t['allreduce_latency_s'] * 1e3:.2f} ms"
        )
    if args.server_term:
        profile["server"] = measure_server_term(args, profile)
        term = profile["server"]
        print(
            f"  serving, {term['steps']} served steps beyond the profile's price, median by sequences in the step "
            "(of it outside the executor): "
            + ", ".join(
                f"{g['seqs']}: {g['median_residual_s'] * 1e3:+.2f} ms ({g['median_outside_executor_s'] * 1e3:.2f}; "
                f"{g['steps']} steps)"
                for g in term["by_seqs"]
            )
        )
        for r in term["runs"]:
            print(
                f"  serving, concurrency {r['concurrency']}: TPOT p50 measured {r['measured_tpot_p50_s'] * 1e3:.1f} ms, "
                f"replayed with engine steps alone {r['engine_only_tpot_p50_s'] * 1e3:.1f} ms, with the term "
                f"{r['fitted_tpot_p50_s'] * 1e3:.1f} ms"
            )
        print(f"  server_per_step_s    {profile['server']['per_step_s'] * 1e6:12.4f} µs   (s per step)")
        print(f"  server_per_seq_s     {profile['server']['per_seq_s'] * 1e6:12.4f} µs   (s per sequence in a step)")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {args.out}")
    if args.hardware_out:
        write_hardware_file(args.hardware_out, profile["host"])
    return 0


def wait_for_quiet(max_wait_s: float) -> dict[str, float | None]:
    """Waits, up to max_wait_s, until other processes keep under NOISY_OTHER_CPUS busy for a
    QUIET_WINDOW_S window; returns how long it waited and the last window's other load (None
    when not waiting). Passes then start in the host's quiet spells, where there are any."""
    from servelab.runtime.host_probe import OtherLoadMeter

    if max_wait_s <= 0:
        return {"waited_s": 0.0, "other_cpus": None}
    t0 = time.perf_counter()
    while True:
        meter = OtherLoadMeter()
        time.sleep(QUIET_WINDOW_S)
        others = meter.other_cpus()
        waited = time.perf_counter() - t0
        if others is None or others < NOISY_OTHER_CPUS or waited >= max_wait_s:
            return {"waited_s": waited, "other_cpus": others}


def measure_tp_term(args: argparse.Namespace, spec: Any) -> dict[str, Any]:
    """The all-reduce on this host's backend (gloo) among the engine's rank count, at the engine's
    message sizes, fitted as latency + bytes/bandwidth: what `sim`/`plan --tp` price a collective at."""
    from servelab.cost.profile import fit_allreduce
    from servelab.runtime.host_probe import allreduce_times

    if spec is None:
        raise InvalidArgument(
            "--tensor-parallel-size: the TP term needs the model's shape (layers, hidden size), "
            "which this model file does not give"
        )
    rows = allreduce_times(args.tensor_parallel_size, spec.hidden_size)
    fitted = fit_allreduce(rows)
    return {
        "ranks": args.tensor_parallel_size,
        "backend": "gloo",
        "allreduce_latency_s": fitted["latency_s"],
        "allreduce_bytes_per_s": fitted["bytes_per_s"],
        # two all-reduces of the hidden state a layer, the vocab-parallel embedding's, the logits' gather
        "collectives_per_step": 2 * spec.num_layers + 2,
        "hidden_allreduces_per_step": 2 * spec.num_layers + 1,
        "bytes_per_token": spec.hidden_size * 4,  # fp32 activations
        # the ranks share this host's cores (the engine splits its threads between them)
        "compute_scales_with_ranks": args.device != "cpu",
        "measurements": rows,
    }


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags calibrate was given, as `servelab serve` takes them (serve's own budgets)."""
    flags = ["--device", args.device, "--tensor-parallel-size", str(args.tensor_parallel_size)]
    for name in ("model", "dtype", "max_model_len", "quantization", "kv_cache_dtype"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags + (["--deterministic"] if args.deterministic else [])


def measure_server_term(args: argparse.Namespace, profile: dict[str, Any]) -> dict[str, Any]:
    """Starts `servelab serve` with calibrate's engine flags and a step log, benches it in closed
    loops from this process (a client apart from the server, as `validate`'s), and fits the serving
    term from its served steps against the profile's price for them (bench/fidelity.py,
    fit_server_term); the runs, replayed with the term, check it."""
    import asyncio
    import signal
    import subprocess
    import tempfile
    import urllib.request

    from servelab.bench.fidelity import ServedStep, ServerRun, fit_server_term, replayed
    from servelab.commands import validate
    from servelab.runtime.parallel.group import free_port
    from servelab.workload import workload_from_args

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)  # serve has no --threads; torch reads this at start
    with tempfile.TemporaryDirectory(prefix="servelab-calibrate-") as tmp:
        step_log = os.path.join(tmp, "steps.jsonl")
        cmd = [
            sys.executable,
            "-m",
            "servelab",
            "serve",
            "--port",
            str(port),
            "--no-access-log",
            "--no-lab",
            "--step-log",
            step_log,
            *_serve_flags(args),
        ]
        print(f"serving term: starting `servelab serve` on {url}", flush=True)
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                deadline = time.monotonic() + SERVER_START_TIMEOUT_S
                while True:
                    if proc.poll() is not None:
                        log.seek(0)
                        tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
                        raise InvalidArgument(
                            f"--server-term: `servelab serve` exited with {proc.returncode}: " + " / ".join(tail)
                        )
                    try:
                        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                            if response.status == 200:
                                break
                    except OSError:
                        pass
                    if time.monotonic() > deadline:
                        raise InvalidArgument(
                            f"--server-term: `servelab serve` was not healthy after {SERVER_START_TIMEOUT_S:g} s"
                        )
                    time.sleep(0.5)
                parser = argparse.ArgumentParser()
                validate.add_arguments(parser)
                runs, server, served = [], {}, ""
                for concurrency, requests in SERVER_RUNS:
                    bench_args = parser.parse_args([
                        "--base-url", url, "--profile", args.out, "--concurrency", str(concurrency),
                        "--num-requests", str(requests), "--input-len", str(SERVER_INPUT_LEN),
                        "--output-len", str(SERVER_OUTPUT_LEN), "--seed", str(7000 + concurrency), "--warmup", "1",
                        "--think-time", SERVER_THINK_TIME, "--no-progress"])  # fmt: skip
                    workload = workload_from_args(bench_args)
                    result, server, served = asyncio.run(validate.bench_live_server(bench_args, workload, None))
                    tpot = result.summary.tpot_s.p50
                    if result.summary.failed or tpot is None:
                        raise InvalidArgument(
                            f"--server-term: the bench run at concurrency {concurrency} against {url} "
                            f"failed ({result.summary.failed} failed requests)"
                        )
                    thinks = validate.bench_think_times(workload)
                    runs.append(
                        ServerRun(
                            concurrency,
                            result.records,
                            tpot,
                            [float(thinks(r)) for r in replayed(result.records)] if callable(thinks) else thinks,
                        )
                    )
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its ranks only
                        proc.wait()
        with open(step_log, encoding="utf-8") as f:
            steps = ServedStep.from_log([json.loads(line) for line in f if line.strip()])
    model = validate.sim_model(profile, args.sim_model, served)
    term = fit_server_term(profile, server, model, steps, runs)
    return {
        **term,
        "server_flags": _serve_flags(args),
        "input_len": SERVER_INPUT_LEN,
        "output_len": SERVER_OUTPUT_LEN,
        "served_steps": [st.to_row() for st in steps],
    }


def write_hardware_file(path: str, host: dict[str, Any]) -> None:
    """This host as a hardware file, checked by the same parser that reads --hardware files."""
    import re

    from servelab.runtime.host_probe import probe_hardware
    from servelab.spec.hardware_file import YAML_SUFFIXES, parse_hardware

    name = "host-" + (re.sub(r"[^a-z0-9]+", "-", host["cpu"].lower()).strip("-") or "cpu")
    data = probe_hardware(
        name,
        f"measured by servelab calibrate on {time.strftime('%Y-%m-%d')} with "
        f"{host['torch_threads']} threads: a streaming read and the best torch matmul (achieved "
        f"rates, not datasheet peaks)",
    )
    spec = parse_hardware(data, source=path, default_name=name)
    with open(path, "w", encoding="utf-8") as f:
        if path.lower().endswith(YAML_SUFFIXES):
            import yaml

            yaml.safe_dump(data, f, sort_keys=False)
        else:
            json.dump(data, f, indent=1)
    print(
        f"{spec.name}: {spec.memory_bytes / 1e9:.1f} GB, read bandwidth {spec.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"matmul fp32 {spec.peak_flops['fp32'] / 1e9:.0f} GFLOP/s, bf16 {spec.peak_flops['bf16'] / 1e9:.0f} GFLOP/s"
    )
    print(f"wrote {path} (use it with --hardware {path})")
