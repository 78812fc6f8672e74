"""Cost of grammar masks in a mixed batch: decode steps of N sequences, K of them constrained.

Each constrained row costs a matcher catch-up (one accepted token) and a bitmask fill per step;
unconstrained rows should pay nothing. The script times, on the same engine in one run:

- the sampler alone (random logits of the model's vocabulary): no hook, the hook with no
  constrained row, and the hook with K constrained rows;
- whole engine steps of the bundled model: N sequences decoding, 0 vs K constrained
  (a JSON schema that needs many tokens, so every timed step is masked).

Runs alternate between the variants and report medians, so machine noise hits them alike.

    .venv/bin/python benchmarks/structured_outputs.py [--seqs 32] [--constrained 4] [--steps 40] [--repeats 3] [--sampler-only]
                                                      [--model DIR] [--quick]

The bundled model unless `--model` names an HF directory; `--quick`: 4 sequences (2 constrained),
5 steps, one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelab.core.sequence import SamplingParams, Sequence
from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.engine.sampler import Sampler

# Forces long outputs: every timed step of a constrained row is inside the grammar.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 60}},
    "required": ["items"],
}


def spec() -> StructuredOutputSpec:
    return StructuredOutputSpec.json_schema(SCHEMA, "benchmark")


def params(constrained: bool, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True,
                          structured_output=spec() if constrained else None)  # fmt: skip


def time_sampler(engine: LLMEngine, n: int, k: int, steps: int) -> dict[str, float]:
    """Median ms per sample() call over random logits; constrained rows advance one token per call."""
    vocab = engine.vocab_size
    processors = engine.logits_processors
    seqs = {
        "no hook": (Sampler(0), [Sequence(f"a{i}", [1, 2], params(False, 10_000)) for i in range(n)]),
        "hook, 0 constrained": (
            Sampler(0, processors),
            [Sequence(f"b{i}", [1, 2], params(False, 10_000)) for i in range(n)],
        ),
        f"hook, {k} constrained": (
            Sampler(0, processors),
            [
                Sequence(f"c{i}", [1, 2], params(i < k, 10_000), eos_token_ids=engine.tokenizer.eos_token_ids)
                for i in range(n)
            ],
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in seqs}
    hook = f"  of which the hook, {k} rows"
    times[hook] = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits = torch.randn(n, vocab, generator=gen) * 3
        for name, (sampler, batch) in seqs.items():
            t0 = time.perf_counter()
            tokens, _ = sampler.sample(logits.clone(), batch)
            times[name].append(time.perf_counter() - t0)
            for s, t in zip(batch, tokens):
                s.token_ids.append(t)
        # The hook alone on the constrained batch (its matchers already saw this step's tokens).
        edited = logits.clone()
        t0 = time.perf_counter()
        processors.apply(edited, seqs[f"hook, {k} constrained"][1])
        times[hook].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def start_batch(engine: LLMEngine, n: int, k: int, max_tokens: int, tag: str) -> list[Sequence]:
    """N sequences (K constrained) admitted and prefilled: every later step is a pure decode step."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "List sixty fruits as JSON."}])
    seqs = [engine.add_request(f"{tag}-{i}", prompt, params(i < k, max_tokens)) for i in range(n)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    return seqs


def time_engine_steps(engines: dict[str, tuple[LLMEngine, int]], n: int, steps: int, tag: str) -> dict[str, float]:
    """Median ms per decode step of each engine; their steps alternate, so load changes hit both."""
    batches = {name: start_batch(engine, n, k, steps + 8, tag) for name, (engine, k) in engines.items()}
    durations: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, (engine, _) in engines.items():
            t0 = time.perf_counter()
            engine.step()
            durations[name].append(time.perf_counter() - t0)
    for name, (engine, _) in engines.items():
        for s in batches[name]:
            engine.abort(s.request_id)
        while engine.has_unfinished():
            engine.step()
    return {name: statistics.median(v) * 1e3 for name, v in durations.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--constrained", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampler-only", action="store_true", help="skip the engine steps (one model load, not two)")
    ap.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    ap.add_argument("--quick", action="store_true", help="4 sequences (2 constrained), 5 steps, one repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.constrained, args.steps, args.repeats = 4, 2, 5, 1
    n, k = args.seqs, args.constrained

    def load() -> LLMEngine:
        engine = LLMEngine.from_args(
            EngineArgs.from_kwargs(model=args.model, dtype="float32", max_num_seqs=n, max_model_len=1024)
        )
        engine.prepare_logits_processors(params(True, 1))  # xgrammar import and compile: not per step
        return engine

    # Two engines (the same model twice), so that their steps can alternate.
    first = load()
    print(f"{n} sequences, {k} constrained; torch threads {torch.get_num_threads()}")
    sampler_runs = [time_sampler(first, n, k, args.steps) for _ in range(args.repeats)]
    print("sampler.sample() on random logits, median ms per call:")
    for name in sampler_runs[0]:
        print(f"  {name:28s} {statistics.median(run[name] for run in sampler_runs):8.2f}")
    if args.sampler_only:
        return
    engines = {"0 constrained": (first, 0), f"{k} constrained": (load(), k)}
    step_runs = [time_engine_steps(engines, n, args.steps, f"r{r}") for r in range(args.repeats)]
    print("engine decode step (forward + sample), median ms:")
    base = statistics.median(run["0 constrained"] for run in step_runs)
    for name in step_runs[0]:
        med = statistics.median(run[name] for run in step_runs)
        print(
            f"  {name:24s} {med:8.2f}  ({med / base:.3f}x)  runs: {', '.join(f'{run[name]:.1f}' for run in step_runs)}"
        )


if __name__ == "__main__":
    main()
