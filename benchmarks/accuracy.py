"""Score each compute path of the engine against the exact fp32 reference, on a fixed text, by
llama.cpp's method (its `perplexity --kl-divergence`): KL divergence of each position's next-token
distribution from the reference's, top-1 agreement, and perplexity.

    python benchmarks/accuracy.py [--model PATH] [--tokens 20000] [--paths all] [--llama-cpp-python PY]
    python benchmarks/accuracy.py --quick          # a tiny random model, a few windows: a smoke test

The text is benchmarks/data/accuracy_text.txt: the first ~200 KB of Python 3.11's language
reference topics (the standard library's pydoc_data/topics.py; Python Software Foundation
License), shipped so every run scores the same tokens. It is cut into windows of --window tokens,
each run from an empty cache as one prefill; only each window's second half is scored, so every
scored token has at least half a window of context (as llama.cpp scores). --tokens is the number
of scored tokens.

Each path is an engine built with its flags (`LLM(model, **flags)`, what `servelab serve` would
load), and every window goes through the model's forward as one prefill step: the paths'
compute-bound kernels, where their numerics differ. llama.cpp (its Q8-quantized activations over
the same GGUF) is the yardstick: with --llama-cpp-python naming a Python with llama-cpp-python
installed (or SERVELAB_LLAMA_CPP_PYTHON set), a child process evaluates the same windows and
streams its logits back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from servelab import LLM
from servelab.engine.bundled import bundled_model_path
from servelab.runtime.kv_cache import PagedKVCache
from servelab.runtime.model import AttentionMetadata

TEXT = Path(__file__).parent / "data" / "accuracy_text.txt"
# name -> engine flags; "fp32" is the reference every other path is scored against.
PATHS: dict[str, dict] = {
    "fp32": {"exact": True},
    "default": {},  # int8 dot products over the GGUF blocks for many-row steps, a float16 KV cache
    "q8": {"kv_cache_dtype": "float32"},  # the default's int8 dot products alone
    "kv-fp16": {"exact": True, "kv_cache_dtype": "float16"},  # a 16-bit cache alone
    "kv-bf16": {"exact": True, "kv_cache_dtype": "bfloat16"},
    "quant-bf16": {"quantization": "bf16"},
    "quant-int8": {"quantization": "int8"},
    "dtype-bf16": {"dtype": "bfloat16"},
}
LLAMA_CPP = "llama.cpp"
BLOCK = 16


@dataclass
class Score:
    """Running sums over the scored positions of one path."""

    kl: list[float] = field(default_factory=list)
    top1_same: int = 0
    nll: float = 0.0
    n: int = 0
    seconds: float = 0.0

    def add(self, ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)
        self.kl += kl.tolist()
        self.top1_same += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        self.nll += float(-logp.gather(1, targets[:, None]).sum())
        self.n += targets.numel()

    def summary(self, ref_ppl: float | None) -> dict:
        kl = sorted(self.kl)
        ppl = math.exp(self.nll / self.n)
        out = {"tokens": self.n, "perplexity": ppl, "seconds": self.seconds}
        if kl and ref_ppl is not None:
            out.update(kl_mean=sum(kl) / len(kl), kl_median=kl[len(kl) // 2], kl_p99=kl[min(len(kl) - 1, int(0.99 * len(kl)))],
                       kl_max=kl[-1], top1_agreement=self.top1_same / self.n,
                       perplexity_delta_pct=100.0 * (ppl / ref_ppl - 1.0))  # fmt: skip
        return out


def window_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of `ids`, run from an empty cache as one prefill step."""
    model = llm.engine.executor.model
    n = len(ids)
    blocks = -(-n // BLOCK)
    groups = model.num_kv_groups  # a windowed model's KV groups: pages of their own each
    kv = PagedKVCache(model.config, blocks * groups, BLOCK, dtype=llm.engine.executor.kv_cache.dtype)
    metas = [
        AttentionMetadata(
            positions=torch.arange(n), slots=torch.arange(n) + g * blocks * BLOCK, num_decodes=0, block_size=BLOCK,
            decode_block_table=None, decode_ctx_lens=None, decode_max_ctx=0, decode_ctx_slots=None, decode_mask=None,
            prefills=[(0, n, 0, None)], logits_indices=torch.arange(n),
        )
        for g in range(groups)
    ]  # fmt: skip
    if groups > 1:
        metas[0].by_group = metas
    return model.forward(torch.tensor(ids), metas[0], kv.k_layers, kv.v_layers).float()


class LlamaCpp:
    """llama.cpp in a child process: token windows in (a JSON line each), fp32 logits out."""

    CHILD = r"""
import json, sys, struct
import numpy as np
from llama_cpp import Llama
path, n_ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=threads, verbose=False)
out = sys.stdout.buffer
out.write(struct.pack("<i", llm.n_vocab())); out.flush()
for line in sys.stdin:
    ids = json.loads(line)
    llm.reset()
    llm.eval(ids)
    out.write(np.ascontiguousarray(llm.scores[: len(ids)], dtype=np.float32).tobytes()); out.flush()
"""

    def __init__(self, python: str, model_path: str, window: int, threads: int):
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([python, "-c", self.CHILD, model_path, str(window), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdin is not None
        head = self.proc.stdout.read(4)
        if len(head) != 4:
            raise RuntimeError(f"llama.cpp's child process ended before it loaded {model_path}")
        (self.vocab,) = struct.unpack("<i", head)

    def logits(self, ids: list[int]) -> torch.Tensor:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(ids) + "\n").encode())
        self.proc.stdin.flush()
        size = len(ids) * self.vocab * 4
        buf = self.proc.stdout.read(size)
        if len(buf) != size:
            raise RuntimeError("llama.cpp's child process ended mid-window")
        return torch.frombuffer(bytearray(buf), dtype=torch.float32).view(len(ids), self.vocab)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run(model: str | None, path_names: list[str], tokens: int, window: int, llama_python: str | None,
        threads: int, quiet: bool = False) -> dict:  # fmt: skip
    torch.manual_seed(0)
    engines = {name: LLM(model, **PATHS[name]) for name in path_names}
    ref = engines["fp32"]
    text_ids = ref.tokenizer.encode(TEXT.read_text())
    half = window // 2
    n_windows = -(-tokens // half)
    if (n_windows + 1) * half > len(text_ids):
        raise SystemExit(f"accuracy: the text has {len(text_ids)} tokens, too few for {tokens} scored tokens")
    yard = LlamaCpp(llama_python, model or str(bundled_model_path()), window, threads) if llama_python else None
    names = path_names + ([LLAMA_CPP] if yard else [])
    scores = {name: Score() for name in names}
    for w in range(n_windows):
        ids = text_ids[w * half : w * half + window]
        targets = torch.tensor(ids[half + 1 :] + [text_ids[w * half + window]])
        ref_logp = None
        for name in names:
            t0 = time.perf_counter()
            logits = yard.logits(ids) if name == LLAMA_CPP else window_logits(engines[name], ids)
            scores[name].seconds += time.perf_counter() - t0
            logp = torch.log_softmax(logits[half:, : ref.engine.executor.model.vocab_size], dim=-1)
            if ref_logp is None:
                ref_logp = logp
            scores[name].add(ref_logp, logp, targets)
        if not quiet:
            print(f"window {w + 1}/{n_windows}", file=sys.stderr, flush=True)
    if yard:
        yard.close()
    ref_ppl = math.exp(scores["fp32"].nll / scores["fp32"].n)
    return {"text": TEXT.name, "window": window, "scored_tokens": scores["fp32"].n, "threads": threads,
            "paths": {name: {"flags": PATHS.get(name, {"engine": "llama-cpp-python, Q8 activations"}),
                             **scores[name].summary(None if name == "fp32" else ref_ppl)} for name in names}}  # fmt: skip


def table(result: dict) -> str:
    lines = [
        "| path | flags | mean KL | p99 KL | max KL | top-1 agreement | perplexity | Δ perplexity |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["paths"].items():
        flags = (
            " ".join(f"--{k.replace('_', '-')} {v}" for k, v in r["flags"].items())
            if name != LLAMA_CPP
            else "(its own)"
        )
        if "kl_mean" in r:
            lines.append(
                f"| {name} | {flags or '(default)'} | {r['kl_mean']:.6f} | {r['kl_p99']:.5f} | {r['kl_max']:.4f} | "
                f"{100 * r['top1_agreement']:.2f}% | {r['perplexity']:.4f} | {r['perplexity_delta_pct']:+.3f}% |"
            )
        else:
            lines.append(
                f"| {name} (reference) | {flags or '(default)'} | 0 | 0 | 0 | 100% | {r['perplexity']:.4f} | 0 |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--tokens", type=int, default=20000, help="scored tokens (default 20000)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window; its second half is scored")
    ap.add_argument("--paths", default="all", help=f"comma-separated among {', '.join(PATHS)} (fp32 is always run)")
    ap.add_argument(
        "--llama-cpp-python",
        default=os.environ.get("SERVELAB_LLAMA_CPP_PYTHON"),
        help="a Python with llama-cpp-python: score llama.cpp's path too (GGUF models only)",
    )
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--quick", action="store_true", help="a tiny random model (--model) and 64 scored tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    names = list(PATHS) if args.paths == "all" else ["fp32"] + [p for p in args.paths.split(",") if p and p != "fp32"]
    unknown = [p for p in names if p not in PATHS]
    if unknown:
        print(f"accuracy: unknown path(s) {', '.join(unknown)}; choose among {', '.join(PATHS)}", file=sys.stderr)
        return 2
    if args.quick:
        args.tokens, args.window = 64, 64
    result = run(args.model, names, args.tokens, args.window, args.llama_cpp_python, args.threads, quiet=args.json)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
