"""benchmarks/spec_decode.py in its `--quick` mode on a tiny random Llama: it must time both runs,
report the speedup and acceptance, and find the same greedy outputs with and without speculation."""

import json
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import spec_decode  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def test_spec_decode_quick_reports_tpot_speedup_and_acceptance(tiny, capsys):
    report = spec_decode.main(["--model", tiny, "--quick", "--deterministic", "--json"])
    assert json.loads(capsys.readouterr().out) == report
    assert report["through"] == "the engine" and report["prompts"] == 2
    assert report["tpot_ms"]["plain"] > 0 and report["tpot_ms"]["ngram"] > 0
    assert report["speedup"] == pytest.approx(report["tpot_ms"]["plain"] / report["tpot_ms"]["ngram"])
    assert 0 <= report["acceptance_rate"] <= 1 and report["tokens_per_verification"] >= 0
    assert report["outputs_differing"] == 0


def test_spec_decode_quick_prints_the_table(tiny, capsys):
    spec_decode.main(["--model", tiny, "--quick", "--deterministic"])
    out = capsys.readouterr().out
    assert "speedup" in out and "acceptance" in out and "outputs differing: 0" in out
