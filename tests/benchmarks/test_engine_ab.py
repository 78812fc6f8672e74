"""benchmarks/engine_ab.py, a checkout against itself in `--quick` mode on a tiny random model:
two workers, every metric timed in each, medians and their ratios printed."""

import re
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_ab  # noqa: E402


@pytest.mark.slow  # two worker processes, each loading an engine
def test_engine_ab_quick_compares_a_checkout_with_itself(tmp_path, capsys):
    tiny = write_tiny_llama(tmp_path / "tiny")
    assert engine_ab.main([str(ROOT), str(ROOT), "--quick", "--model", str(tiny)]) == 0
    out = capsys.readouterr().out
    rounds = re.findall(r"^round (\d+): (.*)$", out, re.M)
    assert [n for n, _ in rounds] == ["1"]
    for label in ("wall clock", "CPU time"):
        line = re.search(rf"^{label}\s+medians, old / new \(tok/s\): (.*)$", out, re.M)
        assert line, out
        cells = re.findall(r"(\w+) ([\d.]+) / ([\d.]+) = ([\d.]+)x", line.group(1))
        assert [c[0] for c in cells] == list(engine_ab.METRICS)
        for _, old, new, ratio in cells:
            assert float(old) > 0 and float(new) > 0
            assert float(ratio) == pytest.approx(float(new) / float(old), abs=1e-3)
    assert "default linears, 1 thread(s), 1 rounds" in out


def test_engine_ab_refuses_zero_rounds(capsys):
    with pytest.raises(SystemExit) as exc:
        engine_ab.main([str(ROOT), str(ROOT), "--rounds", "0"])
    assert exc.value.code == 2 and "--rounds must be >= 1, got 0" in capsys.readouterr().err
