"""The kernel benchmarks on the bundled model's matrices, in their `--quick` modes: each must print
its timings and, where it measures one, an error inside the kernel's accuracy contract."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemv_layouts  # noqa: E402
import half_weights  # noqa: E402
import int8_linear  # noqa: E402
import isa_levels  # noqa: E402
import panel_linears  # noqa: E402

from servelab.runtime import block_quant, native  # noqa: E402


@pytest.fixture
def kernels() -> native.NativeKernels:
    found = native.native_kernels()
    if found is None:
        pytest.skip(f"no native kernels here: {native.load_error}")
    return found


@pytest.mark.slow
def test_int8_linear_quick_times_three_paths_and_keeps_the_error_small(capsys):
    int8_linear.main(["--quick"])
    out = capsys.readouterr().out
    assert out.startswith("9 matrices")  # 2 layers x 4 fused linears + the head
    rows = {
        int(m[0]): m
        for m in re.findall(
            r"^\s+(\d+)\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+)$", out, re.M
        )
    }
    assert set(rows) == {1, 8}
    for _, *times, err_ours, err_fbgemm in rows.values():
        assert all(float(t) > 0 for t in times)
        assert 0 < float(err_ours) < 0.05 and 0 < float(err_fbgemm) < 0.05


@pytest.mark.slow
def test_isa_levels_quick_times_each_build_against_the_first(kernels, capsys):
    levels = list(dict.fromkeys(["portable", kernels.level]))
    isa_levels.main(["--quick", "--levels", *levels, "--base", str(ROOT)])  # this tree as the base
    out = capsys.readouterr().out
    builds = [name for level in levels for name in (f"base-{level}", level)]
    rows = re.findall(r"^(\w+) (?:rows|n)\s+(\d+): (.*)$", out, re.M)
    want = [(kind, n) for kind in ("gguf", "int8", "bf16", "bf16dot") for n in ("1", "16")] + [("attn", "64")]
    assert [(kind, n) for kind, n, _ in rows] == want
    for *_, cells in rows:
        found = re.findall(r"(\S+)\s+([\d.]+) \(([\d.]+)\)", cells)
        assert [name for name, _, _ in found] == builds
        assert float(found[0][2]) == 1.0 and all(float(ms) > 0 for _, ms, _ in found)


@pytest.mark.slow
def test_panel_linears_quick_sums_the_kinds_of_each_row_count(kernels, capsys):
    panel_linears.main(["--quick", "--level", kernels.level, "--base", str(ROOT)])
    rows = re.findall(r"^rows\s+(\d+) (\w+)\s+(.*)$", capsys.readouterr().out, re.M)
    assert [(n, kind) for n, kind, _ in rows] == [
        (n, k) for n in ("4", "16") for k in (*panel_linears.KINDS, "lm_head", "all")
    ]
    for i in range(0, len(rows), 6):
        cells = [re.findall(r"(\w+)\s+([\d.]+) \(\s*([\d.]+)\)", c) for _, _, c in rows[i : i + 6]]
        for b, name in enumerate(("ours", "base", "mkl")):
            assert all(row[b][0] == name and float(row[b][2]) > 0 for row in cells)
            assert float(cells[-1][b][1]) == pytest.approx(sum(float(row[b][1]) for row in cells[:-1]), abs=0.05)


@pytest.mark.slow
def test_gemv_layouts_quick_streams_both_layouts(kernels, capsys):
    if not block_quant.grouped_q4_1(kernels):
        pytest.skip(native.unavailable_reason("avx512") or f"the kernels run at {kernels.level}, which keeps GGUF rows")
    gemv_layouts.main(["--quick"])
    out = capsys.readouterr().out
    assert out.startswith("8 Q4_1 matrices")  # 2 layers x 4 fused linears
    bandwidth = float(re.search(r"host read bandwidth ([\d.]+) GB/s", out).group(1))
    rates = {
        name: (float(rate), int(share))
        for name, rate, share in re.findall(r"^(Q4_1_G16|GGUF rows)\s+stream\s+([\d.]+) GB/s \(\s*(\d+)%\)", out, re.M)
    }
    assert set(rates) == {"Q4_1_G16", "GGUF rows"}
    for rate, share in rates.values():
        assert rate > 0 and share == pytest.approx(100 * rate / bandwidth, abs=2)
    ratio = float(re.search(r"stream ([\d.]+)x", out).group(1))
    assert ratio == pytest.approx(rates["Q4_1_G16"][0] / rates["GGUF rows"][0], rel=0.05, abs=0.02)


@pytest.mark.slow
def test_half_weights_quick_linears_time_every_path(kernels, capsys):
    half_weights.main(["linears", "--quick", "--threads", "1"])
    rows = re.findall(r"^\s+(\d+)((?:\s+[\d.]+){4})\s+([\d.]+)$", capsys.readouterr().out, re.M)
    assert [n for n, _, _ in rows] == ["1", "16"]
    for _, cells, best in rows:
        fp32, *bf16 = (float(v) for v in cells.split())
        assert fp32 > 0 and min(bf16) > 0
        assert float(best) == pytest.approx(min(bf16[:3]) / fp32, abs=0.01)


@pytest.mark.slow
def test_half_weights_quick_engine_keeps_bf16_at_half_the_bytes(kernels, capsys):
    half_weights.main(["engine", "--quick"])
    out = capsys.readouterr().out
    rows = dict(
        (m, (float(a), float(b), float(r)))
        for m, a, b, r in re.findall(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out, re.M)
    )
    assert set(rows) == {"decode_b1", "prefill_512"}
    for a, b, ratio in rows.values():
        assert a > 0 and b > 0 and ratio == pytest.approx(a / b, abs=0.01)
    half, full = (int(mb) for mb in re.search(r"bf16 weights (\d+) MB, fp32 copy (\d+) MB", out).groups())
    assert half == pytest.approx(full / 2, abs=1)
