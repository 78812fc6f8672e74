"""The engine on a CUDA device, in one run: its answers against the CPU path's,
batch-1 decode as a fraction of the bound the device's memory bandwidth sets, and many sequences
decoding together.

    python benchmarks/engine_cuda.py [--device cuda] [--dtype auto] [--model PATH] [--hardware h200]
        [--batch 64] [--new-tokens 64] [--json]

- Correctness: three prompts, each scored token by token (prompt_logprobs: teacher-forced) and
  continued greedily, on the device and on the CPU's exact fp32 engine. An fp32 device passes
  when the greedy tokens are the same and no logprob differs by more than 1e-3; a 16-bit one when
  the teacher-forced top-1 agrees at 90% of positions or more and no logprob of the prompt's
  tokens differs by more than 0.5.
- Speed: batch-1 decode (tok/s between its first and last token), and --batch sequences decoding
  together (tok/s from the moment the last of them has its first token).
- Each rate is also a fraction of its bound: the bytes a decode step reads (the engine's weights
  plus the KV cache its sequences attend to) over the device's read bandwidth, as measured here
  (summing a 1 GiB tensor, best of 5) and as the --hardware datasheet states.

`--device cpu` runs the same checks on the CPU (the tests run it so, with no GPU).

On a device machine (nothing installed, nothing fetched, at most 64 MiB carried) the bundled
94 MB GGUF cannot travel. `--twin DIR` runs on its twin instead: its config.json and
tokenizer.json (in DIR, written from the bundled model where that is installed) and random
weights of its shapes (bf16, seeded, written to a temporary directory each run), the same bytes
a step reads. So, first here, then there with DIR carried:

    python benchmarks/engine_cuda.py --twin .device-twin --device cpu --batch 8 --new-tokens 8 --rounds 1
    PYTHONPATH=. python3 benchmarks/engine_cuda.py --twin .device-twin --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
except ModuleNotFoundError:  # a checkout on a machine where servelab is not installed (a device's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import servelab  # noqa: F401
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_cpu  # noqa: E402
from half_weights import hf_weight_shapes, write_bf16_checkpoint  # noqa: E402
from host_limits import HostLimits  # noqa: E402
from peers import Profile, Shape, fractions  # noqa: E402

from servelab.core.sequence import SamplingParams  # noqa: E402
from servelab.runtime.host_probe import read_bandwidth_bytes_per_s  # noqa: E402
from servelab.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from servelab.spec.hardware import get_hardware  # noqa: E402
from servelab.spec.model import ModelSpec  # noqa: E402

PROMPTS, PROMPT_LEN = 3, 48  # correctness: prompts and their length in tokens
B1_PROMPT, PERF_PROMPT = 32, 32  # prompt lengths for the timed runs


def make_engine(device: str, dtype: str, model: str | None) -> LLMEngine:
    # Prefix caching off: the runs repeat prompts and must compute them.
    return LLMEngine.from_args(
        EngineArgs.from_kwargs(
            model=model,
            device=device,
            dtype=dtype,
            enable_prefix_caching=False,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
        )
    )


def write_twin(description: Path, out: Path, seed: int = 0) -> Path:
    """An HF directory in `out`: `description`'s config.json and tokenizer.json (written there from
    the bundled model if it has none) and random bf16 weights of its shapes, scaled so that
    activations and logits are of a trained model's size (a 16-bit engine's error is then too)."""
    from safetensors.torch import save_file

    if not (description / "config.json").is_file():
        write_bf16_checkpoint(description, weights=False)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((description / name).read_bytes())
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_weight_shapes(ModelSpec.from_hf_config(out)).items():
        w = torch.randn(shape, generator=gen)
        if len(shape) == 1:  # norms
            w = 1.0 + 0.1 * w
        else:  # the embeddings' spread is SmolLM2's (0.14): logits of a few units, as a trained model's
            w = w * (0.14 if "embed" in name or "lm_head" in name else shape[1] ** -0.5)
        weights[name] = w.to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"))
    return out


def prompt_ids(engine: LLMEngine, n: int, seed: int) -> list[int]:
    return engine_cpu.prompt_ids(n, seed, engine.model_spec.vocab_size)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list:
    now = time.perf_counter()
    seqs = [engine.add_request(f"{tag}{i}", p, params, arrival_s=now) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return seqs


def answers(engine: LLMEngine, new_tokens: int) -> list[dict]:
    """Per prompt: the prompt's teacher-forced logprobs (its own token's, and the top-1 token) and
    the greedy continuation."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, prompt_logprobs=1)
    prompts = [prompt_ids(engine, PROMPT_LEN, 1000 + i) for i in range(PROMPTS)]
    return [
        {
            "logprobs": [t.logprob for t in s.prompt_logprobs],
            "top1": [max(t.top, key=lambda kv: kv[1])[0] if t.top else t.token_id for t in s.prompt_logprobs],
            "tokens": list(s.output_token_ids),
        }
        for s in run(engine, prompts, params, "check")
    ]


