"""Does one big request stall the server? /health latency while it is handled, on the bundled model.

Starts `servelab serve` on a free 127.0.0.1 port per case, measures /health 50 times idle, then
polls it every 20 ms while curl (in its own process, so the poller's timings hold none of the
client's work) sends one big body. Cases:

- chat-10MB:       a 10 MB chat message under the default --max-request-bytes (413 expected)
- chat-10MB-16MiB: the same under --max-request-bytes 16MiB (400: it cannot fit the context)
- tokenize-2MB:    /tokenize of 2 MB of text, which is tokenized in full (~450k tokens)

Each line gives the answer's status beside the one expected. `--quick` runs the same three cases
with bodies a tenth the size (and limits to match), in seconds; `--model DIR` serves another model.

    python benchmarks/big_requests.py [chat-10MB chat-10MB-16MiB tokenize-2MB] [--quick] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

# name -> (serve flags, route, body bytes, the status expected), and the same cases a tenth the size
CASES = {
    "chat-10MB": ([], "/v1/chat/completions", 10_000_000, "413"),
    "chat-10MB-16MiB": (["--max-request-bytes", "16MiB"], "/v1/chat/completions", 10_000_000, "400"),
    "tokenize-2MB": ([], "/tokenize", 2_000_000, "200"),
}
QUICK_CASES = {
    "chat-10MB": (["--max-request-bytes", "512KiB"], "/v1/chat/completions", 1_000_000, "413"),
    "chat-10MB-16MiB": (["--max-request-bytes", "2MiB"], "/v1/chat/completions", 1_000_000, "400"),
    "tokenize-2MB": ([], "/tokenize", 200_000, "200"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))] * 1e3


def run_case(name: str, workdir: Path, quick: bool = False, model: str | None = None) -> str:
    flags, route, size, expected = (QUICK_CASES if quick else CASES)[name]
    flags = [*flags, *(["--model", model] if model else [])]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "servelab", "serve", "--port", str(port), "--no-access-log", "--no-lab", *flags]
    with open(workdir / f"{name}.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = httpx.Client(timeout=600)
        for _ in range(3000):
            try:
                if client.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
        body = {"prompt": text} if route == "/tokenize" else {"messages": [{"role": "user", "content": text}],
                                                              "max_tokens": 1}  # fmt: skip
        body_path, out_path = workdir / "body.json", workdir / "out.txt"
        body_path.write_text(json.dumps(body))
        result: dict = {}

        def post() -> None:
            t0 = time.perf_counter()
            done = subprocess.run(["curl", "-s", "-o", str(out_path), "-w", "%{http_code}", url + route,
                                   "-H", "Content-Type: application/json", "--data-binary", f"@{body_path}"],
                                  capture_output=True, text=True)  # fmt: skip
            result.update(status=done.stdout, s=time.perf_counter() - t0)

        idle = []
        for _ in range(50):
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            idle.append(time.perf_counter() - t0)
            time.sleep(0.02)
        during = []
        sender = threading.Thread(target=post)
        sender.start()
        while True:  # at least one poll, however fast the answer
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            during.append(time.perf_counter() - t0)
            if not sender.is_alive():
                break
            time.sleep(0.02)
        sender.join()
        return (f"{name} ({size:,} bytes): {result['status']} (expected {expected}) in {result['s']:.2f} s; "
                f"/health idle p50 {_ms(idle, 0.5):.0f} ms; "
                f"during: {len(during)} polls, p50 {_ms(during, 0.5):.0f} ms, p90 {_ms(during, 0.9):.0f} ms, "
                f"max {_ms(during, 1.0):.0f} ms")  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help=f"default: all ({', '.join(CASES)})")
    ap.add_argument("--quick", action="store_true", help="bodies a tenth the size, limits to match")
    ap.add_argument("--model", default=None, help="what `servelab serve` loads (default: the bundled model)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases or list(CASES):
            print(run_case(name, Path(tmp), args.quick, args.model), flush=True)


if __name__ == "__main__":
    main()
