"""Weight bytes a MoE decode step reads, counted in the engine, against the roofline's.

A decode step of a mixture of experts reads its dense weights (attention, norms, routers, the LM
head, any dense MLP layers) and only the experts its tokens were routed to: at batch 1 that is k
experts per MoE layer, at batch 64 nearly all of them. The engine counts the bytes of the experts
each step ran (`LlamaModel.step_weight_bytes`); the roofline (servelab.cost) expects
E * (1 - (1 - k/E)^B) distinct experts per layer at batch B under uniform routing. Bytes, not
time: the figures do not depend on the host.

    python benchmarks/moe_bytes.py [--model DIR_OR_GGUF] [--family mixtral|qwen3-moe|olmoe]
        [--batches 1,8,64] [--steps 4] [--json] [--quick]

Without `--model`, a tiny random model of `--family` (tests/tiny_families.py; needs transformers).
`--quick`: batches 1 and 64, two decode steps each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads

from servelab.core.sequence import SamplingParams  # noqa: E402
from servelab.cost import Roofline  # noqa: E402
from servelab.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from servelab.spec.hardware import get_hardware  # noqa: E402

PROMPT_TOKENS = 8


def decode_weight_bytes(engine: LLMEngine, batch: int, steps: int, seed: int) -> list[int]:
    """The weight bytes of each of `steps` decode steps of `batch` sequences (the engine's count)."""
    rng = random.Random(seed)
    vocab = engine.model_spec.vocab_size
    seqs = [
        engine.add_request(
            f"b{batch}-{i}",
            [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)],
            SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True),
        )
        for i in range(batch)
    ]
    engine.step()  # every prompt in one prefill step
    if any(len(s.output_token_ids) != 1 for s in seqs):
        raise RuntimeError(f"the {batch} prompts did not prefill in one step: raise max_num_batched_tokens")
    counted = []
    for _ in range(steps):
        engine.step()
        counted.append(engine.executor.model.step_weight_bytes())
    while engine.has_unfinished():
        engine.step()
    return counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF MoE directory or GGUF file (default: a tiny one)")
    parser.add_argument("--family", default="mixtral", help="the tiny model's family without --model")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    parser.add_argument("--steps", type=int, default=4, help="decode steps measured per batch size")
    parser.add_argument("--hardware", default="h100-sxm", help="the roofline's part (bytes do not depend on it)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 64, two steps each")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.steps = "1,64", 2
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.tiny_families import write_family

            model = str(write_family(Path(tmp) / args.family, args.family, seed=3))
        engine = LLMEngine.from_args(
            EngineArgs.from_kwargs(
                model=model,
                dtype="float32",
                max_num_seqs=max(batches),
                enable_prefix_caching=False,
                max_num_batched_tokens=max(2048, PROMPT_TOKENS * max(batches)),
            )
        )
        rows = _measure(engine, batches, args.steps, args.hardware)
        engine.close()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    spec = engine.model_spec
    print(
        f"{spec.name}: {spec.num_experts} experts, top-{spec.num_active_experts}, {spec.num_moe_layers} MoE layers "
        f"of {spec.num_layers}; float32 weights; MB = 1e6 bytes a decode step reads"
    )
    print("| batch | engine MB | dense MB | experts hit / MoE layer | roofline MB | roofline / engine |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['engine_bytes'] / 1e6:.3f} | {r['dense_bytes'] / 1e6:.3f} | "
            f"{r['experts_hit_per_layer']:.2f} | {r['roofline_bytes'] / 1e6:.3f} | {r['ratio']:.3f} |"
        )
    return 0


def _measure(engine: LLMEngine, batches: list[int], steps: int, hardware: str) -> list[dict]:
    spec, model = engine.model_spec, engine.executor.model
    if not spec.is_moe:
        raise SystemExit(f"{spec.name} is not a mixture of experts")
    roofline = Roofline(spec, get_hardware(hardware), weight_dtype="float32", kv_dtype="float32")
    total, dense = model.weight_bytes(), model.dense_weight_bytes()
    per_expert_layer = (total - dense) / (spec.num_moe_layers * spec.num_experts)
    rows = []
    for batch in batches:
        counted = decode_weight_bytes(engine, batch, steps, seed=batch)
        engine_bytes = sum(counted) / len(counted)
        predicted = roofline.decode(batch, PROMPT_TOKENS + 1).weight_bytes
        rows.append(
            {
                "batch": batch,
                "engine_bytes": engine_bytes,
                "dense_bytes": dense,
                "all_bytes": total,
                "experts_hit_per_layer": (engine_bytes - dense) / per_expert_layer / spec.num_moe_layers,
                "roofline_bytes": predicted,
                "ratio": predicted / engine_bytes,
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