def compare(reference: list[dict], got: list[dict], exact: bool) -> dict:
    """How far the device's answers are from the reference's, and whether that passes."""
    diffs = [abs(a - b) for r, g in zip(reference, got) for a, b in zip(r["logprobs"], g["logprobs"])]
    top1 = [a == b for r, g in zip(reference, got) for a, b in zip(r["top1"], g["top1"])]
    same_tokens = []  # per prompt: greedy tokens equal before the first difference
    for r, g in zip(reference, got):
        n = 0
        while n < min(len(r["tokens"]), len(g["tokens"])) and r["tokens"][n] == g["tokens"][n]:
            n += 1
        same_tokens.append(n)
    max_diff, agree = max(diffs, default=0.0), sum(top1) / max(len(top1), 1)
    all_tokens = all(n == len(r["tokens"]) == len(g["tokens"]) for n, r, g in zip(same_tokens, reference, got))
    passed = (all_tokens and max_diff <= 1e-3) if exact else (agree >= 0.9 and max_diff <= 0.5)
    return {
        "max_logprob_diff": max_diff,
        "top1_agreement": agree,
        "greedy_tokens_same": same_tokens,
        "exact_criteria": exact,
        "passed": passed,
    }


def decode_rates(engine: LLMEngine, batch: int, new_tokens: int, seed: int) -> float:
    """Decode tok/s of `batch` sequences from the moment the last of them has its first token."""
    prompt_len = B1_PROMPT if batch == 1 else PERF_PROMPT
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    seqs = run(engine, [prompt_ids(engine, prompt_len, seed + i) for i in range(batch)], params, f"b{batch}s{seed}-")
    start = max(s.token_times_s[0] for s in seqs)
    end = max(s.token_times_s[-1] for s in seqs)
    tokens = sum(sum(1 for t in s.token_times_s if t > start) for s in seqs)
    return tokens / (end - start)


