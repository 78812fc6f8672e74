"""Time whole engine steps of a Llama-shaped model on one device: prefill, decode and mixed steps,
as one CUDA graph each (as gpt-fast and vLLM's CUDA-graph decode run them) and launched eagerly
from Python. The cost model prices steps, so these are its end-to-end check on a GPU: the kernel
fits of benchmarks/gpu_kernels.py summed into a step, against the step measured.

    python benchmarks/gpu_steps.py --out gpu_steps.json                  # on a CUDA device
    python benchmarks/gpu_steps.py --compile --out gpu_steps_compiled.json  # each layer compiled
    python benchmarks/gpu_steps.py --mixed --out gpu_steps_mixed.json    # prompt chunks beside decodes
    python benchmarks/gpu_steps.py --device cpu --quick --out x.json     # the same code on a CPU

The model is written here in plain PyTorch, weights random (timing does not depend on their
values): RMSNorm, fused QKV, RoPE, attention through scaled_dot_product_attention (causal over
the prompt in a prefill; in decode one query row per query head over the sequence's whole KV,
grouped heads packed as flash-decoding packs them, so each KV head is read once), fused gate/up,
SiLU, down, and the LM head over the last token of each sequence. A decode step also writes its
new K and V into a static per-sequence cache. A mixed step runs the linear layers once over the
prefill chunk and the decode tokens together, and each part's attention apart, as vLLM flattens
a batch. FP8 runs every linear layer as torch._scaled_mm with one scale a tensor, the activation
cast to FP8 inside the step. --layers cuts a model that does not fit to its first N layers; the
JSON records the layers run, and the cost model is asked about that many layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = {
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": Shape(8192, 80, 64, 8, 128, 28672, 128256),
    "tiny": Shape(256, 2, 4, 2, 64, 512, 1024),
}

# (model, dtype, layers or None for all, prefill lengths, decode batches, decode contexts, mixed)
FULL_PLAN = [
    (
        "llama-3.1-8b",
        "bf16",
        None,
        [128, 256, 512, 1024, 2048, 4096, 8192],
        [1, 8, 32, 64, 128, 256],
        [512, 2048, 8192],
        [(512, 16, 2048), (512, 64, 2048), (2048, 64, 2048)],
    ),
    ("llama-3.1-8b", "fp8", None, [128, 512, 2048, 8192], [1, 64, 256], [2048], [(512, 64, 2048)]),
    ("llama-3.1-70b", "bf16", 16, [128, 512, 2048, 8192], [1, 64, 256], [512, 2048], [(512, 64, 2048)]),
]
# --compile: fewer shapes, each compiled once (Inductor takes tens of seconds a shape)
COMPILED_PLAN = [
    (name, dtype, layers, [128, 2048], [1, 64, 256], [2048], [(512, 64, 2048)])
    for name, dtype, layers in (
        ("llama-3.1-8b", "bf16", None),
        ("llama-3.1-70b", "bf16", 16),
        ("llama-3.1-8b", "fp8", None),
    )
]
# --mixed: prompt chunks beside decode batches, the steps a serving engine runs under load and the
# ones that pin how compute and memory overlap in a step (the end-to-end roofline's sharpness).
MIXED_PLAN = [
    (
        "llama-3.1-8b",
        "bf16",
        None,
        [],
        [],
        [],
        [(c, b, x) for c in (128, 512, 2048) for b in (16, 64, 128) for x in (512, 2048)],
    ),
    ("llama-3.1-70b", "bf16", 16, [], [], [], [(c, b, 2048) for c in (128, 512, 2048) for b in (16, 128)]),
    ("llama-3.1-8b", "fp8", None, [], [], [], [(c, b, 2048) for c in (128, 2048) for b in (16, 128)]),
]
QUICK_PLAN = [("tiny", "bf16", None, [16, 64], [1, 4], [32, 128], [(16, 4, 32)])]
MAX_KV_BYTES = 72 << 30
ACTIVATION_ROOM = 6 << 30  # a step's activations and the graph's pool, beside the KV cache


class Model:
    """Weights and caches of a Llama-shaped decoder, and its three kinds of step."""

    def __init__(self, shape: Shape, layers: int, dtype: str, device: torch.device, act: torch.dtype):
        self.s, self.layers, self.fp8, self.device, self.act = shape, layers, dtype == "fp8", device, act
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

        def lin(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.randn(n, k, device=device, dtype=act) * 0.02
            if not self.fp8:
                return w, None
            # Column-major (K, N) FP8 codes, as cuBLASLt takes them; one scale a tensor.
            return w.to(torch.float8_e4m3fn).t(), torch.ones((), device=device)

        self.w = [dict(qkv=lin(q + 2 * kv, shape.hidden), o=lin(shape.hidden, q),
                       gate_up=lin(2 * shape.intermediate, shape.hidden), down=lin(shape.hidden, shape.intermediate),
                       n1=torch.ones(shape.hidden, device=device, dtype=act),
                       n2=torch.ones(shape.hidden, device=device, dtype=act))
                  for _ in range(layers)]  # fmt: skip
        self.embed = torch.randn(shape.vocab, shape.hidden, device=device, dtype=act) * 0.02
        self.head = lin(shape.vocab, shape.hidden)
        self.norm = torch.ones(shape.hidden, device=device, dtype=act)
        self.one = torch.ones((), device=device)
        try:  # does the prefill backend take grouped KV heads as they are?
            t = torch.zeros(1, shape.heads, 16, shape.head_dim, device=device, dtype=act)
            kv = torch.zeros(1, shape.kv_heads, 16, shape.head_dim, device=device, dtype=act)
            F.scaled_dot_product_attention(t, kv, kv, is_causal=True, enable_gqa=True)
            self.gqa = True
        except (RuntimeError, TypeError):
            self.gqa = False

    def linear(self, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        if w[1] is None:
            return F.linear(x, w[0])
        return torch._scaled_mm(x.to(torch.float8_e4m3fn), w[0], scale_a=self.one, scale_b=w[1], out_dtype=self.act)

    def rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's rotary angles, (tokens, 1, head_dim / 2), once a step."""
        d = self.s.head_dim // 2
        freq = 1.0 / (500000.0 ** (torch.arange(d, device=pos.device, dtype=torch.float32) / d))
        ang = pos.float()[:, None] * freq
        return ang.cos().to(self.act)[:, None, :], ang.sin().to(self.act)[:, None, :]

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.s.head_dim // 2
        x1, x2 = x[..., :d], x[..., d:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rep = self.s.heads // self.s.kv_heads  # a backend without grouped heads: expand K and V
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )

    def caches(self, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = (batch, self.s.kv_heads, context + 1, self.s.head_dim)
        return [(torch.randn(kv, device=self.device, dtype=self.act), torch.randn(kv, device=self.device, dtype=self.act))
                for _ in range(self.layers)]  # fmt: skip

    def layer(self, x: torch.Tensor, w: dict, cache: tuple[torch.Tensor, torch.Tensor] | None, cos: torch.Tensor,
              sin: torch.Tensor, prefill: int, batch: int, context: int) -> torch.Tensor:  # fmt: skip
        """One decoder layer over the step's tokens: the prompt's first, then the decodes'."""
        s = self.s
        q_dim, kv_dim, group = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.heads // s.kv_heads
        h = F.rms_norm(x, (s.hidden,), w["n1"])
        qkv = self.linear(h, w["qkv"])
        q = self.rope(qkv[:, :q_dim].view(-1, s.heads, s.head_dim), cos, sin)
        k = self.rope(qkv[:, q_dim : q_dim + kv_dim].view(-1, s.kv_heads, s.head_dim), cos, sin)
        v = qkv[:, q_dim + kv_dim :].view(-1, s.kv_heads, s.head_dim)
        outs = []
        if prefill:
            qp, kp, vp = (t[:prefill].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(self.causal(qp, kp, vp).squeeze(0).transpose(0, 1).reshape(prefill, q_dim))
        if batch:
            assert cache is not None
            kc, vc = cache
            kc[:, :, context] = k[prefill:]
            vc[:, :, context] = v[prefill:]
            qd = q[prefill:].view(batch, s.kv_heads, group, s.head_dim)
            outs.append(F.scaled_dot_product_attention(qd, kc, vc).reshape(batch, q_dim))
        x = x + self.linear(torch.cat(outs) if len(outs) > 1 else outs[0], w["o"])
        h = self.linear(F.rms_norm(x, (s.hidden,), w["n2"]), w["gate_up"])
        g, u = h.chunk(2, dim=-1)
        return x + self.linear(F.silu(g) * u, w["down"])

    def step(self, prefill: int, batch: int, context: int, caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
             compiled: bool = False) -> Callable[[], torch.Tensor]:  # fmt: skip
        """A step over one `prefill`-token prompt (0: none) and `batch` decodes at `context`;
        `compiled`: each layer through torch.compile (Inductor fuses its small kernels, as
        gpt-fast's compiled decode does)."""
        s = self.s
        tokens = torch.randint(0, s.vocab, (prefill + batch,), device=self.device)
        pos = torch.cat((torch.arange(prefill, device=self.device), torch.full((batch,), context, device=self.device)))
        if compiled:  # one compile per step shape; past dynamo's default limit (8) it would run uncompiled
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        layer = torch.compile(self.layer, dynamic=False) if compiled else self.layer

        def run() -> torch.Tensor:
            x = self.embed[tokens]
            cos, sin = self.rotary(pos)
            for i, w in enumerate(self.w):
                x = layer(x, w, caches[i] if caches else None, cos, sin, prefill, batch, context)
            last = torch.cat((x[prefill - 1 : prefill], x[prefill:])) if prefill else x
            return self.linear(F.rms_norm(last, (s.hidden,), self.norm), self.head)

        return run


def time_step(run: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of the step replayed as one CUDA graph, and launched eagerly."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):
        run()
    sync()
    eager = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        eager.append(time.perf_counter() - t0)
    out = {"eager_s": statistics.median(eager)}
    if cuda:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            graph.replay()
            sync()
            times.append(time.perf_counter() - t0)
        out["graph_s"] = statistics.median(times)
        del graph
    return out


def measure(plan: list, device: torch.device, repeats: int, max_kv_bytes: int, compiled: bool = False) -> list[dict]:
    rows = []
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name, dtype, layers, prefills, batches, contexts, mixed in plan:
        shape = MODELS[name]
        n_layers = layers or shape.layers
        if dtype == "fp8" and device.type != "cuda":
            continue
        model = Model(shape, n_layers, dtype, device, act)
        kv_per_token = n_layers * 2 * shape.kv_heads * shape.head_dim * act.itemsize
        points = [(t, 0, 0) for t in prefills] + [(0, b, c) for b in batches for c in contexts] + list(mixed)
        room = max_kv_bytes
        if device.type == "cuda":  # what is left beside the weights, less room for a step's activations
            room = min(room, torch.cuda.mem_get_info(device)[0] - ACTIVATION_ROOM)
        for prefill, batch, context in points:
            row = dict(model=name, dtype=dtype, layers=n_layers, model_layers=shape.layers, prefill_tokens=prefill,
                       decode_batch=batch, decode_context=context)  # fmt: skip
            kv_bytes = batch * (context + 1) * kv_per_token
            caches = None
            if kv_bytes > room:  # never a prefill alone: it keeps no cache
                row["skipped"] = f"its KV cache, {kv_bytes / 2**30:.1f} GiB, does not fit"
            else:
                caches = model.caches(batch, context) if batch else None
                if compiled:
                    row["compiled"] = True
                try:
                    row.update(time_step(model.step(prefill, batch, context, caches, compiled), device, repeats))
                except (RuntimeError, TypeError) as e:  # e.g. an FP8 shape cuBLASLt refuses
                    row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            shown = " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in row.items() if k.endswith("_s"))
            print(f"{name} {dtype} L{n_layers} prefill={prefill} decode={batch}x{context} "
                  f"{shown or row.get('error') or row['skipped']}", flush=True)  # fmt: skip
            del caches
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few points (a smoke test)")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per point (median)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="each layer through torch.compile, on fewer shapes (COMPILED_PLAN); CUDA only",
    )
    ap.add_argument("--mixed", action="store_true", help="only mixed steps, prompt chunks beside decodes (MIXED_PLAN)")
    args = ap.parse_args(argv)
    if args.compile and args.mixed:
        print("gpu_steps: --compile and --mixed are two plans; run them one at a time", file=sys.stderr)
        return 2
    if args.compile and args.device != "cuda":
        print("gpu_steps: --compile times Inductor's GPU kernels; it needs --device cuda", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_steps: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    torch.manual_seed(0)
    plan = QUICK_PLAN if args.quick else COMPILED_PLAN if args.compile else MIXED_PLAN if args.mixed else FULL_PLAN
    result: dict = dict(torch=torch.__version__, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                        quick=args.quick, repeats=args.repeats,
                        models={name: asdict(MODELS[name]) for name, *_ in plan})  # fmt: skip
    started = time.perf_counter()
    result["steps"] = []
    for entry in plan:  # written after each model: a run cut short keeps what it had
        result["steps"] += measure([entry], dev, args.repeats, MAX_KV_BYTES, compiled=args.compile)
        result["wall_s"] = time.perf_counter() - started
        args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0 if all("error" not in r for r in result["steps"]) or not args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
