"""benchmarks/gpu_steps.py without a GPU (the whole script on the CPU, `--quick`), and the H200
steps it measured, priced by the roofline (benchmarks/gpu_steps_check.py)."""

import json
import statistics
import sys
from pathlib import Path

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


def test_h200_steps_priced_by_the_measured_kernels():
    rows = gpu_steps_check.price(json.loads(gpu_steps_check.DATA.read_text()))
    assert len(rows) == 45
    # The steps run ~20 kernels a layer in plain PyTorch; what the GEMM and attention fits leave
    # out is one cost per layer of tens of microseconds, the same at every shape.
    per_layer_s = rows[0]["per_layer_s"]
    assert 30e-6 < per_layer_s < 100e-6
    errs = [abs(r["kernels_per_layer_error_pct"]) for r in rows]
    assert statistics.median(errs) < 6.0 and sum(e <= 15 for e in errs) >= 40
    assert statistics.median(errs) < statistics.median(abs(r["default_error_pct"]) for r in rows)
    # Without it the measured kernels alone price every short step too fast.
    assert all(r["measured_kernels_error_pct"] < 0 for r in rows if r["graph_s"] < 0.01)
    # A CUDA graph removes the host's launches: eager costs more wherever the GPU work is short.
    assert all(r["eager_s"] > r["graph_s"] for r in rows if r["graph_s"] < 0.01)


def test_a_given_per_layer_cost_is_used_as_given():
    data = json.loads(gpu_steps_check.DATA.read_text())
    zero = gpu_steps_check.price(data, per_layer_s=0.0)
    assert all(r["kernels_per_layer_s"] == r["measured_kernels_s"] for r in zero)


def test_compiled_layers_leave_no_per_layer_cost():
    """The same steps with each layer compiled (Inductor fuses the norms, rotary, SiLU and adds
    into the GEMMs' neighbours): the measured kernels alone price them, and the fitted per-layer
    cost falls to nothing, so that cost is the engine's, not the GPU's."""
    data = json.loads((gpu_steps_check.DATA.parent / "h200_steps_compiled.json").read_text())
    assert all(r["compiled"] for r in data["steps"])
    rows = gpu_steps_check.price(data)
    assert len(rows) == 18 and rows[0]["per_layer_s"] < 10e-6
    assert statistics.median(abs(r["measured_kernels_error_pct"]) for r in rows) < 6.0
    plain = {
        gpu_steps_check.label(r): r["graph_s"]
        for r in gpu_steps_check.price(json.loads(gpu_steps_check.DATA.read_text()))
    }
    faster = [r["graph_s"] < plain[gpu_steps_check.label(r)] for r in rows if gpu_steps_check.label(r) in plain]
    assert len(faster) >= 10 and all(faster)


def test_compile_needs_a_gpu(tmp_path, capsys):
    assert gpu_steps.main(["--device", "cpu", "--compile", "--out", str(tmp_path / "x.json")]) == 2
    assert "--compile" in capsys.readouterr().err
