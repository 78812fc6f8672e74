"""`servelab roofline`: what a decode step costs at each batch size, and why.

One row per batch size: step time (= TPOT), tokens/s per user and in total, which roof binds,
arithmetic intensity, and whether weights plus KV fit in memory. The header gives the seed's
peak-rate figures (weights streamed once, one token's compute, the ridge) beside the predictions.
With `--speculative-config` a second table prices speculative decoding at each batch size against
plain decoding, and names the batch where it stops paying.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from servelab.commands._dtype_cli import add_cost_dtype_arguments, cost_dtypes
from servelab.commands._speculative_cli import add_speculative_arguments, describe_speculation, speculation_from_args
from servelab.errors import InvalidArgument
from servelab.spec.model import MODEL_HELP, resolve_model
from servelab.units import parse_duration_s, parse_int_list

HELP = "roofline cost of decode/prefill steps for a model on an accelerator"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument(
        "--hardware",
        required=True,
        help="catalog accelerator (see `servelab hardware`) or a JSON or YAML hardware file",
    )
    add_cost_dtype_arguments(parser)
    parser.add_argument(
        "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel degree (default 1)"
    )
    parser.add_argument("--batch", default="1,8,64", help="comma-separated decode batch sizes (default 1,8,64)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of context per sequence (default 2048)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        metavar="N",
        help="also estimate the prefill time (TTFT) of an N-token prompt",
    )
    parser.add_argument(
        "--memory-fraction", type=float, default=0.9, help="share of device memory for weights + KV cache (default 0.9)"
    )
    parser.add_argument(
        "--no-fit-check",
        action="store_true",
        help="show batches that do not fit in memory (fits=no) instead of failing",
    )
    e = parser.add_argument_group("efficiency (defaults fitted to published measurements: docs/fidelity.md)")
    e.add_argument("--bandwidth-fraction", type=float, default=None, help="achievable share of peak bandwidth")
    e.add_argument("--compute-fraction", type=float, default=None, help="achievable share of peak FLOP/s")
    e.add_argument("--step-overhead", default=None, help="fixed cost per step besides the per-layer one, e.g. 150us")
    e.add_argument(
        "--engine-profile",
        default=None,
        metavar="NAME",
        help="price with an engine preset's roofline terms, as `sim` and `plan` do with the same flag "
        "(servelab/spec/engine_profiles.json, key gpu): servelab, vllm, sglang, trtllm; default: the "
        "Efficiency defaults, which servelab, vllm and sglang carry",
    )
    e.add_argument(
        "--measured-kernels",
        action="store_true",
        help="price linear layers, attention and all-reduces from the part's measured kernels (A100, and "
        "H100's 16-bit GEMMs: Vidur's profiles; H100's FP8 GEMMs and attention, H200: "
        "benchmarks/data/h100_kernels.json, h200_kernels.json) instead of the end-to-end fractions "
        "(docs/fidelity.md, 'Measured GPU kernels')",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="also print a `servelab calibrate` profile's measured-fit step times beside the roofline's",
    )
    parser.add_argument(
        "--by-operator",
        action="store_true",
        help="also split each decode step (and the prefill, with --prompt-len) by operator: QKV projection, "
        "attention, output projection, MLP, LM head, each with its FLOP/byte and bound",
    )
    add_speculative_arguments(parser.add_argument_group("speculative decoding"))
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot tokens/s per user and in total against batch size"
    )


def _efficiency(args: argparse.Namespace, hardware: Any, weight_dtype: str) -> Any:
    from dataclasses import replace

    from servelab.cost.roofline import default_efficiency, has_measured_kernels

    eff = default_efficiency(args.measured_kernels and has_measured_kernels(hardware, weight_dtype))
    if args.engine_profile is not None:
        from servelab.sim.engine_profiles import engine_profile

        if args.measured_kernels:
            raise InvalidArgument(
                "--engine-profile and --measured-kernels each choose the end-to-end terms; give one",
                param="engine_profile",
            )
        eff = engine_profile(args.engine_profile).efficiency() or eff
    if args.bandwidth_fraction is not None:
        eff = replace(eff, bandwidth_fraction=args.bandwidth_fraction)
    if args.compute_fraction is not None:
        eff = replace(eff, compute_fraction=args.compute_fraction)
    if args.step_overhead is not None:
        eff = replace(eff, step_overhead_s=parse_duration_s(args.step_overhead, name="--step-overhead"))
    return eff


def build(args: argparse.Namespace) -> tuple[Any, list[int]]:  # (Roofline, batches)
    from servelab.cost.roofline import Roofline
    from servelab.spec.hardware import get_hardware

    batches = parse_int_list(args.batch, name="--batch")
    if args.context < 1:
        raise InvalidArgument(f"--context must be at least 1 token, got {args.context}")
    if args.prompt_len is not None and args.prompt_len < 1:
        raise InvalidArgument(f"--prompt-len must be at least 1 token, got {args.prompt_len}")
    model = resolve_model(args.model)
    weight, kv = cost_dtypes(args)
    hardware = get_hardware(args.hardware)
    roofline = Roofline(
        model,
        hardware,
        weight_dtype=weight,
        kv_dtype=kv,
        tp=args.tp,
        efficiency=_efficiency(args, hardware, weight),
        memory_fraction=args.memory_fraction,
        measured_kernels=args.measured_kernels,
    )
    if args.context > model.max_context:
        raise InvalidArgument(
            f"--context {args.context} exceeds {model.name}'s maximum context of {model.max_context} tokens"
        )
    if args.prompt_len is not None and args.prompt_len > model.max_context:
        raise InvalidArgument(
            f"--prompt-len {args.prompt_len} exceeds {model.name}'s maximum context of {model.max_context} tokens"
        )
    if not args.no_fit_check:
        roofline.memory.require_fit(max(batches), args.context)
    return roofline, batches


def rows(roofline: Any, batches: list[int], context: int, prompt_len: int | None) -> list[dict[str, Any]]:
    plan = roofline.memory
    prefill = roofline.prefill(prompt_len) if prompt_len else None
    end_to_end_p = float("inf") if roofline.gemm is not None else roofline.overlap_sharpness
    out = []
    for batch in batches:
        cost = roofline.decode(batch, context)
        row: dict[str, Any] = {
            "batch": batch,
            "context": context,
            "step_time_s": cost.time_s,
            "tokens_per_s_per_user": 1.0 / cost.time_s,
            "tokens_per_s_total": batch / cost.time_s,
            "bound": cost.bound,
            "arithmetic_intensity": cost.arithmetic_intensity,
            "ridge_flops_per_byte": cost.ridge_flops_per_byte,
            "weight_bytes": plan.weight_bytes_per_device,
            "kv_bytes": plan.kv_bytes(batch, context),
            "fits": plan.fits(batch, context),
            "flops": cost.flops,
            "bytes_moved": cost.total_bytes,
            "kv_read_bytes": cost.kv_read_bytes,
            "compute_time_s": cost.compute_time_s,
            "memory_time_s": cost.memory_time_s,
            "comm_time_s": cost.comm_time_s,
            "peak_compute_time_s": cost.peak_compute_time_s,
            "peak_memory_time_s": cost.peak_memory_time_s,
            "parameter_source": roofline.parameter_source,
            # the p of the compute/memory p-norm and what it was fitted on; None: max() (nothing measured on
            # the part or its architecture), or the measured kernels' path, which sums each kernel's own time
            "overlap_sharpness": None if end_to_end_p == float("inf") else end_to_end_p,
            "overlap_source": None if end_to_end_p == float("inf") else roofline.overlap_source,
            # rows a linear layer's GEMM computes at once (1: no rounding); a MoE expert's share rounds up too
            "gemm_tile_tokens": roofline.tile_tokens,
            "extrapolation": list(roofline.extrapolation),
        }
        if prefill is not None:
            row["prompt_len"] = prompt_len
            row["prefill_time_s"] = prefill.time_s
        out.append(row)
    return out


def add_operator_rows(roofline: Any, table_rows: list[dict[str, Any]], context: int, prompt_len: int | None) -> None:
    """Each row's step split by operator under "operators" (and its prefill's under "prefill_operators")."""
    from servelab.cost.operators import operator_costs

    prefill = operator_costs(roofline, [(prompt_len, prompt_len)]) if prompt_len else None
    for row in table_rows:
        row["operators"] = [o.to_dict() for o in operator_costs(roofline, [(1, context)] * row["batch"])]
        if prefill is not None:
            row["prefill_operators"] = [o.to_dict() for o in prefill]


def _operator_table(table_rows: list[dict[str, Any]]) -> str:
    from servelab.commands._table import render_table

    headers = ["step", "operator", "ms", "FLOP/byte", "TFLOP/s", "bound"]
    body = []
    steps = [(f"decode batch {r['batch']}", r["operators"]) for r in table_rows]
    if "prefill_operators" in table_rows[0]:
        steps.insert(0, (f"prefill {table_rows[0]['prompt_len']:,}", table_rows[0]["prefill_operators"]))
    for step, ops in steps:
        for o in ops:
            body.append(
                [
                    step,
                    o["label"],
                    f"{o['time_s'] * 1e3:.3f}",
                    f"{o['arithmetic_intensity']:,.1f}",
                    f"{o['attained_flops_per_s'] / 1e12:,.1f}",
                    o["bound"],
                ]
            )
    return render_table(headers, body, left=(0, 1, 5))


def speculative_cost(args: argparse.Namespace, roofline: Any) -> Any:  # SpeculativeCost | None
    from servelab.cost.speculative import SpeculativeCost, draft_cost

    speculation = speculation_from_args(args)
    if speculation is None:
        return None
    config, acceptance = speculation
    draft = draft_cost(config, roofline.hardware, roofline.weight_dtype, roofline.kv_dtype, roofline.tp)
    return SpeculativeCost(roofline, draft, acceptance)


def add_speculative_rows(spec: Any, table_rows: list[dict[str, Any]], context: int) -> int | None:
    """Each row's speculative figures under "speculative"; returns the crossover batch."""
    for row in table_rows:
        row["speculative"] = spec.row(row["batch"], context).to_dict()
    return spec.crossover_batch(context)


