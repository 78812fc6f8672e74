"""benchmarks/gpu_kernels.py without a GPU: the whole script on the CPU (`--quick`), whose JSON
must hold every part with FLOPs and bytes that agree with the shapes timed, and the data file of
its H200 run, which the cost model's fit reads."""

import json

import pytest
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_kernels  # noqa: E402


def test_quick_cpu_run_writes_every_part(tmp_path):
    out = tmp_path / "k.json"
    torch.manual_seed(0)
    assert gpu_kernels.main(["--device", "cpu", "--quick", "--repeats", "2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["bandwidth"]["read_bytes_per_s"] > 0 and d["launch"]["eager_s_per_kernel"] > 0
    gemm = d["gemm"]
    assert {(r["layer"], r["m"]) for r in gemm} == {(layer, m) for layer, _, _ in gpu_kernels.QUICK_SHAPES["tiny"]
                                                    for m in gpu_kernels.QUICK_TOKENS}  # fmt: skip
    for r in gemm:
        assert r["time_s"] > 0 and r["flops"] == 2 * r["m"] * r["n"] * r["k"]
        assert r["bytes"] == 4 * r["n"] * r["k"] + 2 * r["m"] * (r["n"] + r["k"])  # fp32 weights, 16-bit activations
    assert [r["seq_len"] for r in d["prefill_attention"]] == gpu_kernels.QUICK["prefill"]
    assert len(d["decode_attention"]) == len(gpu_kernels.QUICK["batches"]) * len(gpu_kernels.QUICK["contexts"])


def test_skip_leaves_parts_out(tmp_path):
    out = tmp_path / "k.json"
    assert gpu_kernels.main(["--device", "cpu", "--quick", "--skip", "gemm,decode", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert "gemm" not in d and "decode_attention" not in d and d["prefill_attention"]


@pytest.mark.parametrize(
    ("run", "device", "dtypes"),
    [
        ("h200_kernels.json", "NVIDIA H200", ("bfloat16", "fp8")),
        ("h100_kernels.json", "NVIDIA H100 80GB HBM3", ("bfloat16", "fp8", "fp8_tensor")),
    ],
)
def test_kernel_runs_are_complete(run, device, dtypes):
    d = json.loads((ROOT / "benchmarks/data" / run).read_text())
    assert d["device"] == device and not any("error" in r for r in d["gemm"])
    expected = {(model, layer, dtype, m) for model, layers in gpu_kernels.SHAPES.items() for layer, _, _ in layers
                for dtype in dtypes for m in gpu_kernels.TOKENS}  # fmt: skip
    assert {(r["model"], r["layer"], r["dtype"], r["m"]) for r in d["gemm"]} == expected
    assert len(d["prefill_attention"]) == len(gpu_kernels.PREFILL_LENS) and d["decode_attention"]
    # Weight streaming at one token cannot beat the copy bandwidth measured in the same run.
    for r in d["gemm"]:
        if r["m"] == 1:
            assert r["bytes"] / r["time_s"] < 1.05 * d["bandwidth"]["copy_bytes_per_s"]


def test_h200_fp8_scaling_data_covers_both_scalings():
    d = json.loads((ROOT / "benchmarks/data/h200_fp8_scaling.json").read_text())
    assert d["device"] == "NVIDIA H200" and "prefill_attention" not in d and "decode_attention" not in d
    for dtype in gpu_kernels.FP8_DTYPES:
        rows = [r for r in d["gemm"] if r["dtype"] == dtype]
        assert len(rows) == sum(len(v) for v in gpu_kernels.SHAPES.values()) * len(gpu_kernels.TOKENS)
        assert all("time_s" in r and r["bytes"] == r["n"] * r["k"] + 2 * r["m"] * (r["n"] + r["k"]) for r in rows)


def test_fp8_on_a_cpu_is_refused_by_name(tmp_path, capsys):
    assert gpu_kernels.main(["--device", "cpu", "--quick", "--dtypes", "fp8_tensor", "--out", str(tmp_path / "x")]) == 2
    assert "--dtypes fp8_tensor: not timed on cpu" in capsys.readouterr().err


def test_int4_on_a_cpu_is_refused_by_name(tmp_path, capsys):
    assert gpu_kernels.main(["--device", "cpu", "--quick", "--dtypes", "int4", "--out", str(tmp_path / "x")]) == 2
    assert "--dtypes int4: not timed on cpu" in capsys.readouterr().err


def test_h200_int4_data_streams_below_the_copy_bandwidth():
    d = json.loads((ROOT / "benchmarks/data/h200_int4.json").read_text())
    rows = d["gemm"]
    assert d["device"] == "NVIDIA H200" and rows and not any("error" in r for r in rows)
    assert {r["dtype"] for r in rows} == {"int4"}
    for r in rows:
        packed = r["n"] * r["k"] // 2 + r["k"] // gpu_kernels.INT4_GROUP * r["n"] * 4  # codes, bf16 scale and zero
        assert r["bytes"] == packed + 2 * r["m"] * (r["n"] + r["k"]) and r["time_s"] > 0
        assert r["bytes"] / r["time_s"] < 4.3e12  # the H200's measured copy rate, 4.2 TB/s
