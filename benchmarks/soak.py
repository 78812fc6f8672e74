"""Soak: steady mixed-length load against a servelab server while its RSS is sampled.

Starts `servelab serve` on a free 127.0.0.1 port (or targets `--url` with `--pid`), then keeps
`--concurrency` clients busy for `--duration`: prompt and output lengths drawn from lognormal
distributions, chat and completions, streaming and not, a share of streams dropped by the
client mid-way, random seeds and temperatures, and prompts that never repeat (so the prefix
cache does not absorb the load). The server's RSS (VmRSS) is sampled every `--sample-every` seconds.

Verdict: RSS may grow at most `--max-growth` (default 5%) after the warm-up (default 10 min):
the largest sample after warm-up against the sample at the end of warm-up.

    .venv/bin/python benchmarks/soak.py --duration 60m --concurrency 6 --out /tmp/soak.json
    .venv/bin/python benchmarks/soak.py --duration 5m --warmup 1m --server-args "--kv-cache-memory 256MiB"

`--quick` (10 s of load, 3 s warm-up, short requests; flags given beside it win) with a tiny model
(`--server-args "--model DIR"`) checks that the soak runs; its verdict means little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

import servelab
from servelab.bench.client import BenchRequest, OpenAIStreamClient
from servelab.bench.prompts import PromptBuilder
from servelab.units import parse_duration_s as parse_duration
from servelab.workload import RequestSpec
from servelab.workload.lengths import LengthDist


@dataclass(slots=True)
class Sample:
    elapsed_s: float
    rss_bytes: int
    requests: int
    errors: int
    disconnects: int


@dataclass(slots=True)
class Counters:
    requests: int = 0
    errors: int = 0
    disconnects: int = 0
    output_tokens: int = 0
    last_errors: list[str] = field(default_factory=list)

    def error(self, message: str) -> None:
        self.errors += 1
        self.last_errors = (self.last_errors + [message])[-5:]


class SoakClient(OpenAIStreamClient):
    """The bench client with per-request sampling fields (seed, temperature) in the body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields: dict[int, dict[str, Any]] = {}

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body = super().payload(request)
        body.update(self.fields.pop(request.index, {}))
        return body


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc (Linux; no psutil needed)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        raise SystemExit(f"process {pid} is gone (or this is not Linux): no RSS to sample") from None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/{pid}/status has no VmRSS line")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, server_args: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "servelab.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", "--no-lab", *server_args]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    print("server:", shlex.join(cmd), f"(log {log_path})", flush=True)
    # `python -m` puts the working directory first on sys.path: run where the servelab this
    # script imported lives, so the server is that same code (not a checkout in the cwd).
    root = Path(servelab.__file__).resolve().parents[1]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)


async def wait_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it was healthy; see its log")
            try:
                async with session.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"the server at {base} was not healthy within {timeout_s:g}s")


