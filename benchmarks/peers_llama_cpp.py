"""llama.cpp (llama-cpp-python's low-level API) as a worker process of benchmarks/peers.py.

It runs in its own process so that its OpenMP threads and their wait policy are its own. It reads
one JSON request a line on stdin and answers one JSON line on stdout; the workloads (prompts,
lengths) come from peers.py, so the three engines run the very same token ids.

    {"op": "decode_b1", "prompt": [...], "new": 64}      -> batch-1 decode tok/s (prefill excluded)
    {"op": "decode_batch", "prompts": [[...], ...], "new": 128}
                                                          -> output tok/s, prefill included, all
                                                             sequences in one llama_decode a step
    {"op": "prefill", "prompt": [...]}                    -> prompt tok/s to the first token

Greedy sampling through llama.cpp's own greedy sampler; EOS is never checked (as ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp as ll

MAX_SEQS = 32
CTX_TOKENS = 8192  # one KV cache shared by all sequences (kv_unified): 32 x 160 tokens, or 512


class LlamaCpp:
    def __init__(self, model_path: str, threads: int) -> None:
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = CTX_TOKENS
        cparams.n_batch = CTX_TOKENS  # a whole 32-prompt prefill is one llama_decode call
        cparams.n_seq_max = MAX_SEQS
        cparams.n_threads = cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # else n_ctx is split evenly between the n_seq_max sequences
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = ll.llama_batch_init(CTX_TOKENS, 0, MAX_SEQS)
        self.sampler = ll.llama_sampler_init_greedy()

    def info(self) -> dict[str, object]:
        return {
            "version": getattr(ll, "__version__", "?"),
            "weight_bytes": int(ll.llama_model_size(self.model)),
            "system_info": ll.llama_print_system_info().decode(errors="replace").strip(),
        }

    def _clear(self) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, seq_id, wants_logits) rows."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(rows)} tokens")

    def _sample(self, index: int) -> int:
        return int(ll.llama_sampler_sample(self.sampler, self.ctx, index))

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """All prompts in one llama_decode; returns each one's first new token."""
        rows, last = [], []
        for seq, prompt in enumerate(prompts):
            rows += [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            last.append(len(rows) - 1)
        self._decode(rows)
        return [self._sample(i) for i in last]

    def decode_b1(self, prompt: list[int], new: int) -> float:
        self._clear()
        (token,) = self._prefill([prompt])
        t0 = time.perf_counter()
        for step in range(new):
            self._decode([(token, len(prompt) + step, 0, True)])
            token = self._sample(0)
        return new / (time.perf_counter() - t0)

    def decode_batch(self, prompts: list[list[int]], new: int) -> float:
        self._clear()
        t0 = time.perf_counter()
        tokens = self._prefill(prompts)
        for step in range(new - 1):
            self._decode([(tok, len(p) + step, seq, True) for seq, (tok, p) in enumerate(zip(tokens, prompts))])
            tokens = [self._sample(i) for i in range(len(prompts))]
        return len(prompts) * new / (time.perf_counter() - t0)

    def prefill(self, prompt: list[int]) -> float:
        self._clear()
        t0 = time.perf_counter()
        self._prefill([prompt])
        return len(prompt) / (time.perf_counter() - t0)


def serve(engine: LlamaCpp, lines, out) -> None:
    for line in lines:
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            return
        value = getattr(engine, op)(**req)
        out.write(json.dumps({"value": value}) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    # llama.cpp logs to stderr; stdout carries only the protocol.
    engine = LlamaCpp(args.model, args.threads)
    sys.stdout.write(json.dumps({"ready": engine.info()}) + "\n")
    sys.stdout.flush()
    serve(engine, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
