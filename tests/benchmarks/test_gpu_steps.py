"""benchmarks/gpu_steps.py without a GPU (the whole script on the CPU, `--quick`), and the H200
steps it measured, priced by the roofline (benchmarks/gpu_steps_check.py)."""

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_steps  # noqa: E402
import gpu_steps_check  # noqa: E402


def test_quick_cpu_run_times_every_step_kind(tmp_path):
    out = tmp_path / "s.json"
    torch.manual_seed(0)
    assert gpu_steps.main(["--device", "cpu", "--quick", "--repeats", "2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    ((name, _, _, prefills, batches, contexts, mixed),) = gpu_steps.QUICK_PLAN
    expected = {(p, 0, 0) for p in prefills} | {(0, b, c) for b in batches for c in contexts} | set(mixed)
    assert {(r["prefill_tokens"], r["decode_batch"], r["decode_context"]) for r in d["steps"]} == expected
    assert all(r["eager_s"] > 0 and "graph_s" not in r for r in d["steps"])  # graphs are CUDA's
    assert d["models"][name]["layers"] == gpu_steps.MODELS[name].layers


def test_a_step_returns_one_row_of_logits_per_sequence():
    m = gpu_steps.Model(gpu_steps.MODELS["tiny"], 2, "bf16", torch.device("cpu"), torch.float32)
    caches = m.caches(3, 8)
    assert m.step(5, 3, 8, caches)().shape == (4, gpu_steps.MODELS["tiny"].vocab)
    assert m.step(5, 0, 0, None)().shape == (1, gpu_steps.MODELS["tiny"].vocab)


def _steps(name: str) -> dict:
    return json.loads((gpu_steps_check.DATA.parent / name).read_text())


@pytest.mark.parametrize(("run", "count"), [("h200_steps.json", 45), ("h100_steps.json", 42)])
def test_plain_steps_priced_by_the_measured_kernels(run, count):
    rows = gpu_steps_check.price(_steps(run))
    assert len(rows) == count
    # The steps run ~20 kernels a layer in plain PyTorch; what the GEMM and attention fits leave
    # out is one cost per layer of tens of microseconds, the same at every shape.
    per_layer_s = rows[0]["per_layer_s"]
    assert 30e-6 < per_layer_s < 100e-6
    errs = [abs(r["kernels_per_layer_error_pct"]) for r in rows]
    assert statistics.median(errs) < 6.0 and sum(e <= 15 for e in errs) >= count - 5
    assert statistics.median(errs) < statistics.median(abs(r["default_error_pct"]) for r in rows)
    # Without it the measured kernels alone price every short step too fast.
    assert all(r["measured_kernels_error_pct"] < 0 for r in rows if r["graph_s"] < 0.01)
    # A CUDA graph removes the host's launches: eager costs more wherever the GPU work is short.
    assert all(r["eager_s"] > r["graph_s"] for r in rows if r["graph_s"] < 0.01)


def test_the_per_layer_cost_is_the_engines_not_the_gpus():
    """The same plain-PyTorch model on two parts, each priced by its part's measured kernels, leaves
    about the same cost a layer (54 and 64 us): it belongs to the engine preset, not to the GPU."""
    h100, h200 = (gpu_steps_check.price(_steps(f"{p}_steps.json"))[0]["per_layer_s"] for p in ("h100", "h200"))
    assert h100 == pytest.approx(h200, rel=0.2)


def test_a_given_per_layer_cost_is_used_as_given():
    zero = gpu_steps_check.price(_steps("h200_steps.json"), per_layer_s=0.0)
    assert all(r["kernels_per_layer_s"] == r["measured_kernels_s"] for r in zero)


@pytest.mark.parametrize(("part", "count", "bound_pct"), [("h200", 18, 6.0), ("h100", 16, 6.5)])
def test_compiled_layers_leave_no_per_layer_cost(part, count, bound_pct):
    """The same steps with each layer compiled (Inductor fuses the norms, rotary, SiLU and adds
    into the GEMMs' neighbours): the measured kernels alone price them, and the fitted per-layer
    cost falls to nothing, so that cost is the engine's, not the GPU's."""
    data = _steps(f"{part}_steps_compiled.json")
    assert all(r["compiled"] for r in data["steps"])
    rows = gpu_steps_check.price(data)
    assert len(rows) == count and rows[0]["per_layer_s"] < 10e-6
    assert statistics.median(abs(r["measured_kernels_error_pct"]) for r in rows) < bound_pct
    plain = {gpu_steps_check.label(r): r["graph_s"] for r in gpu_steps_check.price(_steps(f"{part}_steps.json"))}
    faster = [r["graph_s"] < plain[gpu_steps_check.label(r)] for r in rows if gpu_steps_check.label(r) in plain]
    assert len(faster) >= 10 and all(faster)


def test_the_seeds_h100_figures_on_a_measured_h100():
    """The seed: Llama 3.1 8B in BF16 on one H100 makes ~150 tokens/s at batch 1 and ~4,500 tokens/s
    at batch 64 with 2K contexts. Each layer compiled and the step one CUDA graph, as a fast engine
    runs it: 138 and 5,161 tokens/s, each within 15% of the seed's; and `servelab roofline`'s
    defaults (7.04 and 13.28 ms a step) price both steps within 10%."""
    from servelab.cost.roofline import Roofline
    from servelab.spec.hardware import get_hardware
    from servelab.spec.model import get_model

    rows = {
        (r["decode_batch"], r["decode_context"]): r
        for r in _steps("h100_steps_compiled.json")["steps"]
        if r["model"] == "llama-3.1-8b" and r["dtype"] == "bf16" and not r["prefill_tokens"]
    }
    roofline = Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))
    for batch, seed_tok_s in ((1, 150), (64, 4500)):
        measured_s = rows[batch, 2048]["graph_s"]
        assert batch / measured_s == pytest.approx(seed_tok_s, rel=0.15)
        assert roofline.decode(batch, 2048).time_s == pytest.approx(measured_s, rel=0.10)


def test_compile_needs_a_gpu(tmp_path, capsys):
    assert gpu_steps.main(["--device", "cpu", "--compile", "--out", str(tmp_path / "x.json")]) == 2
    assert "--compile" in capsys.readouterr().err


def test_the_mixed_plan_is_prompt_chunks_beside_decodes(tmp_path, capsys):
    """--mixed: only steps that carry a prompt chunk and decodes at once (28 across three models),
    the steps that pin a part's end-to-end overlap; it is a plan of its own, not a --compile one."""
    steps = [(name, dtype, p) for name, dtype, _, pre, dec, ctx, mixed in gpu_steps.MIXED_PLAN for p in mixed]
    assert all(not pre and not dec and not ctx for _, _, _, pre, dec, ctx, _ in gpu_steps.MIXED_PLAN)
    assert len(steps) == 28 and all(c > 0 and b > 0 and x > 0 for _, _, (c, b, x) in steps)
    assert {(n, d) for n, d, _ in steps} == {
        ("llama-3.1-8b", "bf16"),
        ("llama-3.1-70b", "bf16"),
        ("llama-3.1-8b", "fp8"),
    }
    assert gpu_steps.main(["--device", "cpu", "--compile", "--mixed", "--out", str(tmp_path / "x.json")]) == 2
    assert "one at a time" in capsys.readouterr().err
