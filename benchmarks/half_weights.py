"""bf16 weight storage under fp32 compute (linear.HalfLinear, csrc/half_linear.c) against the fp32
copy a bf16 checkpoint used to be widened to, on the bundled model's shapes, in one process.

The bundled SmolLM2-135M GGUF is dequantized and rounded to bf16 into a temporary HF directory
(safetensors, config.json, tokenizer.json; nothing is downloaded), then:

    python benchmarks/half_weights.py linears [--rows 1 2 4 8 16 32 64 128 512] [--threads 1] [--base TREE] [--wall]

times every linear of the model (30 layers x 4 fused matrices + the 49152-row head) per row
count: the fp32 copy through F.linear (MKL), and the bf16 weight through each of HalfLinear's
paths (the GEMV kernel, the panel GEMM kernel, widen-then-MKL), in CPU time; the medians set
linear.HALF_GEMV_MAX_ROWS and HALF_GEMM_MAX_ROWS. `--base TREE` adds the GEMV of another tree's
csrc (built as benchmarks/isa_levels.py --base does), for before/after in one run; the host's
streaming read bandwidth (host_probe, as benchmarks/host_limits.py) is measured before and
after, and each kind's weight bytes per second are printed.

    python benchmarks/half_weights.py engine [--rounds 5] [--threads 2]

runs the engine on that checkpoint twice, its linears kept bf16 (the default) and widened to an
fp32 copy at load (SERVELAB_HALF_WEIGHTS=0), and measures decode at batch 1 and 32 and a
512-token prefill as benchmarks/engine_cpu.py defines them, the two engines interleaved round by
round (alternating who goes first); prints the medians and their ratios.

`--quick` (either mode): a checkpoint of the first 2 layers, one round; linears at rows 1 and 16,
the engine without decode_b32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)
import torch
import torch.nn.functional as F

from servelab.engine.bundled import bundled_model_path


def write_bf16_checkpoint(out: Path, weights: bool = True, layers: int | None = None) -> Path:
    """The bundled model (its first `layers` layers, if given) as a bf16 HF directory in `out`;
    with `weights` False only its description (config.json, tokenizer.json): what
    engine_cuda.py's --twin fills with random weights of the same shapes."""
    from safetensors.torch import save_file

    from servelab.runtime.loader import read_gguf_tensors
    from servelab.engine.tokenizer import Tokenizer
    from servelab.runtime.weight_layout import gguf_getters
    from servelab.spec.model import ModelSpec

    path = bundled_model_path()
    gguf, tensors = read_gguf_tensors(path)
    spec = ModelSpec.from_gguf_metadata(gguf.metadata, name=path.stem,
                                        tensor_shapes={n: t.shape for n, t in gguf.tensors.items()})  # fmt: skip
    if layers is not None:
        spec = dataclasses.replace(spec, num_layers=layers)
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        get, _ = gguf_getters(spec, tensors)
        save_file(
            {n: get(n).to(torch.bfloat16).contiguous() for n in hf_weight_shapes(spec)}, str(out / "model.safetensors")
        )
    tok = Tokenizer.from_gguf(gguf.metadata)
    tok.backend.save(str(out / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_context,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": False,
        "eos_token_id": tok.eos_token_id,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def hf_weight_shapes(spec) -> dict[str, tuple[int, ...]]:
    """The tensors of a Llama checkpoint, in HF's names and shapes, for `spec` (a ModelSpec)."""
    h, q, kv, ffn = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.ffn_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _cpu_s(fn, clock=time.process_time) -> float:
    """The process's CPU seconds for one call: on a shared host, less disturbed than wall time
    by the other processes (with more than one thread, pool workers' spinning counts too; `--wall`
    passes time.perf_counter instead)."""
    t = clock()
    fn()
    return clock() - t


def linears(ckpt: Path, rows_list: list[int], rounds: int, base: Path | None, wall: bool) -> None:
    from servelab.runtime import host_probe, linear
    from servelab.runtime.linear import HalfLinear
    from servelab.runtime.loader import load_model

    model = load_model(ckpt, dtype=torch.float32).model
    half = [w for layer in model.layers for w in layer.linears()] + [model.lm_head]
    assert all(isinstance(w, HalfLinear) for w in half)
    dense = [w.dequantize() for w in half]

    kernels = {"bf16 GEMV": half[0].kernels, "bf16 GEMM": half[0].kernels}
    if base is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from isa_levels import build_from

        from servelab.runtime import native

        kernels["base GEMV"] = build_from(base, native.best_level())

    def run_all(kind: str, x: dict[int, torch.Tensor]):
        def go():
            for h, d in zip(half, dense):
                xi = x[h.shape[1]]
                if kind == "fp32 MKL":
                    F.linear(xi, d)
                elif kind == "widen+MKL":
                    F.linear(xi, h.weight.float())
                else:  # the C kernel, one path forced
                    y = torch.empty(xi.shape[0], h.shape[0])
                    kernels[kind].half_linear(2, h.weight.data_ptr(), h.shape[1], h.shape[0], xi.data_ptr(), xi.shape[0],
                                              None, y.data_ptr(), int(kind == "bf16 GEMM"), torch.get_num_threads())  # fmt: skip

        return go

    kinds = ["fp32 MKL", "bf16 GEMV", "bf16 GEMM", "widen+MKL"] + (["base GEMV"] if base is not None else [])
    fp32_bytes = sum(h.numel() for h in half) * 4
    bw = [host_probe.read_bandwidth_bytes_per_s()]
    print(
        f"all {len(half)} linears of the bundled model's shapes, {torch.get_num_threads()} threads, "
        f"median {'wall' if wall else 'CPU'} ms of {rounds} rounds (kinds interleaved)"
    )
    print(f"{'rows':>5s} " + " ".join(f"{k:>10s}" for k in kinds) + "   best bf16 / fp32")
    for rows in rows_list:
        x = {n: torch.randn(rows, n) for n in {h.shape[1] for h in half}}
        fns = {k: run_all(k, x) for k in kinds}
        for fn in fns.values():
            fn()
        t = {k: [] for k in kinds}
        for r in range(rounds):
            for k in kinds if r % 2 == 0 else reversed(kinds):
                t[k].append(_cpu_s(fns[k], time.perf_counter if wall else time.process_time))
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        best = min(med[k] for k in kinds[1:4])
        print(f"{rows:5d} " + " ".join(f"{med[k]:10.2f}" for k in kinds) + f"   {best / med['fp32 MKL']:.2f}")
        gbs = {
            k: (fp32_bytes if k == "fp32 MKL" else fp32_bytes // 2) / med[k] / 1e6 for k in kinds if k != "widen+MKL"
        }
        per = "" if wall or torch.get_num_threads() == 1 else " per CPU second"  # CPU time: every thread counts
        print(f"      weight GB/s{per}: " + ", ".join(f"{k} {v:.1f}" for k, v in gbs.items()))
    bw.append(host_probe.read_bandwidth_bytes_per_s())
    print(
        f"(HalfLinear now: GEMV up to {linear.HALF_GEMV_MAX_ROWS} rows, GEMM up to {linear.HALF_GEMM_MAX_ROWS}, "
        "then widen+MKL)"
    )
    print(
        f"host read bandwidth (host_probe, {torch.get_num_threads()} threads), before / after: "
        + " / ".join(f"{b / 1e9:.1f} GB/s" for b in bw)
    )
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def engine(ckpt: Path, rounds: int, metrics: tuple[str, ...]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_cpu import Servelab

    class OnCheckpoint(Servelab):
        def __init__(self, name: str, half: bool):
            os.environ["SERVELAB_HALF_WEIGHTS"] = "1" if half else "0"  # read at load only
            super().__init__("float32", model=str(ckpt))
            self.name = name

    engines = [OnCheckpoint("bf16 weights", True), OnCheckpoint("fp32 copy", False)]
    os.environ.pop("SERVELAB_HALF_WEIGHTS")
    for e in engines:
        e.decode_b1()
        e.prefill_512()
    results = {e.name: {m: [] for m in metrics} for e in engines}
    for r in range(rounds):
        for m in metrics:
            for e in engines if r % 2 == 0 else reversed(engines):
                results[e.name][m].append(getattr(e, m)())
                print(f"round {r + 1} {m:12s} {e.name:13s} {results[e.name][m][-1]:9.1f} tok/s", file=sys.stderr)
    med = {n: {m: statistics.median(v) for m, v in ms.items()} for n, ms in results.items()}
    print(
        f"\n{ckpt.name} as a bf16 safetensors checkpoint, float32 compute, {torch.get_num_threads()} "
        f"threads, {rounds} interleaved rounds (medians, tok/s)"
    )
    print(f"{'metric':12s} {'bf16 weights':>13s} {'fp32 copy':>11s} {'ratio':>7s}")
    for m in metrics:
        a, b = med["bf16 weights"][m], med["fp32 copy"][m]
        print(f"{m:12s} {a:13.1f} {b:11.1f} {a / b:6.2f}x")
    print(
        "bytes per decode step (weights): "
        + ", ".join(f"{e.name} {e.model.weight_bytes() / 1e6:.0f} MB" for e in engines)
    )
    print(
        "decode stack (one native call a step): "
        + ", ".join(f"{e.name} {e.model.decode_stack is not None}" for e in engines)
    )
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["linears", "engine"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--base", type=Path, default=None, help="linears: another tree's GEMV, timed alongside")
    ap.add_argument("--wall", action="store_true", help="linears: wall time, not CPU time")
    ap.add_argument("--quick", action="store_true", help="the first 2 layers, one round; linears at rows 1 and 16")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = [1, 16], 1
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        name = "smollm2-135m-2-layers-bf16" if args.quick else "smollm2-135m-bf16"
        ckpt = write_bf16_checkpoint(Path(tmp) / name, layers=2 if args.quick else None)
        if args.what == "linears":
            linears(ckpt, args.rows, args.rounds, args.base, args.wall)
        else:
            engine(
                ckpt,
                args.rounds,
                ("decode_b1", "prefill_512") if args.quick else ("decode_b1", "decode_b32", "prefill_512"),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