class Load:
    """One request at a time per worker, drawn at random from the mix."""

    def __init__(self, base: str, args: argparse.Namespace, counters: Counters) -> None:
        self.args = args
        self.counters = counters
        self.rng = np.random.default_rng(args.seed)
        self.prompts = PromptBuilder(None, seed=args.seed)  # word-count lengths: no tokenizer needed
        self.input_len = LengthDist.parse(args.input_len, name="--input-len")
        self.output_len = LengthDist.parse(args.output_len, name="--output-len")
        self.clients = {ep: SoakClient(base, endpoint=ep, max_connections=args.concurrency + 2,
                                       timeout_s=args.request_timeout, ignore_eos=False)
                        for ep in ("completions", "chat")}  # fmt: skip
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout))
        self.base = base
        self.index = 0

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()
        await self.session.close()

    def _next(self) -> tuple[str, BenchRequest, dict[str, Any]]:
        rng, a = self.rng, self.args
        self.index += 1
        prompt_tokens = int(min(self.input_len.sample(rng, 1)[0], a.max_input))
        output_tokens = int(min(self.output_len.sample(rng, 1)[0], a.max_output))
        shared = rng.random() < a.shared_prefix_share
        spec = RequestSpec(index=self.index, arrival_s=None, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                           prefix_tokens=min(64, prompt_tokens - 1) if shared else 0, prefix_group=int(rng.integers(4)))  # fmt: skip
        request = BenchRequest(self.index, self.prompts.prompt_for(spec, round_=1), prompt_tokens, output_tokens)
        fields = {"seed": int(rng.integers(1 << 31)), "temperature": float(rng.choice([0.0, 0.7, 1.0]))}
        return ("chat" if rng.random() < a.chat_share else "completions"), request, fields

    async def worker(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            endpoint, request, fields = self._next()
            try:
                if self.rng.random() < self.args.stream_share:
                    await self._streamed(endpoint, request, fields)
                else:
                    await self._plain(endpoint, request, fields)
            except Exception as exc:  # noqa: BLE001 - a soak counts failures, it does not stop on them
                self.counters.error(f"{type(exc).__name__}: {exc}")
            self.counters.requests += 1

    async def _streamed(self, endpoint: str, request: BenchRequest, fields: dict[str, Any]) -> None:
        client = self.clients[endpoint]
        client.fields[request.index] = fields
        if self.rng.random() < self.args.disconnect_share:
            # Leave mid-stream: the connection closes, the server must abort and free the request.
            try:
                await asyncio.wait_for(client.stream(request), timeout=float(self.rng.uniform(0.2, 3.0)))
            except TimeoutError:
                self.counters.disconnects += 1
            return
        result = await client.stream(request)
        if not result.success:
            self.counters.error(result.error or "failed")
        self.counters.output_tokens += result.usage_output_tokens or 0

    async def _plain(self, endpoint: str, request: BenchRequest, fields: dict[str, Any]) -> None:
        client = self.clients[endpoint]
        body = client.payload(request) | fields | {"stream": False}
        body.pop("stream_options", None)
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        async with self.session.post(client.base_url + path, json=body) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                self.counters.error(f"HTTP {r.status}: {str(data)[:200]}")
                return
            self.counters.output_tokens += (data.get("usage") or {}).get("completion_tokens", 0)


def verdict(samples: list[Sample], warmup_s: float, max_growth: float) -> tuple[bool | None, str]:
    after = [s for s in samples if s.elapsed_s >= warmup_s]
    if len(after) < 2:
        return None, f"no verdict: fewer than 2 samples after the {warmup_s:g}s warm-up"
    base = after[0].rss_bytes
    peak = max(s.rss_bytes for s in after)
    growth = (peak - base) / base
    t = np.array([s.elapsed_s for s in after])
    rss = np.array([s.rss_bytes for s in after]) / 2**20
    slope = float(np.polyfit(t / 60, rss, 1)[0])
    ok = growth < max_growth
    return ok, (f"{'PASS' if ok else 'FAIL'}: RSS after warm-up {base / 2**20:.0f} MiB at {after[0].elapsed_s:.0f}s, "
                f"peak {peak / 2**20:.0f} MiB, last {after[-1].rss_bytes / 2**20:.0f} MiB: growth {growth:+.1%} "
                f"(limit {max_growth:.0%}); fitted slope {slope:+.2f} MiB/min over {t[-1] - t[0]:.0f}s")  # fmt: skip


async def soak(args: argparse.Namespace) -> int:
    proc = None
    if args.url:
        base = args.url.rstrip("/").removesuffix("/v1")
        if args.pid is None:
            raise SystemExit("--url needs --pid: the soak samples that process's RSS")
        pid = args.pid
    else:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(port, shlex.split(args.server_args), args.server_log)
        pid = proc.pid
    try:
        await wait_healthy(base, proc)
        rss_bytes(pid)  # fail now, not after the warm-up, if it cannot be read
        counters = Counters()
        load = Load(base, args, counters)
        samples: list[Sample] = []
        start = time.monotonic()
        stop_at = start + args.duration
        print(f"{'elapsed':>8} {'RSS MiB':>8} {'requests':>9} {'errors':>7} {'dropped':>8} {'out tok':>8}", flush=True)

        async def sampler() -> None:
            while True:
                s = Sample(time.monotonic() - start, rss_bytes(pid), counters.requests, counters.errors,
                           counters.disconnects)  # fmt: skip
                samples.append(s)
                print(f"{s.elapsed_s:8.0f} {s.rss_bytes / 2**20:8.1f} {s.requests:9d} {s.errors:7d} "
                      f"{s.disconnects:8d} {counters.output_tokens:8d}", flush=True)  # fmt: skip
                if time.monotonic() >= stop_at:
                    return
                await asyncio.sleep(min(args.sample_every, max(0.0, stop_at - time.monotonic())))

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(load.worker(stop_at) for _ in range(args.concurrency)))
        await sampling
        await load.aclose()
        ok, text = verdict(samples, args.warmup, args.max_growth)
        print(text)
        if counters.last_errors:
            print("last errors:", *counters.last_errors, sep="\n  ")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"argv": args.argv, "verdict": text, "ok": ok, "counters": asdict(counters),
                           "samples": [asdict(s) for s in samples]}, f, indent=1)  # fmt: skip
        return 0 if ok is not False else 1
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


QUICK = {"duration": 10.0, "warmup": 3.0, "sample_every": 0.5, "concurrency": 3, "max_input": 128, "max_output": 24}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="target a running server instead of starting one (needs --pid)")
    p.add_argument("--pid", type=int, help="the process id of the --url server, for its RSS")
    p.add_argument("--server-args", default="", help="extra arguments for `servelab serve`")
    p.add_argument("--server-log", default="/tmp/servelab-soak-server.log")
    p.add_argument("--duration", type=parse_duration, default=parse_duration("60m"))
    p.add_argument("--warmup", type=parse_duration, default=parse_duration("10m"))
    p.add_argument("--sample-every", type=parse_duration, default=parse_duration("30s"))
    p.add_argument("--max-growth", type=float, default=0.05, help="largest RSS growth after warm-up (0.05 = 5%%)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--input-len", default="lognormal:200,0.9", help="prompt tokens (a LengthDist)")
    p.add_argument("--output-len", default="lognormal:64,0.8", help="output tokens (a LengthDist)")
    p.add_argument("--max-input", type=int, default=1500)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--stream-share", type=float, default=0.7)
    p.add_argument("--chat-share", type=float, default=0.5)
    p.add_argument("--disconnect-share", type=float, default=0.15, help="share of streams the client drops mid-way")
    p.add_argument(
        "--shared-prefix-share", type=float, default=0.2, help="share of prompts with a common 64-token prefix"
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the samples and the verdict as JSON")
    p.add_argument("--quick", action="store_true", help="10 s of short requests after a 3 s warm-up")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