def _speculative_table(table_rows: list[dict[str, Any]]) -> str:
    from servelab.commands._table import render_table

    headers = ["batch", "plain TPOT ms", "verify ms", "draft ms", "tok/step", "spec TPOT ms", "spec tok/s total",
               "speedup"]  # fmt: skip
    body = []
    for r in table_rows:
        s = r["speculative"]
        body.append(
            [
                r["batch"],
                f"{s['plain_tpot_s'] * 1e3:.2f}",
                f"{s['verify_step_s'] * 1e3:.2f}",
                f"{s['draft_step_s'] * 1e3:.2f}",
                f"{s['tokens_per_step']:.2f}",
                f"{s['spec_tpot_s'] * 1e3:.2f}",
                f"{s['spec_tokens_per_s_total']:,.0f}",
                f"{s['speedup']:.2f}x",
            ]
        )
    return render_table(headers, body, left=())


def spec_memory_limit(spec: Any, roofline: Any, context: int) -> int:
    """The largest batch whose KV fits beside a draft model's weights and KV (the target's alone for ngram)."""
    from servelab.cost.speculative import kv_tokens_beside_draft

    model = getattr(spec.draft.draft_model, "model", None)
    return kv_tokens_beside_draft(roofline.memory, model) // context


def crossover_note(crossover: int | None, limit: int, context: int) -> str:
    if crossover is None:
        return f"speculation pays at every batch at context {context} (memory limit: batch {limit:,})"
    where = "within" if crossover <= limit else "beyond"
    return (
        f"speculation stops paying from batch {crossover:,} at context {context} "
        f"({where} the memory limit of batch {limit:,})"
    )


