"""`servelab calibrate --base-url`: a step-cost profile of any OpenAI-compatible server (vLLM,
SGLang, llama.cpp, servelab), fitted from the outside, over HTTP only.

The experiment (every prompt unique, so no prefix cache helps; each point repeated over
interleaved, shuffled passes, and the median taken):
- the client's round trip, from GET /v1/models, kept apart from the server's time;
- single-request prefills over prompt lengths L: TTFT(L) gives the step's fixed cost, the
  prefill cost curve, and the server's chunk budget, which shows as a step's fixed cost added
  each time L crosses a multiple of it (lengths sit just under and just over each candidate);
- decode bursts: B streamed requests sent together at two prompt lengths. Once the whole
  first wave has its first token and until the first one ends, every step is a decode-only step
  of that wave: its token rate gives the step time at batch B and that context. The size of the
  wave (the requests whose first token came before any request ended) is the server's sequence
  limit when it is below B.
The server's /metrics (servelab's or vLLM's info gauges) give its settings exactly where it
exports them; otherwise they are inferred, each with its source and confidence.

Each measured point is appended to a partial-results file as it completes, so an interrupted run
resumes where it stopped (`--resume`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.bench.client import BenchRequest, OpenAIStreamClient, StreamResult
from servelab.bench.prompts import PromptBuilder
from servelab.cost.profile import NO_KERNEL_ROWS, PROFILE_FORMAT, PROFILE_VERSION, TERMS, KernelRows, features, fit_rows
from servelab.errors import InvalidArgument, ServelabError
from servelab.workload.spec import RequestSpec

# Chunk budgets a server may run with: prompts sit just under and just over each one up to the
# longest prompt, so a chunk boundary shows as a jump between two neighbouring lengths.
CHUNK_CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
# A chunk budget is reported only when it beats "no chunking" by this share of the prefill error,
# and by a point at least (at 2% errors a third less is noise).
CHUNK_MIN_GAIN = 0.2
# A decode kernel switch is kept only when it takes the decode points' mean error under 60% of it.
SWITCH_MIN_GAIN = 0.6
BURST_OUTPUT_TOKENS = 32
# Decode bursts at these prompt lengths and at the longest prompt less the output, so that the
# context slope is measured across the contexts a served load reaches, not extrapolated.
BURST_PROMPT_LENS = (64, 320)
RTT_SAMPLES = 10
DEFAULT_REPEATS = 3
CV_FOLDS = 5  # the held-out error: each point priced by a fit without its fold


@dataclass(frozen=True, slots=True)
class Design:
    """The points of one pass: single-request prefills, (batch, prompt length) bursts, and
    (batch, prompt length) joins: a prompt sent into a decoding burst, whose steps mix the two."""

    prefill_lens: tuple[int, ...]
    bursts: tuple[tuple[int, int], ...]
    joins: tuple[tuple[int, int], ...] = ()
    burst_output: int = BURST_OUTPUT_TOKENS
    repeats: int = DEFAULT_REPEATS

    def points(self) -> list[tuple[str, int, int]]:
        return (
            [("prefill", 1, n) for n in self.prefill_lens]
            + [("burst", b, n) for b, n in self.bursts]
            + [("join", b, n) for b, n in self.joins]
        )


def make_design(max_prompt: int, max_batch: int, max_burst_tokens: int, repeats: int = DEFAULT_REPEATS) -> Design:
    """Prompt lengths from 16 to `max_prompt`, two each side of every chunk candidate below it; bursts
    at batch 1, 2, 4 ... `max_batch` for each burst prompt length (and the longest prompt less the
    output), up to `max_burst_tokens` prompt tokens a burst."""
    if max_prompt < 32:
        raise InvalidArgument(f"--max-prompt-tokens must be >= 32, got {max_prompt}")
    # A burst's prompt and its outputs fit the context, as max_prompt and one output token do.
    burst_cap = max_prompt + 1 - BURST_OUTPUT_TOKENS
    if burst_cap < 16:
        raise InvalidArgument(
            f"calibrating needs prompts of up to {15 + BURST_OUTPUT_TOKENS} tokens or more (its bursts run 16-token "
            f"prompts and {BURST_OUTPUT_TOKENS} output tokens); --max-prompt-tokens and the server's context allow "
            f"{max_prompt}"
        )
    lens = {16, 32, max_prompt}
    for c in CHUNK_CANDIDATES:
        if c + c // 4 <= max_prompt:
            lens |= {c - c // 4, c - c // 8, c + c // 8, c + c // 4}
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch] or [1]
    if max_batch not in batches and max_batch > 1:
        batches.append(max_batch)
    longest = min(max(64, max_prompt - BURST_OUTPUT_TOKENS), burst_cap)
    prompt_lens = sorted({min(n, burst_cap) for n in BURST_PROMPT_LENS} | {longest})
    bursts = tuple((b, n) for n in prompt_lens for b in batches if b * n <= max_burst_tokens or b == 1)
    join_batches = sorted({min(2, max_batch), max(1, max_batch // 4)})
    # a join's decodes run BURST_PROMPT_LENS[0] prompt tokens and twice the bursts' outputs
    room = max_prompt + 1 >= BURST_PROMPT_LENS[0] + 2 * BURST_OUTPUT_TOKENS
    joins = tuple((b, n) for b in join_batches for n in sorted({min(128, max_prompt), max(32, max_prompt // 2)})
                  if room)  # fmt: skip
    return Design(tuple(sorted(lens)), bursts, joins, repeats=repeats)


# ---- the server: what it says about itself --------------------------------------------------


@dataclass(slots=True)
class ServerInfo:
    base_url: str
    model: str
    kind: str  # servelab, vllm, sglang, llama.cpp, unknown
    version: str | None
    max_model_len: int | None
    config: dict[str, str]  # the scheduler settings /metrics exports (fidelity.server_config)
    metrics: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "kind": self.kind,
            "version": self.version,
            "max_model_len": self.max_model_len,
            "metrics": self.metrics,
        }


async def _get_json(client: OpenAIStreamClient, url: str, body: dict[str, Any] | None = None) -> Any:
    """GET url (POST body, where given) and its JSON, or None: any failure here only means
    "this server does not say"."""
    try:
        async with asyncio.timeout(10.0):
            call = client._http().get(url) if body is None else client._http().post(url, json=body)
            async with call as response:
                if response.status != 200:
                    return None
                return await response.json(content_type=None)
    except Exception:  # noqa: BLE001 - TimeoutError, connection errors, bodies that are not JSON
        return None


def _kind(metrics_text: str | None, models: Any, version: Any) -> str:
    text = metrics_text or ""
    if "servelab:" in text or (isinstance(version, dict) and "servelab" in json.dumps(version).lower()):
        return "servelab"
    if "vllm:" in text:
        return "vllm"
    if "sglang:" in text:
        return "sglang"
    if "llamacpp:" in text:
        return "llama.cpp"
    owned = (
        {str(m.get("owned_by", "")) for m in (models or {}).get("data", []) if isinstance(m, dict)}
        if isinstance(models, dict)
        else set()
    )
    if "vllm" in owned:
        return "vllm"
    if "sglang" in owned:
        return "sglang"
    if "llamacpp" in owned or "me" in owned:  # llama.cpp's server, llama-cpp-python's
        return "llama.cpp"
    return "unknown"


async def probe(client: OpenAIStreamClient) -> ServerInfo:
    """What the server says about itself: /v1/models, /version, /metrics."""
    from servelab.bench.fidelity import server_config

    names = await client.list_models()
    if not names and client.model is None:
        raise ServelabError(f"the server at {client.base_url} lists no model at /v1/models; name one with --model")
    model = client.model or names[0]
    client.model = model
    root = client.base_url.removesuffix("/v1")
    models = await _get_json(client, client.base_url + "/models")
    version = await _get_json(client, root + "/version")
    metrics_text = await client.metrics_text()
    max_len = None
    for card in (models or {}).get("data", []) if isinstance(models, dict) else []:
        if isinstance(card, dict) and card.get("id") == model:
            value = card.get("max_model_len") or (card.get("meta") or {}).get("n_ctx_train")
            max_len = int(value) if isinstance(value, int) and value > 0 else None
    config = server_config(metrics_text)
    if max_len is None and config.get("max_model_len", "").isdigit():
        max_len = int(config["max_model_len"])
    ver = version.get("version") if isinstance(version, dict) else None
    return ServerInfo(
        client.base_url,
        model,
        _kind(metrics_text, models, version),
        None if ver is None else str(ver),
        max_len,
        config,
        metrics_text is not None,
    )


# ---- measuring --------------------------------------------------------------------------------


@dataclass(slots=True)
class Results:
    """Every measured point (one JSON object a line in `path`, appended as each completes)."""

    path: str | None
    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def resume(cls, path: str, server: ServerInfo) -> Results:
        """The points an earlier run against the same server and model saved at `path`."""
        out = cls(path)
        try:
            with open(path, encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return out
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"--resume: cannot read {path} ({exc})") from None
        head = lines[0] if lines else {}
        if (
            head.get("phase") != "header"
            or head.get("model") != server.model
            or head.get("base_url") != server.base_url
        ):
            raise InvalidArgument(
                f"--resume: {path} holds another run's points (another server or model); "
                "remove it or leave out --resume"
            )
        out.records = lines[1:]
        return out

    def start(self, server: ServerInfo) -> None:
        if self.path is not None and not self.records:
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"phase": "header", "model": server.model, "base_url": server.base_url}) + "\n")

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def done(self, phase: str, batch: int, target: int, repeat: int) -> bool:
        return any(r["phase"] == phase and r.get("batch") == batch and r.get("target") == target
                   and r.get("repeat") == repeat for r in self.records)  # fmt: skip

    def of(self, phase: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["phase"] == phase]


class Prober:
    """Sends the experiment's requests, each prompt unique (a fresh seed per request)."""

    def __init__(self, client: OpenAIStreamClient, prompts: PromptBuilder, seed: int) -> None:
        self.client = client
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.count_path: str | None = None  # the server's tokenize route, once found
        self.scale = 1.0  # the server's tokens per client token (the client may not have its tokenizer)

    async def match_tokenizer(self, sample_tokens: int = 256) -> dict[str, Any]:
        """Learns how many of the server's tokens a client token is, from one prompt (also the
        server's warm-up), so that the lengths asked for are the server's; and whether the server
        counts a prompt's tokens for us (a tokenize route), which makes every length exact."""
        request, result = await self.one(sample_tokens, 1)
        if not result.success:
            raise ServelabError(f"the server refused a {sample_tokens}-token prompt: {result.error}")
        n, source = await self.prompt_tokens(result, request.prompt)
        self.scale = n / self.prompts.count_tokens(request.prompt)
        if self.count_path is None:
            await self.server_count(request.prompt)
        return {
            "server_tokens_per_client_token": self.scale,
            "tokens_from": source,
            "exact_lengths": self.count_path is not None,
            "tokenize_route": self.count_path,
        }

    async def server_count(self, prompt: str) -> int | None:
        """The prompt's length in the server's tokens from its tokenize route (vLLM's, SGLang's and
        servelab's /tokenize, llama-cpp-python's /extras/tokenize), or None where it has none."""
        root = self.client.base_url.removesuffix("/v1")
        for route in [self.count_path] if self.count_path else ["/tokenize", "/extras/tokenize"]:
            body = {"model": self.client.model, "prompt": prompt, "input": prompt, "content": prompt}
            data = await _get_json(self.client, root + route, body)
            if isinstance(data, dict):
                n = data.get("count") if isinstance(data.get("count"), int) else None
                if n is None and isinstance(data.get("tokens"), list):
                    n = len(data["tokens"])
                if n is not None:
                    self.count_path = route
                    return n
        return None

    async def rtt_s(self, n: int = RTT_SAMPLES) -> list[float]:
        """Round trips of GET /v1/models: the network and HTTP cost outside the server's engine."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            if await _get_json(self.client, self.client.base_url + "/models") is not None:
                out.append(time.perf_counter() - t0)  # a failed or timed-out GET times nothing
        return out

    def request(self, prompt_tokens: int, output_tokens: int) -> BenchRequest:
        spec = RequestSpec(
            index=self.rng.getrandbits(40),
            arrival_s=None,
            prompt_tokens=max(1, round(prompt_tokens / self.scale)),
            output_tokens=output_tokens,
        )
        return BenchRequest(spec.index, self.prompts.prompt_for(spec, self.rng.getrandbits(30) + 1), prompt_tokens,
                            output_tokens)  # fmt: skip

    async def prompt_tokens(self, result: StreamResult, prompt: str) -> tuple[int, str]:
        """The prompt's length in the server's tokens, and where it came from: the server's usage,
        its tokenize route, or the client's own tokenizer."""
        if result.usage_prompt_tokens is not None:
            return result.usage_prompt_tokens, "usage"
        if (n := await self.server_count(prompt)) is not None:
            return n, "tokenize"
        return self.prompts.count_tokens(prompt), "client"

    async def exact(self, prompt_tokens: int, output_tokens: int) -> BenchRequest:
        """A request whose prompt is `prompt_tokens` of the server's tokens where its tokenize route
        can tell (a few tries, each rescaled by the last miss), else as near as the scale gives."""
        request = self.request(prompt_tokens, output_tokens)
        if self.count_path is None:
            return request
        ask = prompt_tokens
        for _ in range(4):
            n = await self.server_count(request.prompt)
            if n is None or abs(n - prompt_tokens) <= max(1, prompt_tokens // 100):
                break
            ask = max(1, round(ask * prompt_tokens / n))
            request = self.request(ask, output_tokens)
        return request

    async def one(self, prompt_tokens: int, output_tokens: int) -> tuple[BenchRequest, StreamResult]:
        """One request; another prompt where the answer carried no text (a token that decodes to
        nothing gives the client no time for it), up to three tries."""
        for _ in range(3):
            request = await self.exact(prompt_tokens, output_tokens)
            result = await self.client.stream(request)
            if result.success or not (result.error or "").startswith("empty response"):
                break
        return request, result

    async def prefill(self, target: int, repeat: int) -> dict[str, Any]:
        request, result = await self.one(target, 1)
        if not result.success or result.first_token_s is None:
            raise ServelabError(f"a {target}-token prompt failed: {result.error}")
        n, source = await self.prompt_tokens(result, request.prompt)
        return {
            "phase": "prefill",
            "batch": 1,
            "target": target,
            "repeat": repeat,
            "prompt_tokens": n,
            "tokens_from": source,
            "ttft_s": result.first_token_s - result.send_s,
        }

    async def burst(self, batch: int, target: int, output: int, repeat: int) -> dict[str, Any]:
        pairs = await asyncio.gather(*(self.one(target, output) for _ in range(batch)))
        failed = [r.error for _, r in pairs if not r.success]
        if failed:
            raise ServelabError(
                f"a burst of {batch} requests of {target} tokens had {len(failed)} failures: {failed[0]}"
            )
        _, requests = await self.streams(pairs)
        return {"phase": "burst", "batch": batch, "target": target, "repeat": repeat, "requests": requests}

    async def streams(self, pairs: Sequence[tuple[BenchRequest, StreamResult]]) -> tuple[float, list[dict[str, Any]]]:
        """The first send time and each stream's record, its times from that send."""
        t0 = min(r.send_s for _, r in pairs)
        requests = []
        for request, r in pairs:
            n, source = await self.prompt_tokens(r, request.prompt)
            requests.append(
                {
                    "prompt_tokens": n,
                    "tokens_from": source,
                    "send_s": r.send_s - t0,
                    "output_tokens": r.usage_output_tokens or len(r.token_times_s),
                    "chunk_times_s": [t - t0 for t in r.token_times_s],
                }
            )
        return t0, requests

    async def join(self, batch: int, target: int, output: int, repeat: int) -> dict[str, Any]:
        """`batch` decoding requests (64-token prompts), joined once all are decoding by one
        `target`-token prompt: the steps that prefill it carry the batch's decodes too."""
        started: list[float] = []
        everyone = asyncio.Event()

        def first(now: float) -> None:
            started.append(now)
            if len(started) == batch:
                everyone.set()

        async def decode() -> tuple[BenchRequest, StreamResult]:
            request = await self.exact(BURST_PROMPT_LENS[0], output)
            return request, await self.client.stream(request, on_first_token=first)

        tasks = [asyncio.ensure_future(decode()) for _ in range(batch)]
        try:
            await asyncio.wait_for(everyone.wait(), self.client.timeout_s)
        except TimeoutError:
            pass  # a server that runs fewer at once: the joiner comes after the wave, no mixed step
        await asyncio.sleep(max(0.02, 0.25 * (max(started, default=0.0) - min(started, default=0.0))))
        joiner, joined = await self.one(target, 1)
        pairs = await asyncio.gather(*tasks)
        failed = [r.error for _, r in [*pairs, (joiner, joined)] if not r.success]
        if failed:
            raise ServelabError(f"a join of a {target}-token prompt into {batch} decodes failed: {failed[0]}")
        t0, requests = await self.streams(pairs)
        n, _ = await self.prompt_tokens(joined, joiner.prompt)
        assert joined.first_token_s is not None
        return {
            "phase": "join",
            "batch": batch,
            "target": target,
            "repeat": repeat,
            "requests": requests,
            "joiner": {"prompt_tokens": n, "send_s": joined.send_s - t0, "first_s": joined.first_token_s - t0},
        }


async def measure(
    prober: Prober,
    design: Design,
    results: Results,
    budget_s: float,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Runs the design's passes (each in a new shuffled order) until every point has its repeats or
    the budget is spent, saving each point as it completes. Returns what happened."""
    t0 = time.perf_counter()
    tokenizer = await prober.match_tokenizer()
    if not results.of("rtt"):
        results.add({"phase": "rtt", "batch": 0, "target": 0, "repeat": 0, "samples_s": await prober.rtt_s()})
    todo = [(phase, b, n, rep) for rep in range(design.repeats) for phase, b, n in design.points()]
    total, stopped = len(todo), None
    order = random.Random(0x5EED)
    done_before = sum(results.done(*t) for t in todo)
    finished = done_before
    for rep in range(design.repeats):
        points = design.points()
        order.shuffle(points)
        for phase, b, n in points:
            if results.done(phase, b, n, rep):
                continue
            if time.perf_counter() - t0 > budget_s:
                stopped = f"the budget ({budget_s:g} s) ran out after {finished} of {total} points"
                break
            left = budget_s - (time.perf_counter() - t0)
            try:
                async with asyncio.timeout(max(left, 1.0) + 60.0):
                    record = await (prober.prefill(n, rep) if phase == "prefill"
                                    else prober.burst(b, n, design.burst_output, rep) if phase == "burst"
                                    else prober.join(b, n, 2 * design.burst_output, rep))  # fmt: skip
            except TimeoutError:
                stopped = f"a {phase} point (batch {b}, {n} tokens) ran past the budget"
                break
            results.add(record)
            finished += 1
            if progress is not None:
                progress(f"{phase} b={b} L={n}", finished, total)
        if stopped:
            break
    return {
        "points": total,
        "measured": finished,
        "resumed": done_before,
        "wall_s": time.perf_counter() - t0,
        "stopped": stopped,
        "tokenizer": tokenizer,
    }


# ---- from measurements to observations of steps ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """One timed quantity as a sum of steps: its row of TERMS' columns and the seconds measured."""

    kind: str  # "prefill" or "decode"
    label: str
    row: tuple[float, ...]
    time_s: float
    detail: dict[str, Any]


def prefill_row(n: int, chunk: int | None, rows: KernelRows = NO_KERNEL_ROWS) -> list[float]:
    """The steps of one n-token prompt alone, chunked by `chunk` tokens (None: one step), summed."""
    row = [0.0] * len(TERMS)
    done = 0
    while done < n:
        t = n - done if chunk is None else min(chunk, n - done)
        c = done + t
        pairs = t * c - t * (t - 1) // 2
        for i, v in enumerate(features(t, 1, c, pairs, rows)):
            row[i] += v
        done = c
    return row


def short_outputs(results: Results, output_tokens: int) -> int:
    """Burst requests that ended before `output_tokens`: a server that does not honour ignore_eos."""
    return sum(1 for r in results.of("burst") for q in r["requests"] if q["output_tokens"] < output_tokens)


def decode_window(burst: dict[str, Any]) -> dict[str, Any] | None:
    """The burst's decode-only stretch: from the last first token of the first wave (the requests
    that had a token before any request ended) to the first end. Returns the wave's size, the step
    time (the median over the wave of its seconds per token in the stretch) and the mean context,
    or None where the stretch holds fewer than 3 chunks of a request."""
    reqs = [r for r in burst["requests"] if r["chunk_times_s"]]
    if not reqs:
        return None
    first_end = min(r["chunk_times_s"][-1] for r in reqs)
    wave = [r for r in reqs if r["chunk_times_s"][0] <= first_end]
    start = max(r["chunk_times_s"][0] for r in wave)
    per_token, contexts = [], []
    for r in wave:
        times = r["chunk_times_s"]
        per_chunk = max(1.0, r["output_tokens"] / len(times))  # a server may stream tokens several a chunk
        inside = [i for i, t in enumerate(times) if start <= t <= first_end]
        if len(inside) < 3:
            continue
        i, j = inside[0], inside[-1]
        per_token.append((times[j] - times[i]) / ((j - i) * per_chunk))
        contexts.append(r["prompt_tokens"] + (i + j) / 2 * per_chunk)
    if not per_token:
        return None
    return {"wave": len(wave), "step_s": statistics.median(per_token), "context": statistics.fmean(contexts),
            "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in wave)}  # fmt: skip


def join_window(record: dict[str, Any], chunk: int | None) -> dict[str, Any] | None:
    """The steps that prefilled the joining prompt, seen from the decodes it joined: for each
    decode still running, the k longest gaps between its tokens from the prompt's arrival to just
    after its first token (k: the prompt's chunks; a prefill dwarfs a decode step, and a first
    token may reach the client a little after the decodes' tokens of the same step), summed; the
    median over the decodes, their number and mean context. None where no decode ran through the
    join (a server that runs one at a time)."""
    joiner = record["joiner"]
    n, send, first = joiner["prompt_tokens"], joiner["send_s"], joiner["first_s"]
    k = 1 if chunk is None else -(-n // chunk)
    spans, contexts = [], []
    for r in record["requests"]:
        times = r["chunk_times_s"]
        if not times or times[-1] < first or r["output_tokens"] > len(times) * 1.5:
            continue  # ended before the join, or streams several tokens a chunk: no steps to see
        gaps = sorted(((times[i] - times[i - 1], i) for i in range(1, len(times))
                       if times[i] > send and times[i - 1] < first + 0.05), reverse=True)  # fmt: skip
        if len(gaps) < k:
            continue
        spans.append(sum(g for g, _ in gaps[:k]))
        contexts.append(r["prompt_tokens"] + statistics.fmean(i for _, i in gaps[:k]))
    if not spans:
        return None
    return {
        "decodes": len(spans),
        "time_s": statistics.median(spans),
        "context": statistics.fmean(contexts),
        "steps": k,
    }


def join_row(window: dict[str, Any], n: int, chunk: int | None, rows: KernelRows) -> list[float]:
    """The mixed steps of a join: each carries the decodes and one chunk of the n-token prompt."""
    b, ctx = window["decodes"], window["context"]
    row = [0.0] * len(TERMS)
    done = 0
    while done < n:
        t = n - done if chunk is None else min(chunk, n - done)
        c = done + t
        decode_ctx = round(b * ctx)
        pairs = decode_ctx + t * c - t * (t - 1) // 2
        for i, v in enumerate(features(b + t, b + 1, decode_ctx + c, pairs, rows)):
            row[i] += v
        done = c
    return row


def round_trip_s(results: Results) -> float:
    """The client's round trip to subtract from a TTFT: the lower quartile of the measured ones, as
    a prefill is priced at its fastest repeat, which rode one of the faster round trips."""
    samples = [s for r in results.of("rtt") for s in r["samples_s"]]
    if len(samples) < 2:
        return samples[0] if samples else 0.0
    return statistics.quantiles(samples, n=4, method="inclusive")[0]


def observations(
    results: Results, rtt_s: float, chunk: int | None, rows: KernelRows = NO_KERNEL_ROWS
) -> list[Observation]:
    """Over the repeats: a prefill's server time (the fastest TTFT less the round trip) at each
    length, and a decode step's time (the median) at each burst."""
    out: list[Observation] = []
    by_len: dict[int, list[dict[str, Any]]] = {}
    for r in results.of("prefill"):
        by_len.setdefault(r["target"], []).append(r)
    for target, rs in sorted(by_len.items()):
        # one request alone: anything else on the host only adds to its TTFT, so the fastest repeat
        # is the server's own time (a decode step's is already a median over its window), at that
        # repeat's own length: a target's prompts tokenize a few tokens apart, maybe across a chunk
        fastest = min(rs, key=lambda r: r["ttft_s"])
        n, t = fastest["prompt_tokens"], fastest["ttft_s"] - rtt_s
        out.append(
            Observation(
                "prefill",
                f"prefill {n}",
                tuple(prefill_row(n, chunk, rows)),
                max(t, 1e-6),
                {"prompt_tokens": n, "repeats": len(rs)},
            )
        )
    by_burst: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in results.of("burst"):
        by_burst.setdefault((r["batch"], r["target"]), []).append(r)
    for (batch, target), rs in sorted(by_burst.items()):
        windows = [w for w in map(decode_window, rs) if w is not None]
        if not windows:
            continue
        wave, windows = modal_wave(windows)
        context = statistics.fmean(w["context"] for w in windows)
        step = statistics.median(w["step_s"] for w in windows)
        row = features(wave, wave, round(wave * context), round(wave * context), rows)
        out.append(
            Observation(
                "decode",
                f"decode {wave}x{context:.0f}",
                tuple(row),
                step,
                {"batch": batch, "wave": wave, "context": context, "repeats": len(windows)},
            )
        )
    by_join: dict[tuple[int, int], list[tuple[dict[str, Any], int]]] = {}
    for r in results.of("join"):
        w = join_window(r, chunk)
        if w is not None:
            by_join.setdefault((r["batch"], r["target"]), []).append((w, r["joiner"]["prompt_tokens"]))
    for (batch, target), ws in sorted(by_join.items()):
        n = round(statistics.median(m for _, m in ws))
        decodes = round(statistics.median(w["decodes"] for w, _ in ws))
        window = {"decodes": decodes, "context": statistics.fmean(w["context"] for w, _ in ws)}
        out.append(
            Observation(
                "mixed",
                f"mixed {decodes}+{n}",
                tuple(join_row(window, n, chunk, rows)),
                statistics.median(w["time_s"] for w, _ in ws),
                {"batch": batch, "decodes": decodes, "prompt_tokens": n, "repeats": len(ws)},
            )
        )
    return out


def balanced(obs: Sequence[Observation]) -> list[float]:
    """Weights that make prefills and decode steps count alike, however many of each were measured
    (a single-sequence server gives a few decode points against a long prefill sweep)."""
    counts = {kind: sum(o.kind == kind for o in obs) for kind in {o.kind for o in obs}}
    return [len(obs) / (len(counts) * counts[o.kind]) for o in obs]


FITTED = ("prefill", "decode")  # the mixed steps of the joins check the fit, as a served load would


def _fit(obs: Sequence[Observation]) -> dict[str, Any]:
    """Every prefill and decode point in the fit (a few decode points are too few to hold some out
    of it); the held-out error is the cross-validated one (`cross_validated_errors`)."""
    obs = [o for o in obs if o.kind in FITTED]
    return fit_rows([o.row for o in obs], [o.time_s for o in obs], holdout_every=10**9, weights=balanced(obs))


def _errors_pct(obs: Sequence[Observation], coefficients: dict[str, float]) -> list[float]:
    c = [coefficients[k] for k in TERMS]
    return [(sum(a * b for a, b in zip(c, o.row)) - o.time_s) / o.time_s * 100 for o in obs]


def cross_validated_errors(obs: Sequence[Observation], folds: int = CV_FOLDS) -> list[float]:
    """Each point's error % priced by a fit that did not see it (interleaved folds)."""
    errors = [math.nan] * len(obs)
    for k in range(folds):
        test = [i for i in range(len(obs)) if i % folds == k]
        if not test:
            continue
        fitted = _fit([o for i, o in enumerate(obs) if i % folds != k])
        for i, e in zip(test, _errors_pct([obs[i] for i in test], fitted["coefficients"])):
            errors[i] = e
    return errors


def _cross_validated_error(obs: Sequence[Observation], kind: str) -> float:
    """Mean |error| % of the `kind` points out of their fit: a chunk budget or a kernel switch
    adds a term, a freedom a fit to all points would use to chase noise, so candidates are
    compared on points outside their fit. The mean, not the median: two budgets differ only at
    the lengths between their boundaries, a few of the points (each already a fastest repeat)."""
    errors = [abs(e) for o, e in zip(obs, cross_validated_errors(obs)) if o.kind == kind]
    return statistics.fmean(errors) if errors else math.inf


def decode_rows(results: Results) -> KernelRows:
    """Where a step stops being a decode-sized one: past the largest decode batch measured, a
    step's tokens are priced at a rate of their own (per_dense_token_s: a server's prefill
    tokens may cost more, or less, than its decode tokens; one slope cannot hold both)."""
    waves = [w["wave"] for w in map(decode_window, results.of("burst")) if w is not None]
    return KernelRows(None, max(waves)) if waves else NO_KERNEL_ROWS


def _clear_gain(errors: dict[str, float]) -> str | None:
    best = min(errors, key=errors.__getitem__)
    if best != "none" and errors[best] < (1 - CHUNK_MIN_GAIN) * errors["none"] and errors["none"] - errors[best] > 1.0:
        return best
    return None


def infer_switch(results: Results, rtt_s: float, chunk: int | None, rows: KernelRows) -> dict[str, Any]:
    """A batch size past which a decode step costs more than the per-sequence slope says (a
    kernel switch, or a second pass of the weights), with the decode points' mean error in a fit
    with each candidate; "none" unless one takes it under 60% of none's. (The decode points are too few to hold folds out,
    as the chunk budget's choice does: a burst size held out is an extrapolation.)"""
    top = rows.max_rows or 0
    errors: dict[str, float] = {}
    for switch in (None, *[b for b in (1, 2, 4, 8, 16, 32, 64) if b < top]):
        try:
            obs = observations(results, rtt_s, chunk, KernelRows(switch, rows.max_rows))
            errs = _errors_pct(obs, _fit(obs)["coefficients"])
        except InvalidArgument:
            return {"value": None, "errors_pct": {}, "why": "too few points to fit"}
        decode = [abs(e) for o, e in zip(obs, errs) if o.kind == "decode"]
        errors["none" if switch is None else str(switch)] = statistics.fmean(decode) if decode else math.inf
    best = min(errors, key=errors.__getitem__)
    if best != "none" and errors[best] < SWITCH_MIN_GAIN * errors["none"] and errors["none"] - errors[best] > 1.0:
        return {"value": int(best), "errors_pct": errors, "why": f"decode steps above batch {best} cost a step more"}
    return {"value": None, "errors_pct": errors, "why": "decode steps grow linearly with the batch"}


def infer_chunk(results: Results, rtt_s: float, rows: KernelRows = NO_KERNEL_ROWS) -> dict[str, Any]:
    """The chunk budget that best explains TTFT(L) (each candidate below the longest prompt, or
    none), with the cross-validated prefill error of each; "none" unless one beats it clearly."""
    longest = max((r["prompt_tokens"] for r in results.of("prefill")), default=0)
    errors: dict[str, float] = {}
    for chunk in (None, *[c for c in CHUNK_CANDIDATES if c < longest]):
        try:
            error = _cross_validated_error(observations(results, rtt_s, chunk, rows), "prefill")
        except InvalidArgument:
            return {"value": None, "errors_pct": {}, "why": "too few points to fit"}
        errors["none" if chunk is None else str(chunk)] = error
    best = _clear_gain(errors)
    if best is not None:
        return {
            "value": int(best),
            "errors_pct": errors,
            "why": f"TTFT(L) jumps where L crosses multiples of {best} tokens",
        }
    return {
        "value": None,
        "errors_pct": errors,
        "why": f"no chunk boundary shows in TTFT up to {longest} tokens (none, or one above it)",
    }


def modal_wave(windows: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The first wave most of a burst's repeats ran (the larger on a tie: a repeat proves the server
    can run that many at once), with those repeats' windows: a decode step is timed, and a limit
    read, only at a batch some repeat ran, never at a median between two."""
    by_wave: dict[int, list[dict[str, Any]]] = {}
    for w in windows:
        by_wave.setdefault(w["wave"], []).append(w)
    wave = max(by_wave, key=lambda n: (len(by_wave[n]), n))
    return wave, by_wave[wave]


def _burst_waves(results: Results) -> dict[tuple[int, int], tuple[int, float]]:
    """(target prompt length, burst size) -> the first wave of those bursts (`modal_wave`) and
    its requests' mean prompt length as the server counted it."""
    windows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in results.of("burst"):
        w = decode_window(r)
        if w is not None:
            windows.setdefault((r["target"], r["batch"]), []).append(w)
    out = {}
    for key, ws in windows.items():
        wave, same = modal_wave(ws)
        out[key] = (wave, statistics.fmean(w["prompt_tokens"] for w in same))
    return out


def infer_max_seqs(results: Results) -> dict[str, Any]:
    """The server's sequence limit: the first wave of the bursts larger than it, at the shortest
    prompts (where the KV cache binds last)."""
    waves = _burst_waves(results)
    if not waves:
        return {"value": None, "why": "no burst measured"}
    shortest = min(t for t, _ in waves)
    medians = {b: w for (t, b), (w, _) in waves.items() if t == shortest}
    capped = [m for b, m in medians.items() if m < b]
    largest = max(medians)
    if capped:
        value = min(capped)
        agree = sum(1 for b, m in medians.items() if b > value and m == value)
        return {
            "value": value,
            "lower_bound": False,
            "waves": medians,
            "confidence": "high" if agree >= 2 else "medium",
            "why": f"bursts above {value} requests ran {value} at a time; the others waited",
        }
    return {
        "value": largest,
        "lower_bound": True,
        "waves": medians,
        "confidence": "low",
        "why": f"every burst up to {largest} requests ran all at once: the limit is at least {largest}",
    }


def infer_kv_tokens(results: Results, output_tokens: int) -> dict[str, Any]:
    """The KV cache's size in tokens, from the onset of queueing: a burst of long prompts that ran
    fewer requests at a time than the same burst of the shortest prompts ran out of KV, not of
    sequence slots, so its first wave's requests (prompt + output each) filled it and one more did
    not fit. Otherwise only a lower bound: the most any first wave held."""
    found = _burst_waves(results)
    if not found:
        return {"value": None, "at_least": None, "why": "no burst measured"}
    waves = {key: w for key, (w, _) in found.items()}
    # a request's tokens: its prompt as the server counted it (a target tokenizes a few off) + output
    size = {key: round(p) + output_tokens for key, (_, p) in found.items()}
    shortest = min(t for t, _ in waves)
    held = {key: w * size[key] for key, w in waves.items()}
    short_of_kv = [(t, b, w) for (t, b), w in waves.items()
                   if t > shortest and (s := waves.get((shortest, b))) is not None and w < s]  # fmt: skip
    if short_of_kv:
        t, b, w = min(short_of_kv, key=lambda x: held[x[:2]])
        n = size[(t, b)]
        return {
            "value": w * n,
            "at_most": (w + 1) * n,
            "why": f"bursts of {b} requests of {n - output_tokens} prompt tokens ran {w} at a time where "
            f"{shortest}-token ones ran {waves[(shortest, b)]}: {w} requests of {n} tokens filled the KV cache",
        }
    most = max(held.values())
    return {"value": None, "at_least": most, "why": f"no burst ran out of KV: it holds at least {most} tokens"}


# ---- the profile --------------------------------------------------------------------------------


def _setting(value: Any, source: str, confidence: str, why: str) -> dict[str, Any]:
    return {"value": value, "source": source, "confidence": confidence, "why": why}


def server_settings(
    server: ServerInfo,
    chunk: dict[str, Any],
    seqs: dict[str, Any],
    longest_seen: int,
    kv: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """What the simulator needs to run the server's scheduler, each with where it came from:
    the server's /metrics ("metrics", exact), an inference from the measurements, or an
    assumption where neither could tell."""
    cfg = server.config
    out: dict[str, dict[str, Any]] = {}

    def exported(key: str) -> int | None:
        return int(cfg[key]) if cfg.get(key, "").isdigit() else None

    if (v := exported("max_model_len")) is not None or server.max_model_len is not None:
        out["max_model_len"] = _setting(
            v or server.max_model_len, "metrics" if v else "models", "exact", "the server's own figure"
        )
    else:
        out["max_model_len"] = _setting(
            longest_seen, "assumed", "low", "the server does not say; the longest request the calibration ran"
        )
    if (v := exported("max_num_seqs")) is not None:
        out["max_num_seqs"] = _setting(v, "metrics", "exact", "the server's /metrics")
    elif seqs.get("value") is not None:
        out["max_num_seqs"] = _setting(seqs["value"], "inferred", seqs["confidence"], seqs["why"])
    else:
        out["max_num_seqs"] = _setting(1, "assumed", "low", seqs["why"])
    if (v := exported("max_num_batched_tokens")) is not None:
        out["max_num_batched_tokens"] = _setting(v, "metrics", "exact", "the server's /metrics")
    elif chunk.get("value") is not None:
        out["max_num_batched_tokens"] = _setting(chunk["value"], "inferred", "medium", chunk["why"])
    else:
        limit = out["max_model_len"]["value"]
        out["max_num_batched_tokens"] = _setting(
            max(limit, longest_seen), "assumed", "low", chunk["why"] + "; priced as unchunked"
        )
    block = exported("block_size")
    out["block_size"] = (_setting(block, "metrics", "exact", "the server's /metrics") if block
                         else _setting(16, "assumed", "low", "the server does not say; it matters only with KV "
                                                             "capacity"))  # fmt: skip
    blocks = exported("num_blocks") or exported("num_gpu_blocks")
    if blocks:
        out["num_blocks"] = _setting(blocks, "metrics", "exact", "the server's /metrics")
    elif kv is not None and kv.get("value"):
        out["num_blocks"] = _setting(-(-kv["value"] // out["block_size"]["value"]), "inferred", "medium", kv["why"])
    else:
        need = out["max_model_len"]["value"] * out["max_num_seqs"]["value"]
        seen = f" ({kv['why']})" if kv is not None and kv.get("at_least") else ""
        out["num_blocks"] = _setting(
            -(-max(need, (kv or {}).get("at_least") or 0) // out["block_size"]["value"]),
            "assumed",
            "low",
            f"the server does not export its KV capacity and no run reached it{seen}: "
            "enough for max_num_seqs full-length sequences",
        )
    caching = cfg.get("enable_prefix_caching", "").lower()  # vLLM's label says True, servelab's true
    out["enable_prefix_caching"] = (_setting(caching == "true", "metrics", "exact", "the server's /metrics")
                                    if caching in ("true", "false")
                                    else _setting(False, "assumed", "low", "unknown; every calibration prompt "
                                                                           "was unique"))  # fmt: skip
    return out


def sim_server_config(settings: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The settings as the strings validate's sim_config reads (the /metrics label form)."""
    return {
        k: str(v["value"]).lower() if isinstance(v["value"], bool) else str(v["value"]) for k, v in settings.items()
    }


def build_profile(server: ServerInfo, results: Results, run: dict[str, Any], design: Design) -> dict[str, Any]:
    rtt_s = round_trip_s(results)
    rows = decode_rows(results)
    chunk = infer_chunk(results, rtt_s, rows)
    seqs = infer_max_seqs(results)
    settings_chunk = chunk["value"]
    if (exported := server.config.get("max_num_batched_tokens", "")).isdigit():
        settings_chunk = int(exported)
    switch = infer_switch(results, rtt_s, settings_chunk, rows)
    rows = KernelRows(switch["value"], rows.max_rows)
    run = {**run, "short_outputs": short_outputs(results, design.burst_output)}
    obs = observations(results, rtt_s, settings_chunk, rows)
    fit_obs = [o for o in obs if o.kind in FITTED]
    try:
        fitted = _fit(obs)
        held = dict(zip(map(id, fit_obs), cross_validated_errors(fit_obs)))
    except InvalidArgument as exc:  # too few points for the fit, or for its folds
        raise ServelabError(
            f"only {len(fit_obs)} prefill and decode points measured ({run['stopped'] or 'the design is too small'}), "
            f"too few to fit and cross-validate ({exc.message}): give a longer --budget, or --resume to add to them"
        ) from None
    errs = _errors_pct(obs, fitted["coefficients"])
    fitted["heldout"] = {
        "count": len(held),
        "median_abs_pct": statistics.median(abs(e) for e in held.values()),
        "max_abs_pct": max(abs(e) for e in held.values()),
        "how": f"{CV_FOLDS}-fold cross-validation",
    }
    mixed = [abs(e) for o, e in zip(obs, errs) if o.kind == "mixed"]
    fitted["mixed_check"] = {
        "count": len(mixed),
        "median_abs_pct": statistics.median(mixed) if mixed else None,
        "how": "the joins' mixed steps, priced by the fit they were kept out of",
    }
    fitted.pop("holdout_every", None)
    noise = prefill_noise(results)
    longest = max((r["prompt_tokens"] for r in results.of("prefill")), default=0)
    settings = server_settings(server, chunk, seqs, longest + 1, infer_kv_tokens(results, design.burst_output))
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": "black-box",
        "model": server.model,
        "server_kind": server.to_dict(),
        "server_settings": settings,
        "client": {
            "round_trip_s": rtt_s,
            "how": "the lower quartile of GET /v1/models round trips, subtracted "
            "from every TTFT (a length's fastest repeat rode a fast one)",
        },
        "inferred": {"chunk_budget": chunk, "max_num_seqs": seqs, "decode_switch": switch},
        "kernel_rows": {"fused_max_rows": rows.fused_max_rows, "max_rows": rows.max_rows},
        "design": {
            "prefill_lens": list(design.prefill_lens),
            "bursts": [list(b) for b in design.bursts],
            "burst_output_tokens": design.burst_output,
            "repeats": design.repeats,
        },
        "run": run,
        "host_noise": noise,
        "fit": fitted,
        "observations": [
            {
                "kind": o.kind,
                "label": o.label,
                "time_s": o.time_s,
                "fit_error_pct": e,
                "held_out_error_pct": held.get(id(o), e),
                **o.detail,
            }
            for o, e in zip(obs, errs)
        ],
    }


def prefill_noise(results: Results) -> dict[str, Any]:
    """How much the repeats of each single-request prefill (same length, fresh prompt) spread: the
    in-engine calibrate's rule (`cost.calibration_stats`, noisy past a 10% median spread) applied
    to the TTFTs a quiet server would repeat. Other processes' CPU use is not measured from here."""
    from servelab.cost.calibration_stats import host_noise

    by_len: dict[int, list[float]] = {}
    for r in results.of("prefill"):
        if r.get("ttft_s") is not None and r["ttft_s"] > 0:
            by_len.setdefault(r["target"], []).append(r["ttft_s"])
    repeated = [v for v in by_len.values() if len(v) > 1]
    if not repeated:
        return {
            "noisy": None,
            "describe": "host noise not measured: no prefill was measured twice (one pass, or the budget ended the second)",
        }
    noise = host_noise(repeated)
    return {
        **noise.to_dict(),
        "measured_on": "the repeated single-request prefills' TTFTs",
        "describe": noise.describe(),
    }


def report_lines(profile: dict[str, Any]) -> list[str]:
    s = profile["server_kind"]
    fit = profile["fit"]
    c = fit["coefficients"]
    run, rows = profile["run"], profile["kernel_rows"]
    resumed = f" ({run['resumed']} from an earlier run)" if run["resumed"] else ""
    lines = [
        f"{s['model']} at {s['base_url']} ({s['kind']}{' ' + s['version'] if s['version'] else ''}): "
        f"{run['measured']} points{resumed} in {run['wall_s']:.0f} s, "
        f"round trip {profile['client']['round_trip_s'] * 1e3:.1f} ms",
        f"step cost: {c['per_step_s'] * 1e3:.2f} ms a step (+{c['per_prefill_step_s'] * 1e3:.2f} ms with a "
        f"prefill) + {c['per_token_s'] * 1e6:.1f} us a token + {c['per_seq_s'] * 1e6:.1f} us a sequence + "
        f"{c['per_context_token_s'] * 1e9:.1f} ns a context token + {c['per_pair_s'] * 1e9:.3f} ns a pair",
    ]
    if rows["max_rows"] is not None:
        lines.append(
            f"  steps over {rows['max_rows']} tokens (the largest decode wave): "
            f"+{c['per_dense_step_s'] * 1e3:.2f} ms and {c['per_dense_token_s'] * 1e6:.1f} us a token past it"
        )
    if rows["fused_max_rows"] is not None:
        lines.append(f"  decode steps over {rows['fused_max_rows']} sequences: +{c['per_wide_step_s'] * 1e3:.2f} ms")
    lines.append(
        f"fit: median error {fit['train']['median_abs_pct']:.1f}% on {fit['train']['count']} points, "
        f"{fit['heldout']['median_abs_pct']:.1f}% held out ({CV_FOLDS}-fold cross-validation)"
    )
    check = fit.get("mixed_check") or {}
    if check.get("count"):
        lines.append(
            f"check: {check['count']} mixed steps (a prompt joining running decodes), median error "
            f"{check['median_abs_pct']:.1f}%"
        )
    lines.append("server settings:")
    for key, v in profile["server_settings"].items():
        lines.append(f"  {key:<24} {v['value']!s:<8} {v['source']}, {v['confidence']}: {v['why']}")
    if profile["run"].get("short_outputs"):
        lines.append(
            f"note: {profile['run']['short_outputs']} burst requests ended before their max_tokens: the "
            "server does not honour ignore_eos, so its waves and decode steps are guessed from fewer "
            "tokens; pass --extra-body with a logit_bias of -100 on its end-of-sequence token ids"
        )
    if profile.get("host_noise"):
        lines.append(profile["host_noise"]["describe"])
    if profile["run"]["stopped"]:
        lines.append(f"note: {profile['run']['stopped']}; --resume adds the rest")
    return lines


def progress_printer(enabled: bool, bar: bool = True) -> Callable[[str, int, int], None] | None:
    """A bar redrawn in place on a terminal; elsewhere (a log, the lab's background run) one line
    per point, `progress DONE/TOTAL LABEL`."""
    if not enabled:
        return None

    def show(label: str, done: int, total: int) -> None:
        if not bar:
            print(f"progress {done}/{total} {label}", file=sys.stderr, flush=True)
            return
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done == total else ""
        print(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    return show


def partial_path(out: str) -> str:
    return os.fspath(out) + ".partial.jsonl"
