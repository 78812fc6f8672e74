"""benchmarks/moe_bytes.py --quick on tiny MoEs: the engine's counted weight bytes per decode step
are the dense part plus k experts per MoE layer at batch 1 and nearly every expert at batch 64, and
the roofline's bytes match them within 10% at both."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_bytes  # noqa: E402

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_moe_bytes_quick_engine_and_roofline_agree_at_batch_1_and_64(family, capsys):
    assert moe_bytes.main(["--quick", "--json", "--family", family]) == 0
    rows = {r["batch"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {1, 64}
    one, many = rows[1], rows[64]
    assert one["experts_hit_per_layer"] == pytest.approx(2.0)  # top-2: exactly two experts a layer
    assert many["experts_hit_per_layer"] > 7.0  # of 8: nearly all
    assert one["dense_bytes"] < one["engine_bytes"] < many["engine_bytes"] <= many["all_bytes"]
    for r in rows.values():
        assert r["ratio"] == pytest.approx(1.0, abs=0.10), r


def test_moe_bytes_prints_the_table(capsys):
    assert moe_bytes.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "| 64 | " in out and "roofline / engine" in out