def _compute_bound_note(roofline: Any, context: int) -> str:
    batch = roofline.compute_bound_batch(context)
    limit = roofline.memory.max_batch(context)
    if batch is not None:
        where = "within" if batch <= limit else "beyond"
        return f"compute-bound from batch {batch:,} at context {context} ({where} the memory limit of batch {limit:,})"
    # Each extra sequence adds its KV reads and its FLOPs; below the ridge they never catch up.
    big = 1 << 16
    a, b = roofline.decode(big, context), roofline.decode(big + 1, context)
    flops, nbytes = b.flops - a.flops, b.total_bytes - a.total_bytes
    return (
        f"never compute-bound at context {context}: each sequence adds {nbytes / 1e6:,.0f} MB of KV and "
        f"activation traffic for {flops / 1e9:.1f} GFLOP ({flops / nbytes:.0f} FLOP/byte, below the ridge)"
    )


def _header(roofline: Any, context: int) -> list[str]:
    m, hw, plan = roofline.model, roofline.hardware, roofline.memory
    devices = f"{roofline.tp}× " if roofline.tp > 1 else ""
    return [
        (
            f"{m.name} on {devices}{hw.name}: {roofline.weight_dtype} weights, {roofline.kv_dtype} KV cache, "
            f"decode at context {context}"
        ),
        (
            f"peak: weights {plan.weight_bytes_per_device / 1e9:.2f} GB/device stream once in "
            f"{roofline.weight_stream_time_s * 1e3:.2f} ms at {hw.bandwidth_bytes_per_s / 1e12:.3g} TB/s; "
            f"one token's compute {roofline.token_compute_time_s * 1e3:.4f} ms at "
            f"{roofline.peak_flops_per_s / 1e12:,.4g} TFLOPS; ridge {roofline.ridge_flops_per_byte:.0f} FLOP/byte"
        ),
        (
            f"memory: KV {plan.kv_bytes_per_token_per_device:,.0f} bytes/token/device; {plan.kv_capacity_bytes / 1e9:.1f} GB "
            f"left at {plan.memory_fraction:.0%} of {hw.memory_bytes / 1e9:.0f} GB = {plan.kv_capacity_tokens:,} tokens "
            f"= batch {plan.max_batch(context):,} at context {context}" + _window_note(m)
        ),
        _efficiency_line(roofline),
    ]


