"""Does one big request stall the server? /health latency while it is handled, on the bundled model.

Starts `servelab serve` on a free 127.0.0.1 port per case, measures /health 50 times idle, then
polls it every 20 ms while curl (in its own process, so the poller's timings hold none of the
client's work) sends one big body. Cases:

- chat-10MB:       a 10 MB chat message under the default --max-request-bytes (413 expected)
- chat-10MB-16MiB: the same under --max-request-bytes 16MiB (400: it cannot fit the context)
- tokenize-2MB:    /tokenize of 2 MB of text, which is tokenized in full (~450k tokens)

    python benchmarks/big_requests.py [chat-10MB chat-10MB-16MiB tokenize-2MB]
"""

from __future__ import annotations

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

CASES = {
    "chat-10MB": ([], "/v1/chat/completions", 10_000_000),
    "chat-10MB-16MiB": (["--max-request-bytes", "16MiB"], "/v1/chat/completions", 10_000_000),
    "tokenize-2MB": ([], "/tokenize", 2_000_000),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))] * 1e3


def run_case(name: str, workdir: Path) -> str:
    flags, route, size = CASES[name]
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
        while sender.is_alive():
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            during.append(time.perf_counter() - t0)
            time.sleep(0.02)
        sender.join()
        return (f"{name}: {result['status']} in {result['s']:.2f} s; /health idle p50 {_ms(idle, 0.5):.0f} ms; "
                f"during: {len(during)} polls, p50 {_ms(during, 0.5):.0f} ms, p90 {_ms(during, 0.9):.0f} ms, "
                f"max {_ms(during, 1.0):.0f} ms")  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(run_case(name, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
