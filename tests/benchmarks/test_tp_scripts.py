"""The tensor-parallel benchmarks in `--quick` mode on a tiny random model at TP=2: gloo ranks on
127.0.0.1 and TP engines, each printing the figures it exists for."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tp_allreduce  # noqa: E402
import tp_kv_gather  # noqa: E402

pytestmark = pytest.mark.slow  # worker processes joined by gloo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def test_tp_allreduce_quick_times_the_messages_and_both_engines(tiny, capsys):
    tp_allreduce.main(["--model", tiny, "--quick", "--check", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["hidden"] == 64 and result["model"]["layers"] == 2
    rows = result["allreduce"]["2"]
    assert [r["tokens"] for r in rows] == list(tp_allreduce.TOKENS)
    assert all(r["bytes"] == r["tokens"] * 64 * 4 and r["median_us"] > 0 for r in rows)
    assert [s["tp"] for s in result["steps"]] == [1, 2]
    assert all(s["prefill_128_ms"] > 0 and s["decode_b1_ms"] > 0 for s in result["steps"])
    assert result["cost_model"]["allreduces_per_step"] == 4
    predicted = result["profile_tp_term"]["predicted_tp_step"]
    assert all(predicted[k] >= result["steps"][0][k] for k in predicted)  # TP=1's step plus the collectives
    check = result["check"]
    assert check["greedy_64_equal"] and check["max_abs_logit_diff"] < 1e-3 * check["max_abs_logit"]


def test_tp_allreduce_prints_its_table(tiny, capsys):
    tp_allreduce.main(["--model", tiny, "--quick"])
    out = capsys.readouterr().out
    assert "gloo all-reduce, 2 ranks, fp32 [tokens, 64]:" in out
    assert len(re.findall(r"^\s+\d+ tokens\s+\d+ B\s+[\d.]+ us\s+[\d.]+ MB/s$", out, re.M)) == len(tp_allreduce.TOKENS)
    assert re.search(r"^TP=2: prefill 128 tokens [\d.]+ ms, decode batch 1 [\d.]+ ms/step$", out, re.M)
    assert re.search(r"^profile TP term \(2 ranks\): latency \d+ us", out, re.M)


def test_tp_kv_gather_quick_times_export_and_import_at_both_sizes(tiny, capsys):
    tp_kv_gather.main(["--model", tiny, "--quick"])
    out = capsys.readouterr().out
    # one 16-token block of 2 layers, K and V, 2 KV heads of 16 dims, fp32
    assert out.startswith("one block = 8 KiB ((2, 2, 2, 16, 16)), 3 interleaved rounds"), out
    names = re.findall(r"^(\w+ TP=\d(?: \(\w+\))?)\s+median\s+([\d.]+) ms\s+p90\s+([\d.]+) ms$", out, re.M)
    assert [n for n, _, _ in names] == [
        "export_block TP=1",
        "export_block TP=2 (gather)",
        "import_block TP=1",
        "import_block TP=2 (scatter)",
    ]
    assert all(0 < float(med) <= float(p90) for _, med, p90 in names)


@pytest.mark.parametrize("script", [tp_allreduce, tp_kv_gather])
def test_tp_scripts_refuse_tp_1(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(["--tp", "1"])
    assert exc.value.code == 2 and "--tp" in capsys.readouterr().err