def _window_note(model: Any) -> str:
    """Why a windowed model's batch exceeds tokens ÷ context."""
    if model.sliding_window is None:
        return ""
    local = sum(model.layer_window(i) is not None for i in range(model.num_layers))
    return (
        f" ({local} of {model.num_layers} layers keep only their {model.sliding_window:,}-token window's KV: "
        f"the engine frees the blocks that leave it)"
    )


def _efficiency_line(roofline: Any) -> str:
    eff, m = roofline.efficiency, roofline.model
    fmt = eff.for_format(roofline.weight_dtype)
    bandwidth = (
        f"{fmt.bandwidth_fraction:.0%} of peak bandwidth for {roofline.weight_dtype} weights and "
        f"{eff.bandwidth_fraction:.0%} for the rest"
        if fmt.bandwidth_fraction != eff.bandwidth_fraction
        else f"{eff.bandwidth_fraction:.0%} of peak bandwidth"
    )
    fixed_s = eff.step_overhead_s + m.num_layers * eff.per_layer_overhead_s
    if roofline.gemm is not None:
        measured = "linear layers, attention" + (", all-reduces" if roofline.allreduce is not None else "")
        return (
            f"predicted by {roofline.hardware.name}'s measured kernels ({measured}; their sources: "
            f"--json's parameter_source): new KV and activations at "
            f"{eff.bandwidth_fraction:.0%} of peak bandwidth, {fixed_s * 1e3:.2f} ms per step ({m.num_layers} "
            f"layers) + {eff.per_seq_overhead_s * 1e6:.1f} us per sequence besides the kernels"
        )
    p = roofline.overlap_sharpness
    overlap = "max() of the two" if p == float("inf") else f"their p-norm, p = {p:.3g} ({roofline.overlap_source})"
    if roofline.tile_tokens > 1:
        overlap += f", linear layers in tiles of {roofline.tile_tokens} rows"
    return (
        f"predicted at {bandwidth} and {fmt.compute_fraction:.0%} of peak compute (ridge "
        f"{roofline.achievable_ridge_flops_per_byte:.0f} FLOP/byte) combined as {overlap}, "
        f"{fixed_s * 1e3:.2f} ms per step ({m.num_layers} layers) + {eff.per_seq_overhead_s * 1e6:.1f} us per sequence"
    )


def _table(table_rows: list[dict[str, Any]]) -> str:
    from servelab.commands._table import render_table

    headers = ["batch", "step ms", "tok/s/user", "tok/s total", "bound", "FLOP/byte", "weights GB", "KV GB", "fits"]
    body = [
        [
            r["batch"],
            f"{r['step_time_s'] * 1e3:.2f}",
            f"{r['tokens_per_s_per_user']:,.1f}",
            f"{r['tokens_per_s_total']:,.0f}",
            r["bound"],
            f"{r['arithmetic_intensity']:,.1f}",
            f"{r['weight_bytes'] / 1e9:.2f}",
            f"{r['kv_bytes'] / 1e9:.2f}",
            "yes" if r["fits"] else "no",
        ]
        for r in table_rows
    ]
    return render_table(headers, body, left=(4, 8))


