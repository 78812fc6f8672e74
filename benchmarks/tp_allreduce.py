"""Tensor parallelism's communication on this host: gloo all-reduce at the engine's message
sizes, and the engine's step time at TP=1 and TP=N on the bundled model.

- all-reduce: `--ranks` processes (2 and 3 by default) on 127.0.0.1 (gloo, as the engine's ranks), each all-reducing
  an fp32 [tokens, hidden] buffer: the message of one row-parallel layer for a step of that many
  tokens. Median latency over `--iters`, and the algorithm bandwidth (buffer bytes / time).
- step time: the engine on the bundled model (SmolLM2-135M: 9 heads, 3 KV heads, so N must
  divide 9; default 3), one 128-token prefill step and the median batch-1 decode step, TP=1
  then TP=N, with the host's torch threads split between the ranks as the engine does.
- the cost model's all-reduce term beside them: cost/roofline.py's Efficiency.allreduce_latency_s
  per all-reduce (two per layer), and the step's all-reduce count.

- `--check`: also 64 greedy tokens at TP=1 and TP=N on the bundled model (equal?), and the
  largest difference of their logits over the whole sequence (tests do this on tiny models).

`--model DIR` times another model (its hidden size sets the messages); `--quick` (2 ranks, TP=2,
5 iterations, 4 decode steps) with a tiny `--model` checks that it runs.

    python benchmarks/tp_allreduce.py [--ranks 2 3] [--tp 3] [--iters 50] [--check] [--json] [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)
import torch

from servelab.core.sequence import SamplingParams
from servelab.cost.profile import fit_allreduce, tp_comm_s
from servelab.cost.roofline import Efficiency
from servelab.engine.bundled import bundled_model_path
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.runtime.host_probe import ALLREDUCE_TOKENS, allreduce_times
from servelab.spec.model import resolve_model

TOKENS = ALLREDUCE_TOKENS


def allreduce_table(ranks: int, hidden: int, iters: int) -> list[dict]:
    rows = allreduce_times(ranks, hidden, TOKENS, iters)  # the same probe as `calibrate --tensor-parallel-size`
    return [{"tokens": r["tokens"], "bytes": r["bytes"], "median_us": r["median_s"] * 1e6,
             "algbw_MB_s": r["bytes"] / r["median_s"] / 1e6} for r in rows]  # fmt: skip


def step_times(model: str, tp: int, decodes: int = 32) -> dict:
    engine = LLMEngine.from_args(EngineArgs(model=model, tensor_parallel_size=tp))
    try:
        engine.add_request("warm", list(range(100, 116)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        engine.add_request(
            "r", list(range(200, 328)), SamplingParams(max_tokens=decodes + 1, temperature=0, ignore_eos=True)
        )
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return {"tp": tp, "prefill_128_ms": times[0] * 1e3, "decode_b1_ms": statistics.median(times[1:]) * 1e3}
    finally:
        engine.close()


def check_greedy_and_logits(model: str, tp: int) -> dict:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.tiny_models import prefill_logits

    engines = {n: LLMEngine.from_args(EngineArgs(model=model, tensor_parallel_size=n)) for n in (1, tp)}
    try:
        seqs = {}
        for n, engine in engines.items():
            ids = engine.tokenizer.encode_prompt("The history of the river Seine begins")
            engine.add_request("a", ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            out: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    out += o.new_token_ids
            seqs[n] = ids + out
        logits = {n: prefill_logits(e.executor.model, seqs[1]) for n, e in engines.items()}
        return {"greedy_64_equal": seqs[1] == seqs[tp], "max_abs_logit_diff": float((logits[1] - logits[tp]).abs().max()),
                "max_abs_logit": float(logits[1].abs().max())}  # fmt: skip
    finally:
        for e in engines.values():
            e.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3], help="processes in the all-reduce timing")
    ap.add_argument("--tp", type=int, default=3, help="tensor-parallel size of the step timing (divides 9)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--check", action="store_true", help="greedy tokens and logits, TP=N against TP=1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="an HF model directory or GGUF file (default: the bundled GGUF)")
    ap.add_argument("--quick", action="store_true", help="2 ranks, TP=2, 5 iterations, 4 decode steps")
    args = ap.parse_args(argv)
    decodes = 32
    if args.quick:
        args.ranks, args.tp, args.iters, decodes = [2], 2, 5, 4
    if args.iters < 1 or min(args.ranks) < 2 or args.tp < 2:
        ap.error("--iters must be >= 1, and --ranks and --tp >= 2")
    model = args.model or str(bundled_model_path())
    spec = resolve_model(model)
    hidden, layers = spec.hidden_size, spec.num_layers

    load = os.getloadavg()
    result = {
        "host": {"cpus": os.cpu_count(), "loadavg_1_5_15": load, "torch_threads": torch.get_num_threads()},
        "model": {"path": model, "hidden": hidden, "layers": layers},
        "allreduce": {ranks: allreduce_table(ranks, hidden, args.iters) for ranks in args.ranks},
        "steps": [step_times(model, 1, decodes), step_times(model, args.tp, decodes)],
    }
    if args.check:
        result["check"] = check_greedy_and_logits(model, args.tp)
    eff = Efficiency()
    result["cost_model"] = {"allreduce_latency_us": eff.allreduce_latency_s * 1e6, "allreduces_per_step": 2 * layers,
                            "modelled_latency_per_step_ms": 2 * layers * eff.allreduce_latency_s * 1e3}  # fmt: skip
    # The calibrated profile's TP term (cost/profile.py, profile_step_cost) from the TP=N all-reduce
    # fit: TP=1's measured step, with the same compute (the ranks share the cores), plus the
    # step's collectives at the fitted latency and bandwidth.
    if args.tp in result["allreduce"]:
        fitted = fit_allreduce(
            [{"bytes": r["bytes"], "median_s": r["median_us"] / 1e6} for r in result["allreduce"][args.tp]]
        )
        term = {"ranks": args.tp, "collectives_per_step": 2 * layers + 2, "hidden_allreduces_per_step": 2 * layers + 1,
                "bytes_per_token": hidden * 4, "allreduce_latency_s": fitted["latency_s"],
                "allreduce_bytes_per_s": fitted["bytes_per_s"]}  # fmt: skip
        tp1 = result["steps"][0]
        predicted = {}
        for name, tokens in (("prefill_128_ms", 128), ("decode_b1_ms", 1)):
            per_step, per_token = tp_comm_s(term, args.tp)
            predicted[name] = tp1[name] + (per_step + per_token * tokens) * 1e3
        result["profile_tp_term"] = {"fit": fitted, "predicted_tp_step": predicted}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"host: {result['host']}")
    for ranks, rows in result["allreduce"].items():
        print(f"gloo all-reduce, {ranks} ranks, fp32 [tokens, {hidden}]:")
        for r in rows:
            print(f"  {r['tokens']:>4} tokens {r['bytes']:>9} B  {r['median_us']:9.1f} us  {r['algbw_MB_s']:8.1f} MB/s")
    for s in result["steps"]:
        print(
            f"TP={s['tp']}: prefill 128 tokens {s['prefill_128_ms']:.1f} ms, decode batch 1 {s['decode_b1_ms']:.1f} ms/step"
        )
    c = result["cost_model"]
    print(f"cost model: {c['allreduces_per_step']} all-reduces/step x {c['allreduce_latency_us']:.1f} us = "
          f"{c['modelled_latency_per_step_ms']:.3f} ms of latency per step")  # fmt: skip
    if "profile_tp_term" in result:
        t = result["profile_tp_term"]
        bw = t["fit"]["bytes_per_s"]
        p = t["predicted_tp_step"]
        print(
            f"profile TP term ({args.tp} ranks): latency {t['fit']['latency_s'] * 1e6:.0f} us, bandwidth "
            f"{'-' if bw is None else f'{bw / 1e6:.0f} MB/s'}; predicted TP={args.tp}: prefill 128 tokens "
            f"{p['prefill_128_ms']:.1f} ms, decode batch 1 {p['decode_b1_ms']:.1f} ms/step"
        )
    if args.check:
        print(f"TP={args.tp} against TP=1: {result['check']}")


if __name__ == "__main__":
    main()
