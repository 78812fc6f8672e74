"""Speculative decoding's TPOT at batch 1 on an edit workload, on the bundled model.

Each prompt gives the model a short text and asks it to reproduce it with one small edit (the
workload prompt lookup exists for: the answer copies the prompt). Every prompt runs greedy,
alone, once without speculation and once with `--speculative-config` n-gram lookup, the two
interleaved (plain, speculative, plain, ...) so that a neighbour's load on a shared machine hits
both alike. TPOT = (last token's time - first token's) / (tokens - 1), per request; the table
gives medians, the speedup (plain TPOT / speculative TPOT), the acceptance rate and tokens per
verification step, and checks that both runs produced the same tokens.

`--server` measures through `servelab serve` instead: two servers (plain, and with the flag)
take the same chat requests, streamed, one at a time, interleaved; TPOT is then the client's:
(last content chunk's arrival - first's) / (completion tokens - 1), and the texts are compared.

    python benchmarks/spec_decode.py [--model PATH] [--k 3] [--prompt-lookup-max 4] [--max-tokens 128]
                                     [--repeats 3] [--deterministic] [--server] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)

from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine

TEXTS = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the reading room, the children's corner and a small cafe, and to "
    "postpone the roof repairs until the spring.",
    "To make the bread, mix the flour, the water and the salt in a large bowl. Leave the dough to rest "
    "for an hour, fold it twice, then shape it into a round loaf and bake it in a hot oven for forty "
    "minutes.",
    "The train leaves the station at seven in the morning and reaches the coast before noon. Passengers "
    "who travel with bicycles should book a place in advance, because the last carriage has only six "
    "hooks.",
    "Our team shipped the new search page last week. Queries are faster, results show the price and the "
    "stock of each item, and the filters remember the choices of the last visit.",
)
EDITS = ("Replace 'Tuesday' with 'Friday'.", "Replace 'forty' with 'fifty'.", "Replace 'six' with 'eight'.",
         "Replace 'last week' with 'yesterday'.")  # fmt: skip


def chats(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Rewrite this text exactly, with one edit. {EDITS[i % len(EDITS)]}\n\n"
                                     f"{TEXTS[i % len(TEXTS)]}"}]
        for i in range(n)
    ]  # fmt: skip


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode_prompt(tok.apply_chat_template(chat)) for chat in chats(n)]


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int, tag: str) -> tuple[list[int], float]:
    """The request's output tokens and its TPOT in seconds."""
    seq = engine.add_request(tag, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished():
        engine.step()
    times = seq.token_times_s
    # several tokens of one verification step share its time: TPOT is over the request's decode
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return list(seq.output_token_ids), tpot


def start_server(model: str | None, extra: list[str], log_dir: str) -> tuple[subprocess.Popen, str]:
    """`servelab serve --port 0`: the port comes from its log; returns once /health answers."""
    import httpx

    log_path = os.path.join(log_dir, f"server-{time.monotonic_ns()}.log")
    cmd = [sys.executable, "-m", "servelab", "serve", "--port", "0", "--no-access-log", "--no-lab",
           "--max-model-len", "1024", *(["--model", model] if model else []), *extra]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", open(log_path, errors="replace").read())
        if match:
            try:
                if httpx.get(match.group(1) + "/health", timeout=2).status_code == 200:
                    return proc, match.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in 300 s")


def served_one(url: str, chat: list[dict[str, str]], max_tokens: int) -> tuple[str, float]:
    """The streamed text and the client's TPOT in seconds."""
    import httpx

    body = {"messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, times, tokens = "", [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                text += event["choices"][0]["delta"]["content"]
                times.append(time.perf_counter())
    return text, (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and len(times) > 1 else 0.0


def measure_served(args: argparse.Namespace, spec: dict) -> tuple[dict[str, list[float]], int, dict]:
    """TPOTs through two servers, interleaved; the outputs that differ; the spec server's counters."""
    import httpx

    batch = chats(args.prompts)
    flags = ["--deterministic"] if args.deterministic else []
    with tempfile.TemporaryDirectory() as log_dir:
        servers = {"plain": start_server(args.model, flags, log_dir),
                   "ngram": start_server(args.model, [*flags, "--speculative-config", json.dumps(spec)], log_dir)}  # fmt: skip
        try:
            for _, url in servers.values():
                served_one(url, batch[0], 4)  # warm-up
            tpots: dict[str, list[float]] = {"plain": [], "ngram": []}
            mismatches = 0
            for _ in range(args.repeats):
                for chat in batch:
                    want, t_plain = served_one(servers["plain"][1], chat, args.max_tokens)
                    got, t_spec = served_one(servers["ngram"][1], chat, args.max_tokens)
                    tpots["plain"].append(t_plain)
                    tpots["ngram"].append(t_spec)
                    mismatches += got != want
            metrics = httpx.get(servers["ngram"][1] + "/metrics", timeout=10).text
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
    counters = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        match = re.search(rf"^servelab:spec_decode_{name}_total{{[^}}]*}} ([\d.e+]+)$", metrics, re.M)
        counters[name] = float(match.group(1)) if match else 0.0
    return tpots, mismatches, counters


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the bundled model)")
    ap.add_argument(
        "--k",
        type=int,
        default=4,
        help="num_speculative_tokens (4: the fastest on this edit workload, docs/benchmarks.md)",
    )
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every prompt")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--server", action="store_true", help="measure through `servelab serve` (streamed chats)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, 1 round (a smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.repeats = 2, 16, 1
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}  # fmt: skip
    if args.server:
        tpots, mismatches, served = measure_served(args, spec)
        drafts, draft_tokens, accepted = (served[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    else:
        tpots, mismatches, (drafts, draft_tokens, accepted) = measure_engine(args, spec)
    median = {name: statistics.median(v) for name, v in tpots.items()}
    report = {
        "config": spec,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "deterministic": args.deterministic,
        "through": "servelab serve" if args.server else "the engine",
        "tpot_ms": {name: v * 1e3 for name, v in median.items()},
        "speedup": median["plain"] / median["ngram"] if median["ngram"] > 0 else 0.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "tokens_per_verification": (accepted + drafts) / drafts if drafts else 0.0,
        "outputs_differing": mismatches,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"edit workload through {report['through']}, batch 1, {args.prompts} prompts x {args.repeats} "
              f"interleaved rounds, "
              f"{args.max_tokens} greedy tokens; ngram K={args.k} lookup {args.prompt_lookup_min}-"
              f"{args.prompt_lookup_max}")  # fmt: skip
        print(f"{'run':<8} {'TPOT ms (median)':>18}")
        for name, v in median.items():
            print(f"{name:<8} {v * 1e3:>18.2f}")
        print(f"speedup {report['speedup']:.2f}x")
        print(f"acceptance {report['acceptance_rate']:.1%}, {report['tokens_per_verification']:.2f} tokens per "
              f"verification step; outputs differing: {mismatches}")  # fmt: skip
    return report


def measure_engine(args: argparse.Namespace, spec: dict) -> tuple[dict[str, list[float]], int, tuple[int, int, int]]:
    """TPOTs through two engines in this process, interleaved; the outputs that differ; the
    spec engine's (drafts, draft tokens, accepted) over the measured requests."""
    common = {"model": args.model, "deterministic": args.deterministic, "max_model_len": 1024}
    plain = LLMEngine.from_args(EngineArgs.from_kwargs(**common))
    fast = LLMEngine.from_args(EngineArgs.from_kwargs(speculative_config=json.dumps(spec), **common))
    batch = prompts(plain, args.prompts)
    run_one(plain, batch[0], 4, "warm-plain")  # first-step costs (allocations, kernel loads) out of the figures
    run_one(fast, batch[0], 4, "warm-spec")
    c = fast.scheduler.spec_counters
    before = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
    tpots: dict[str, list[float]] = {"plain": [], "ngram": []}
    mismatches = 0
    for r in range(args.repeats):
        for i, prompt in enumerate(batch):
            want, t_plain = run_one(plain, prompt, args.max_tokens, f"p{r}-{i}")
            got, t_spec = run_one(fast, prompt, args.max_tokens, f"s{r}-{i}")
            tpots["plain"].append(t_plain)
            tpots["ngram"].append(t_spec)
            mismatches += got != want
    after = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
    return tpots, mismatches, tuple(a - b for a, b in zip(after, before))


if __name__ == "__main__":
    main()