def plot(roofline: Any, batches: list[int], context: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit = roofline.memory.max_batch(context)
    ridge_batch = roofline.compute_bound_batch(context)
    top = max([*batches, limit, ridge_batch or 1]) * 2
    sweep = sorted({max(1, round(2 ** (i / 8))) for i in range(int(8 * top.bit_length()) + 1)} | set(batches))
    times = [roofline.decode(b, context).time_s for b in sweep]

    fig, ax_total = plt.subplots(figsize=(8, 5))
    ax_user = ax_total.twinx()
    ax_total.plot(sweep, [b / t for b, t in zip(sweep, times)], color="tab:blue", label="tokens/s total")
    ax_user.plot(sweep, [1 / t for t in times], color="tab:orange", label="tokens/s per user")
    ax_total.scatter(batches, [b / roofline.decode(b, context).time_s for b in batches], color="tab:blue", zorder=3)
    ax_user.scatter(batches, [1 / roofline.decode(b, context).time_s for b in batches], color="tab:orange", zorder=3)
    if limit >= 1:
        ax_total.axvline(limit, color="tab:red", linestyle="--", label=f"memory limit: batch {limit:,}")
        ax_total.axvspan(limit, sweep[-1], color="tab:red", alpha=0.07)
    if ridge_batch is not None:
        ax_total.axvline(
            ridge_batch,
            color="tab:green",
            linestyle=":",
            label=f"compute-bound from batch {ridge_batch:,} (ridge {roofline.ridge_flops_per_byte:.0f} FLOP/B)",
        )
    else:
        ax_total.plot(
            [],
            [],
            color="tab:green",
            linestyle=":",
            label=f"never reaches the ridge ({roofline.ridge_flops_per_byte:.0f} FLOP/B) at this context",
        )
    ax_total.set_xscale("log", base=2)
    ax_total.set_xlabel("decode batch size")
    ax_total.set_ylabel("tokens/s total", color="tab:blue")
    ax_user.set_ylabel("tokens/s per user", color="tab:orange")
    ax_user.set_ylim(bottom=0)
    ax_total.set_ylim(bottom=0)
    m, hw = roofline.model, roofline.hardware
    ax_total.set_title(f"{m.name} on {hw.name} ({roofline.weight_dtype}, tp={roofline.tp}), context {context}")
    handles = ax_total.get_legend_handles_labels()
    handles_user = ax_user.get_legend_handles_labels()
    ax_total.legend(handles[0] + handles_user[0], handles[1] + handles_user[1], loc="center left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _add_profile(args: argparse.Namespace, model_name: str, table_rows: list[dict[str, Any]]) -> Any:
    """Adds the profile's predicted step (and prefill) times to each row; returns the cost model."""
    from servelab.cost.profile import load_profile, profile_step_cost

    cost = profile_step_cost(load_profile(args.profile, model=model_name), tp=args.tp)
    for row in table_rows:
        row["profile_step_time_s"] = cost.step_time_s([(1, row["context"])] * row["batch"])
        if "prompt_len" in row:
            row["profile_prefill_time_s"] = cost.step_time_s([(row["prompt_len"], row["prompt_len"])])
    return cost


def run(args: argparse.Namespace) -> int:
    from servelab.commands._outputs import check_plot_file

    check_plot_file(args.plot, "--plot")
    roofline, batches = build(args)
    table_rows = rows(roofline, batches, args.context, args.prompt_len)
    spec = speculative_cost(args, roofline)
    crossover = None if spec is None else add_speculative_rows(spec, table_rows, args.context)
    profile = None if args.profile is None else _add_profile(args, roofline.model.name, table_rows)
    if args.plot:
        plot(roofline, batches, args.context, args.plot)
    if args.by_operator:
        add_operator_rows(roofline, table_rows, args.context, args.prompt_len)
    if args.json:
        if spec is not None:
            limit = spec_memory_limit(spec, roofline, args.context)
            for row in table_rows:
                row["speculative"]["crossover_batch"] = crossover
                row["speculative"]["memory_limit_batch"] = limit
        print(json.dumps(table_rows, indent=2))
        return 0
    if roofline.extrapolation:
        from servelab.cost.roofline import extrapolation_notice

        print(extrapolation_notice(roofline.extrapolation))
    print("\n".join(_header(roofline, args.context)))
    print()
    print(_table(table_rows))
    if profile is not None:
        print(
            f"\nmeasured (profile {args.profile}, its host, not {roofline.hardware.name}): decode step at context "
            f"{args.context}: "
            + ", ".join(f"batch {r['batch']} {r['profile_step_time_s'] * 1e3:.2f} ms" for r in table_rows)
        )
        if args.prompt_len:
            print(
                f"measured prefill of a {args.prompt_len:,}-token prompt in one step: "
                f"{table_rows[0]['profile_prefill_time_s'] * 1e3:.1f} ms"
            )
    print()
    print(_compute_bound_note(roofline, args.context))
    if spec is not None:
        print()
        print(describe_speculation(spec.draft.config, spec.acceptance, spec.draft))
        print(_speculative_table(table_rows))
        print(crossover_note(crossover, spec_memory_limit(spec, roofline, args.context), args.context))
    if args.by_operator:
        print()
        print(_operator_table(table_rows))
    if args.prompt_len:
        cost = roofline.prefill(args.prompt_len)
        print(
            f"prefill of a {args.prompt_len:,}-token prompt: {cost.time_s * 1e3:.1f} ms (TTFT estimate), "
            f"{cost.bound}-bound, {cost.arithmetic_intensity:,.0f} FLOP/byte"
        )
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
