"""How many long sequences a sliding-window model keeps decoding at once in a fixed KV pool: the
scheduler and block manager the engine runs, with and without its KV groups (spec/kv_groups.py).

The pool is a fixed number of bytes, `--blocks` blocks of every layer; with groups the same bytes
are pages of one group's layers (a Gemma 2 page holds half the layers: twice the pages), and a
windowed group's pages are freed as they leave the window. Every request has the same prompt
and output length; the executor samples token 1 for every row (no model runs). Steps count the
scheduler's steps to finish them all (the fewer, the more sequences decode in each).

    .venv/bin/python benchmarks/window_capacity.py   # --model gemma-2-9b --blocks 4096 --output 6000
"""

from __future__ import annotations

import argparse

from servelab.core.config import SchedulerConfig
from servelab.core.plan import StepPlan, StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence
from servelab.spec.kv_groups import KVGroups
from servelab.spec.model import get_model


def run(groups: KVGroups, num_layers: int, blocks: int, args: argparse.Namespace) -> dict[str, int]:
    pages = blocks * num_layers // groups.slots_per_page
    cfg = SchedulerConfig(num_blocks=pages, block_size=args.block_size, max_num_seqs=args.requests,
                          max_model_len=args.prompt + args.output)  # fmt: skip
    s = Scheduler(cfg.resolve(kv_group_windows=groups.windows))
    for i in range(args.requests):  # distinct prompts: no prefix sharing
        prompt = [10_000 * i + j for j in range(args.prompt)]
        s.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=args.output, ignore_eos=True)), 0.0)
    steps = 0
    while s.has_unfinished():
        plan: StepPlan = s.schedule(0.0)
        s.update(plan, StepResult([1 if e.samples else None for e in plan.scheduled]), 0.0, finished_only=True)
        steps += 1
    tokens = args.requests * args.output
    return {"pages": pages, "steps": steps, "tokens/step": round(tokens / steps, 1), "preemptions": s.num_preemptions}


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-2-9b")
    parser.add_argument("--blocks", type=int, default=4096, help="the pool, as blocks of every layer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=6000)
    args = parser.parse_args(argv)
    model = get_model(args.model)
    grouped = KVGroups.of_model(model)
    per_layer = KVGroups.from_layer_windows([None] * model.num_layers)
    print(f"{model.name}: windows {grouped.windows}, {grouped.slots_per_page} layers a page; pool "
          f"{args.blocks} blocks x {args.block_size} tokens of all {model.num_layers} layers; "
          f"{args.requests} requests of {args.prompt} + {args.output} tokens")  # fmt: skip
    results = {}
    for name, groups in (("every block kept", per_layer), ("KV groups", grouped)):
        results[name] = run(groups, model.num_layers, args.blocks, args)
        print(f"{name:>17}: {results[name]}")
    return results


if __name__ == "__main__":
    main()
