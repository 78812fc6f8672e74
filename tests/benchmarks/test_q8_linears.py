"""benchmarks/q8_linears.py in its --quick modes on the bundled model: the int8 dot products timed
against the exact kernels per linear, and engine decode on both paths."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import q8_linears  # noqa: E402

from servelab.runtime import native  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_the_bundled_model_and_kernels():
    from servelab.engine.bundled import bundled_model_path

    try:
        bundled_model_path()
    except Exception as e:  # noqa: BLE001 - the bundled model package is optional
        pytest.skip(f"bundled model unavailable: {e}")
    if native.native_kernels() is None:
        pytest.skip(f"no native kernels here: {native.load_error}")


@pytest.mark.slow
def test_quick_times_the_three_paths_per_linear(capsys):
    q8_linears.main(["--quick"])
    out = capsys.readouterr().out
    line = re.search(r"^rows\s+2: .*exact / one pass ([\d.]+)x, exact / two passes ([\d.]+)x$", out, re.M)
    assert line, out
    assert all(float(r) > 0 for r in line.groups())
    assert all(name in out for name in ("qkv ", "o ", "gate_up ", "down ", "head "))


@pytest.mark.slow
def test_quick_decode_times_exact_and_both_thresholds(capsys):
    q8_linears.main(["--quick", "--decode", "2"])
    out = capsys.readouterr().out
    found = re.search(
        r"^B=2: exact ([\d.]+) tok/s  int8 from 1 row ([\d.]+) tok/s  int8 from 2 rows ([\d.]+) tok/s$", out, re.M
    )
    assert found, out
    assert all(float(v) > 0 for v in found.groups())