def bound_fraction(
    engine: LLMEngine, tok_per_s: float, batch: int, new_tokens: int, bandwidth: float, hardware: str
) -> float:
    """The share of `bandwidth` the step's bytes take at this rate (peers.fractions: every weight,
    and the KV cache of `batch` sequences at their mean context, read once a step)."""
    prompt_len = B1_PROMPT if batch == 1 else PERF_PROMPT
    kv_dtype = str(engine.executor.kv_cache.dtype).removeprefix("torch.")
    hw = get_hardware(hardware)  # its peaks only complete the limits: the bandwidth share is what is read
    limits = HostLimits(
        read_bandwidth_bytes_per_s=bandwidth,
        peak_ops_per_s={d: hw.peak_flops_per_s(d) for d in ("fp32", "bf16", "int8")},
        threads=0,
    )
    profile = Profile(engine.executor.model.weight_bytes(), kv_dtype, "fp32")
    shape = Shape(batch, prompt_len + new_tokens // 2)
    return fractions(shape, tok_per_s, profile, engine.model_spec, limits)["bandwidth"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu (the same checks, no GPU)")
    parser.add_argument("--dtype", default="auto", help="the device engine's dtype (auto: what a user gets)")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument(
        "--twin", type=Path, default=None, help="run on the twin this directory describes, not --model (see above)"
    )
    parser.add_argument("--hardware", default="h200", help="servelab's hardware name for the datasheet bandwidth")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding together in the batched run")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each timed sequence decodes")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each (medians)")
    parser.add_argument("--probe-bytes", type=int, default=1 << 30, help="size of the bandwidth probe's tensor")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    datasheet = get_hardware(args.hardware).bandwidth_bytes_per_s if args.device.startswith("cuda") else None
    if args.twin is not None:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = str(write_twin(args.twin, Path(tmp) / "twin"))
            print(f"model: a twin of {args.twin} (its shapes, random bf16 weights) in {args.model}")
            return measure(args, datasheet)
    return measure(args, datasheet)


def measure(args: argparse.Namespace, datasheet: float | None) -> int:
    reference = answers(make_engine("cpu", "float32", args.model), 16)
    engine = make_engine(args.device, args.dtype, args.model)
    dtype = str(engine.executor.model.dtype).removeprefix("torch.")
    check = compare(reference, answers(engine, 16), exact=dtype == "float32")
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(
        f"device {name}, dtype {dtype}: greedy tokens same {check['greedy_tokens_same']} of 16, "
        f"max logprob diff {check['max_logprob_diff']:.2e}, top-1 agreement {check['top1_agreement']:.1%}: "
        + ("PASS" if check["passed"] else "FAIL")
    )

    # a GPU sums 1 GiB in ~0.3 ms: many repeats, so that its clocks are up for the best of them
    measured = read_bandwidth_bytes_per_s(
        args.probe_bytes, 50 if args.device.startswith("cuda") else 5, device=args.device
    )
    rates: dict[str, list[float]] = {"decode_b1": [], f"decode_b{args.batch}": []}
    decode_rates(engine, 1, 4, 0)  # warm-up at both shapes: kernels, allocator
    decode_rates(engine, args.batch, 4, 1)
    for r in range(args.rounds):
        rates["decode_b1"].append(decode_rates(engine, 1, args.new_tokens, 10 + r))
        rates[f"decode_b{args.batch}"].append(decode_rates(engine, args.batch, args.new_tokens, 100 * (r + 1)))
    result = {
        "device": name,
        "dtype": dtype,
        "check": check,
        "read_bandwidth": {"measured": measured, "datasheet": datasheet},
        "weight_bytes": engine.executor.model.weight_bytes(),
        "metrics": {},
    }
    print(
        f"read bandwidth: measured {measured / 1e9:.0f} GB/s"
        + (f", datasheet ({args.hardware}) {datasheet / 1e9:.0f} GB/s" if datasheet else "")
        + f"; weights read a step: {result['weight_bytes'] / 1e6:.0f} MB"
    )
    for metric, values in rates.items():
        batch = 1 if metric == "decode_b1" else args.batch
        median = statistics.median(values)
        of_measured = bound_fraction(engine, median, batch, args.new_tokens, measured, args.hardware)
        of_sheet = (
            bound_fraction(engine, median, batch, args.new_tokens, datasheet, args.hardware) if datasheet else None
        )
        result["metrics"][metric] = {
            "tok_per_s": median,
            "rounds": values,
            "of_measured_bandwidth": of_measured,
            "of_datasheet_bandwidth": of_sheet,
        }
        print(
            f"{metric:12s} {median:10.1f} tok/s  {of_measured:6.1%} of the measured bound"
            + (f"  {of_sheet:6.1%} of the datasheet's" if of_sheet is not None else "")
            + "  rounds "
            + " ".join(f"{v:.1f}" for v in values)
        )
    if args.json:
        print(json.dumps(result))
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
