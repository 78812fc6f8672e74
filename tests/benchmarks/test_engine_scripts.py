"""The engine benchmarks that take a model (`--model`), in their `--quick` modes on a tiny random
Llama: each must print the figures it exists for."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import build_ab  # noqa: E402
import decode_step_split  # noqa: E402
import determinism  # noqa: E402
import engine_cpu  # noqa: E402
import prefill_step_split  # noqa: E402
import served_steps  # noqa: E402
import structured_outputs  # noqa: E402

from servelab.runtime import native  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def kernels():
    if native.native_kernels() is None:
        pytest.skip(f"no native kernels here: {native.load_error}")


def _table(out: str, first: str) -> dict[str, list[float]]:
    """The rows of a printed table whose first cell is one of `first`'s words: name -> numbers."""
    rows = re.findall(rf"^\s*({first})\s+([-\d.\s%x]+)$", out, re.M)
    return {name: [float(v.rstrip("%x")) for v in cells.split()] for name, cells in rows}


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


@pytest.mark.slow
def test_engine_cpu_quick_gives_both_engines_rates_and_their_ratios(tiny, capsys):
    engine_cpu.main(["--model", tiny, "--quick", "--dtype", "float32", "--deterministic", "--json"])
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    metrics = {"decode_b1", "decode_b32", "prefill_512"}
    for name in ("servelab", "hf", "deterministic"):
        assert set(report[name]) == metrics and all(v > 0 for v in report[name].values()), report[name]
    for m in metrics:
        assert report["ratios"][m] == pytest.approx(report["servelab"][m] / report["hf"][m])
        assert report["deterministic_ratios"][m] == pytest.approx(report["deterministic"][m] / report["servelab"][m])
    assert 0 < report["mbu_b1"] < 1 and report["decode_step_bytes"] > 0


def test_engine_cpu_quick_times_the_default_against_exact(tiny, capsys):
    engine_cpu.main(["--model", tiny, "--quick", "--dtype", "auto", "--exact", "--no-hf", "--json"])
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    for m, ratio in report["exact_ratios"].items():
        assert ratio == pytest.approx(report["servelab"][m] / report["exact"][m]) and ratio > 0


def test_decode_step_split_quick_splits_both_modes_into_kernels_and_the_rest(tiny, kernels, capsys):
    decode_step_split.main(["--model", tiny, "--quick", "--quantization", "int8", "--batch", "2", "--by-kernel"])
    out = capsys.readouterr().out
    modes = _table(out, "one call|op by op")
    assert set(modes) == {"one call", "op by op"}, out  # int8 linears run the one-call decode stack
    for step, tok_s, kernel, other, share in modes.values():  # ms to 2 decimals
        assert 0 < kernel <= step and other == pytest.approx(step - kernel, abs=0.02), out
        assert tok_s == pytest.approx(2e3 / step, rel=0.1), out
    by_kernel = dict(re.findall(r"^  (\w+)\s+([\d.]+)$", out, re.M))
    assert {"int8_linear", "decode_attention", "add_rms_norm", "silu_mul"} <= set(by_kernel)


def test_prefill_step_split_quick_accounts_for_each_step_by_kind(tiny, capsys):
    prefill_step_split.main(["--model", tiny, "--quick"])
    out = capsys.readouterr().out
    steps = re.split(r"^step ", out, flags=re.M)[1:]
    assert [s.split("\n")[0] for s in steps] == ["512 (512 rows)", "32x32 (1024 rows)"]
    for text in steps:
        table = _table(text, "|".join(("step", *prefill_step_split.KINDS)))
        assert set(table) == {"step", *prefill_step_split.KINDS}
        for mode, step in enumerate(table["step"]):
            assert step > 0 and table["else"][mode] >= 0  # the timed kinds never count a call twice
            assert sum(table[k][mode] for k in ("qkv", "o", "gate_up", "down", "attention")) > 0
        rates = [float(r) for r in re.findall(r"^  \w+: (\d+) prompt tok/s$", text, re.M)]
        assert len(rates) == 2 and all(r > 0 for r in rates)


@pytest.mark.slow
def test_build_ab_quick_times_the_flagged_build_against_the_default(tiny, kernels, capsys):
    build_ab.main(["--cflags=-DSL_SPIN_NS=0", "--model", tiny, "--quick"])
    out = capsys.readouterr().out
    rounds = {
        name: [float(x) for x in rest.split()]
        for name, rest in re.findall(r"^(default|flagged)\s+ms a step: median\s+[\d.]+\s+rounds ([\d. ]+)$", out, re.M)
    }
    assert set(rounds) == {"default", "flagged"} and all(len(r) == 2 and min(r) > 0 for r in rounds.values())
    ratio = float(re.search(r"median of rounds: ([\d.]+)x", out).group(1))
    assert 0.2 < ratio < 5  # the same code, one spin setting apart


def test_structured_outputs_quick_times_the_sampler_and_the_steps(tiny, capsys):
    structured_outputs.main(["--model", tiny, "--quick"])
    out = capsys.readouterr().out
    sampler = dict(re.findall(r"^  (no hook|hook, \d constrained|  of which the hook, \d rows)\s+([\d.]+)$", out, re.M))
    assert set(sampler) == {"no hook", "hook, 0 constrained", "hook, 2 constrained", "  of which the hook, 2 rows"}
    assert all(float(ms) > 0 for ms in sampler.values())
    steps = re.findall(r"^  (\d constrained)\s+([\d.]+)  \(([\d.]+)x\)", out, re.M)
    assert [name for name, _, _ in steps] == ["0 constrained", "2 constrained"]
    (_, base, one), (_, ms, ratio) = steps
    assert float(one) == 1.0 and float(ratio) == pytest.approx(float(ms) / float(base), rel=0.05)  # ms to 2 decimals
