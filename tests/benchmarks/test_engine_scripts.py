"""The engine benchmarks that take a model (`--model`), in their `--quick` modes on a tiny random
Llama: each must print the figures it exists for."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import determinism  # noqa: E402
import served_steps  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.mark.slow
def test_determinism_quick_deterministic_mode_matches_bit_for_bit(tiny, capsys):
    determinism.main(["--model", tiny, "--quick", "--deterministic", "--json"])
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert report["prompts"] == 4 and set(runs) == {"alone", "batched", "chunked", "preempted", "preempted vs batched"}
    assert runs["preempted"]["preemptions"] > 0, "the quick KV pool is meant to preempt"
    assert all(r["tokens"] == 0 and r["logprob_bits"] == 0 for r in runs.values()), runs


def test_served_steps_quick_prints_a_row_per_step_shape(tiny, capsys):
    served_steps.main(["--model", tiny, "--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d", line)]
    shapes = [tuple(map(int, re.match(r"\| (\d+) \((\d+)\)", r).groups())) for r in rows]
    assert shapes == [(128, 1), (129, 2), (256, 2)]
    assert rows[0].split("|")[3].strip() == "1.00"  # the 128-token prefill against itself
    assert all(float(r.split("|")[2].replace("ms", "").replace(",", "")) > 0 for r in rows)
