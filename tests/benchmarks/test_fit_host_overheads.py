"""benchmarks/fit_host_overheads.py: the vllm engine profile's host costs are the fit of Vidur's
vLLM CPU profile, and the fit is a least-squares line."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fit_host_overheads as fho  # noqa: E402

from servelab.sim.engine_profiles import engine_profile  # noqa: E402


def test_the_fit_recovers_a_line():
    rows = [("m", b, 1, 0.002 + 3e-5 * b) for b in (8, 16, 64, 128)]
    step_s, per_seq_s = fho.fit(rows)
    assert step_s == pytest.approx(0.002) and per_seq_s == pytest.approx(3e-5)


def test_the_vllm_profile_carries_the_fit_of_vidurs_rows():
    rows = fho.host_rows()
    assert len(rows) == 78 and {r[2] for r in rows} == {1, 2, 4}
    step_s, per_seq_s = fho.fit(rows)
    host = engine_profile("vllm").entries["host"]
    assert host["step_s"] == fho.round_sig(step_s)
    assert host["per_seq_s"] == fho.round_sig(per_seq_s)
