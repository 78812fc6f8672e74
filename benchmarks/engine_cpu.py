"""servelab's engine vs HF transformers on CPU, side by side in one run, on the bundled model
(or `--model`: an HF directory both load).

Three figures per engine, timed interleaved (servelab, HF, servelab, HF, ...) because the
machine is shared and noisy; we report medians and the ratios servelab / HF:

- decode_b1:   batch-1 decode tokens/s (after a 32-token prompt; prefill excluded)
- decode_b32:  total output tokens/s for 32 concurrent sequences of 128 new tokens each
               (prefill of the 32 prompts included, as a client would see it)
- prefill_512: prompt tokens/s for one 512-token prompt (time to the first token)

It also reports model bandwidth utilisation at batch 1: the bytes a decode step must read
(every weight once, plus the KV cache) / step time / the memory bandwidth measured here.

    python benchmarks/engine_cpu.py [--dtype bfloat16] [--rounds 3] [--json] [--quantization int8]
                                    [--kv-cache-dtype float16] [--model DIR] [--quick]

`--quantization int8` runs servelab with its opt-in int8 linears against HF in the same
--dtype: a different-numerics comparison, reported separately from the default one; so is
`--kv-cache-dtype float16` (servelab's KV cache in fp16 under fp32 compute; HF keeps --dtype).
`--deterministic` adds a third engine, servelab in deterministic mode (float32, its other flags
as given), interleaved with the others, and reports what the mode costs: its figures / servelab's.
`--exact` adds servelab with `--exact` the same way (what the default's int8 dot products over
the GGUF blocks gain over exact fp32: servelab / exact). `--dtype auto` runs servelab's default
(HF in float32). `--quick`: one round and a short bandwidth probe (with a tiny `--model`, a check that it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)
import torch

from servelab.core.sequence import SamplingParams
from servelab.engine.bundled import bundled_model_path
from servelab.runtime.host_probe import read_bandwidth_bytes_per_s
from servelab.engine.llm_engine import EngineArgs, LLMEngine

B1_PROMPT, B1_NEW = 32, 64
B32_SEQS, B32_PROMPT, B32_NEW = 32, 32, 128
PREFILL_LEN = 512


def prompt_ids(n: int, seed: int, vocab: int = 40000) -> list[int]:
    """n token ids below `vocab` (past the first 200, where special tokens sit), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(200, vocab // 2), vocab, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------- servelab


class Servelab:
    def __init__(
        self,
        dtype: str,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        deterministic: bool = False,
        model: str | None = None,
        exact: bool = False,
    ):
        self.name = "deterministic" if deterministic else "exact" if exact else "servelab"
        # Prefix caching off: every round reuses the same prompts and must not be served from cache.
        self.engine = LLMEngine.from_args(
            EngineArgs.from_kwargs(
                model=model,
                # both compute in fp32; "auto": the engine's default (fp32 on a CPU)
                dtype="float32" if deterministic or quantization else None if dtype == "auto" else dtype,
                enable_prefix_caching=False,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                deterministic=deterministic,
                exact=exact,
            )
        )
        self.model = self.engine.executor.model
        self.vocab = min(40000, self.engine.model_spec.vocab_size)  # prompt_ids' default on the bundled model
        self._n = 0

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        return prompt_ids(n, seed, self.vocab)

    def _run(self, prompts: list[list[int]], new_tokens: int):
        seqs = []
        now = time.perf_counter()
        for p in prompts:
            self._n += 1
            params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            seqs.append(self.engine.add_request(f"b{self._n}", p, params, arrival_s=now))
        while self.engine.has_unfinished():
            self.engine.step()
        return seqs, time.perf_counter() - now

    def decode_b1(self) -> float:
        (seq,), _ = self._run([self.prompt_ids(B1_PROMPT, 1)], B1_NEW + 1)
        t = seq.token_times_s
        return (len(t) - 1) / (t[-1] - t[0])

    def decode_b32(self) -> float:
        seqs, wall = self._run([self.prompt_ids(B32_PROMPT, 100 + i) for i in range(B32_SEQS)], B32_NEW)
        return sum(s.num_output_tokens for s in seqs) / wall

    def prefill_512(self) -> float:
        (seq,), _ = self._run([self.prompt_ids(PREFILL_LEN, 7)], 1)
        return PREFILL_LEN / (seq.first_token_s - seq.arrival_s)


# ------------------------------------------------------------------------------------- HF


class HF:
    name = "hf"

    def __init__(self, dtype: str, model: str | None = None):
        import transformers

        if model is None:
            path = bundled_model_path()
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
            ).eval()
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.vocab = min(40000, self.model.config.vocab_size)
        self.pad = 2

    def prompt_ids(self, n: int, seed: int) -> list[int]:
        return prompt_ids(n, seed, self.vocab)

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new: int) -> float:
        t = time.perf_counter()
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=self.pad,
        )
        return time.perf_counter() - t

    def decode_b1(self) -> float:
        ids = torch.tensor([self.prompt_ids(B1_PROMPT, 1)])
        mask = torch.ones_like(ids)
        # Decode alone: generating N+1 tokens minus generating 1 (the prefill and first token).
        t_all = self._generate(ids, mask, B1_NEW + 1)
        t_one = self._generate(ids, mask, 1)
        return B1_NEW / (t_all - t_one)

    def decode_b32(self) -> float:
        ids = torch.tensor([self.prompt_ids(B32_PROMPT, 100 + i) for i in range(B32_SEQS)])
        return B32_SEQS * B32_NEW / self._generate(ids, torch.ones_like(ids), B32_NEW)

    def prefill_512(self) -> float:
        ids = torch.tensor([self.prompt_ids(PREFILL_LEN, 7)])
        return PREFILL_LEN / self._generate(ids, torch.ones_like(ids), 1)


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "auto"],
        help="both engines' dtype; auto: servelab's default (float32 linears, int8 dot products over GGUF blocks "
        "for many rows), HF in float32",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both engines (default: torch's)")
    parser.add_argument("--only", default="decode_b1,decode_b32,prefill_512", help="comma-separated subset")
    parser.add_argument("--no-hf", action="store_true", help="servelab only (no ratios)")
    parser.add_argument("--json", action="store_true", help="print the raw figures as one JSON object on the last line")
    parser.add_argument(
        "--quantization",
        choices=["int8", "bf16"],
        default=None,
        help="servelab's opt-in int8 or bf16 linears (HF unchanged)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="servelab's KV cache storage (HF unchanged)",
    )
    parser.add_argument("--deterministic", action="store_true", help="also servelab in deterministic mode: its cost")
    parser.add_argument("--exact", action="store_true", help="also servelab with --exact: what the default gains")
    parser.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    parser.add_argument("--quick", action="store_true", help="one round, a short bandwidth probe")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    metrics = [m for m in args.only.split(",") if m]

    engines = [Servelab(args.dtype, args.quantization, args.kv_cache_dtype, model=args.model)]
    if args.deterministic:
        engines.append(
            Servelab(args.dtype, args.quantization, args.kv_cache_dtype, deterministic=True, model=args.model)
        )
    if args.exact:
        engines.append(Servelab(args.dtype, args.quantization, args.kv_cache_dtype, model=args.model, exact=True))
    engines += [] if args.no_hf else [HF("float32" if args.dtype == "auto" else args.dtype, args.model)]
    for e in engines:  # warm-up: first calls allocate, fault pages in and pick kernels
        e.decode_b1()
        e.prefill_512()
    bandwidth = read_bandwidth_bytes_per_s(1 << 28, 2) if args.quick else read_bandwidth_bytes_per_s()

    results: dict[str, dict[str, list[float]]] = {e.name: {m: [] for m in metrics} for e in engines}
    for r in range(args.rounds):
        for m in metrics:
            for e in engines if r % 2 == 0 else reversed(engines):  # alternate who goes first
                value = getattr(e, m)()
                results[e.name][m].append(value)
                print(f"round {r + 1} {m:12s} {e.name:9s} {value:9.1f} tok/s", file=sys.stderr)

    medians = {name: {m: statistics.median(v) for m, v in ms.items()} for name, ms in results.items()}
    ratios = {}
    if "hf" in medians:
        ratios = {m: medians["servelab"][m] / medians["hf"][m] for m in metrics}
    det_ratios = {}
    if "deterministic" in medians:
        det_ratios = {m: medians["deterministic"][m] / medians["servelab"][m] for m in metrics}

    model = engines[0].model
    step_bytes = model.weight_bytes()
    mbu = None
    if "decode_b1" in metrics:
        step_s = 1.0 / medians["servelab"]["decode_b1"]
        mbu = step_bytes / step_s / bandwidth

    quant = f", servelab quantization {args.quantization}" if args.quantization else ""
    quant += f", servelab KV cache {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    print(
        f"\nservelab engine vs HF transformers on CPU — {args.model or 'bundled SmolLM2-135M-Instruct'}, {args.dtype}{quant}, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds (medians)"
    )
    print(f"{'metric':14s} {'servelab':>12s} {'HF':>12s} {'ratio':>8s}")
    for m in metrics:
        hf = medians.get("hf", {}).get(m)
        print(
            f"{m:14s} {medians['servelab'][m]:10.1f}/s {'' if hf is None else f'{hf:10.1f}/s':>12s} "
            f"{'' if m not in ratios else f'{ratios[m]:7.2f}x':>8s}"
        )
    for m in det_ratios:
        print(f"{m:14s} deterministic {medians['deterministic'][m]:10.1f}/s = {det_ratios[m]:.2f}x servelab's")
    exact_ratios = {m: medians["servelab"][m] / medians["exact"][m] for m in metrics} if "exact" in medians else {}
    for m in exact_ratios:
        print(f"{m:14s} --exact {medians['exact'][m]:10.1f}/s; servelab = {exact_ratios[m]:.2f}x --exact")
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s; bytes per decode step: {step_bytes / 1e6:.0f} MB")
    if mbu is not None:
        print(f"model bandwidth utilisation at batch 1: {mbu * 100:.0f}%")
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} for both engines (one process; servelab sets PASSIVE unless set)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "dtype": args.dtype,
                    "quantization": args.quantization,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "threads": torch.get_num_threads(),
                    "rounds": args.rounds,
                    "servelab": medians["servelab"],
                    "hf": medians.get("hf"),
                    "ratios": ratios,
                    "deterministic": medians.get("deterministic"),
                    "deterministic_ratios": det_ratios,
                    "exact": medians.get("exact"),
                    "exact_ratios": exact_ratios,
                    "raw": results,
                    "bandwidth_bytes_per_s": bandwidth,
                    "decode_step_bytes": step_bytes,
                    "mbu_b1": mbu,
                    "load_average": list(os.getloadavg()),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
