"""`roofline`, `sim` and `plan` say in their first line, and in --json, when a prediction rests on
no kernel measured for the deployment (an unmeasured GPU, format or shape), and say nothing of the
kind for a measured one."""

from __future__ import annotations

import json

import pytest

from servelab.cli import main

LOAD = ["--num-requests", "6", "--input-len", "64", "--output-len", "4"]


def _out(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("hardware", "dtype", "needle"),
    [
        ("l40s", "bfloat16", "l40s has no measured kernels"),
        ("h200", "int4", "no measured int4 kernels on h200"),
    ],
)
def test_roofline_first_line_and_json_say_it_extrapolates(capsys, hardware, dtype, needle):
    argv = ["roofline", "--model", "llama-3.1-8b", "--hardware", hardware, "--dtype", dtype, "--batch", "1,8"]
    assert main(argv) == 0
    first = _out(capsys).splitlines()[0]
    assert first.startswith("extrapolated: ") and needle in first
    assert main([*argv, "--json"]) == 0
    rows = json.loads(_out(capsys))
    assert all(any(needle in r for r in row["extrapolation"]) for row in rows)


def test_roofline_on_measured_kernels_says_nothing_of_the_kind(capsys):
    argv = ["roofline", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch", "1"]
    assert main(argv) == 0
    assert _out(capsys).splitlines()[0].startswith("llama-3.1-8b on h100-sxm")
    assert main([*argv, "--json"]) == 0
    assert json.loads(_out(capsys))[0]["extrapolation"] == []


def test_sim_first_line_and_json(capsys):
    argv = ["sim", "--model", "llama-3.1-8b", *LOAD, "--rate", "4", "--no-progress"]
    assert main([*argv, "--hardware", "l4"]) == 0
    first = _out(capsys).splitlines()[0]
    assert first.startswith("extrapolated: ") and "l4 has no measured kernels" in first
    assert main([*argv, "--hardware", "l4", "--json"]) == 0
    assert "l4 has no measured kernels" in json.loads(_out(capsys))["config"]["extrapolation"][0]
    assert main([*argv, "--hardware", "h200", "--json"]) == 0
    assert json.loads(_out(capsys))["config"]["extrapolation"] == []
    assert main([*argv, "--hardware", "h200"]) == 0
    assert not _out(capsys).startswith("extrapolated")


def test_plan_first_line_names_the_rows_that_extrapolate(capsys):
    argv = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--hardware",
        "h200,l40s",
        *LOAD,
        "--slo-tpot",
        "200ms",
        "--max-concurrency",
        "2",
        "--workers",
        "1",
    ]
    assert main(argv) == 0
    first = _out(capsys).splitlines()[0]
    assert first.startswith("extrapolated: l40s tp=1: l40s has no measured kernels")
    assert "h200" not in first
    assert main([*argv, "--json"]) == 0
    rows = {c["hardware"]: c for c in json.loads(_out(capsys))["configs"]}
    assert rows["h200"]["extrapolation"] == []
    assert "l40s has no measured kernels" in rows["l40s"]["extrapolation"][0]
