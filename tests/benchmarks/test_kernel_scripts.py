"""The kernel benchmarks on the bundled model's matrices, in their `--quick` modes: each must print
its timings and, where it measures one, an error inside the kernel's accuracy contract."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import int8_linear  # noqa: E402


@pytest.mark.slow
def test_int8_linear_quick_times_three_paths_and_keeps_the_error_small(capsys):
    int8_linear.main(["--quick"])
    out = capsys.readouterr().out
    assert out.startswith("9 matrices")  # 2 layers x 4 fused linears + the head
    rows = {int(m[0]): m for m in re.findall(r"^\s+(\d+)\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+)$",
                                             out, re.M)}
    assert set(rows) == {1, 8}
    for _, *times, err_ours, err_fbgemm in rows.values():
        assert all(float(t) > 0 for t in times)
        assert 0 < float(err_ours) < 0.05 and 0 < float(err_fbgemm) < 0.05
