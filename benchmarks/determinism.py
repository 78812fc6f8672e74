"""How many greedy outputs change with what else the engine is doing, on the bundled model.

32 chat prompts ("Write a short paragraph about <topic>.", the bundled model's chat template)
each get 64 greedy tokens in four runs: each prompt alone (the reference), all 32 in one batch,
all 32 with prompts chunked by a 7-token budget, and all 32 in a KV pool so small that sequences
are preempted and recomputed; then the pressured run against the batched one.
Per run: how many of the 32 outputs differ in their tokens, how many in the bits of their
tokens' logprobs (a difference that has not flipped a token yet), preemptions, wall time.

    python benchmarks/determinism.py [--deterministic] [--dtype bfloat16] [--prompts 32] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import struct
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)

from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine


TOPICS = (
    "the sea",
    "a city at night",
    "bread",
    "the moon",
    "rivers",
    "old books",
    "trains",
    "winter",
    "bees",
    "mountains",
    "coffee",
    "a lighthouse",
    "rain",
    "chess",
    "gardens",
    "the desert",
    "music",
    "clocks",
    "a market",
    "birds",
    "bridges",
    "snow",
    "libraries",
    "the forest",
    "ships",
    "tea",
    "stars",
    "maps",
    "a village",
    "wind",
    "islands",
    "paper",
)


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [
        [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)
    ]
    return [tok.encode_prompt(tok.apply_chat_template(chat)) for chat in chats]  # as `servelab generate --chat`


def generate(engine: LLMEngine, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[list[tuple], int]:
    """Per prompt (its tokens, the bits of their logprobs), and the preemptions."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(f"{tag}-{i}", ids, params) for i, ids in enumerate(batch)]
    logprobs: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    outputs = [(tuple(s.output_token_ids), tuple(struct.pack("<f", x) for x in logprobs[s.request_id])) for s in seqs]
    return outputs, sum(s.num_preemptions for s in seqs)


def differ(outputs: list[tuple], reference: list[tuple]) -> dict[str, int]:
    return {
        "tokens": sum(a[0] != b[0] for a, b in zip(outputs, reference)),
        "logprob_bits": sum(a != b for a, b in zip(outputs, reference)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 20 tokens (a smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = 4, 20

    base = dict(model=args.model, dtype=args.dtype, deterministic=args.deterministic, max_model_len=512)
    runs = {
        "batched": dict(base),
        "chunked": dict(base, max_num_batched_tokens=7),
        # 48 blocks of 16 tokens hold ~8 of the 32 sequences at their full length: most are preempted
        # (--quick: 6 blocks, and each of the 4 sequences needs 4)
        "preempted": dict(
            base,
            num_blocks=6 if args.quick else 48,
            enable_prefix_caching=False,
            max_model_len=64 if args.quick else 512,
        ),
    }
    results: dict[str, dict] = {}
    t = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs.from_kwargs(**base))
    batch = prompts(engine, args.prompts)
    reference = [generate(engine, [ids], args.max_tokens, f"alone{i}")[0][0] for i, ids in enumerate(batch)]
    results["alone"] = {"tokens": 0, "logprob_bits": 0, "preemptions": 0, "seconds": round(time.perf_counter() - t, 1)}
    outputs = {}
    for name, kwargs in runs.items():
        t = time.perf_counter()
        engine = LLMEngine.from_args(EngineArgs.from_kwargs(**kwargs))
        outputs[name], preemptions = generate(engine, batch, args.max_tokens, name)
        results[name] = {
            **differ(outputs[name], reference),
            "preemptions": preemptions,
            "seconds": round(time.perf_counter() - t, 1),
        }
    results["preempted vs batched"] = differ(outputs["preempted"], outputs["batched"])
    if args.json:
        print(
            json.dumps(
                {"deterministic": args.deterministic, "dtype": args.dtype, "prompts": args.prompts, "runs": results}
            )
        )
        return
    print(
        f"{args.prompts} prompts x {args.max_tokens} greedy tokens, deterministic={args.deterministic}, dtype={args.dtype or 'default'}"
    )
    print(f"  {'run':22s} {'tokens differ':>13s} {'logprob bits differ':>19s}")
    for name, r in results.items():
        extra = f"  ({r['preemptions']} preemptions, {r['seconds']} s)" if "seconds" in r else ""
        ref = "batched" if "vs" in name else "alone"
        print(
            f"  {name:22s} {r['tokens']:6d} of {args.prompts:<3d} {r['logprob_bits']:12d} of {args.prompts:<3d} vs {ref}{extra}"
        )


if __name__ == "__main__":
    main()
