"""One dtype vocabulary (spec/dtypes.py, vLLM's spelling) for every command: --dtype and
--kv-cache-dtype take bfloat16, float16, float32, fp8, ...; the old spellings (bf16, fp16, fp32,
--kv-dtype) still work with a one-line note naming the new one."""

from __future__ import annotations

import json

import pytest

from servelab.cli import build_parser, main
from servelab.commands._dtype_cli import cost_dtypes
from servelab.engine.llm_engine import EngineArgs
from servelab.errors import InvalidArgument
from servelab.spec.dtypes import DEPRECATED_ALIASES, kv_dtype, weight_dtype

ENGINE_COMMANDS = ("serve", "generate", "chat", "calibrate")
COST_COMMANDS = ("sim", "plan", "roofline")
REQUIRED = {"generate": ["--prompt", "x"], "calibrate": ["--out", "p.json"],
            "roofline": ["--model", "llama-3.1-8b", "--hardware", "h100-sxm"]}  # fmt: skip


def _parse(command: str, *argv: str):
    return build_parser(command).parse_args([command, *REQUIRED.get(command, []), *argv])


@pytest.mark.parametrize("command", ENGINE_COMMANDS + COST_COMMANDS)
def test_every_command_takes_the_canonical_spelling_silently(capsys, command):
    args = _parse(command, "--dtype", "float16", "--kv-cache-dtype", "bfloat16")
    assert (args.dtype, args.kv_cache_dtype) == ("float16", "bfloat16")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ENGINE_COMMANDS + COST_COMMANDS)
@pytest.mark.parametrize("old, new", list(DEPRECATED_ALIASES.items()))
def test_every_command_takes_the_old_spellings_with_a_note(capsys, command, old, new):
    args = _parse(command, "--dtype", old.upper() if old == "fp32" else old, "--kv-dtype", old)
    assert (args.dtype, args.kv_cache_dtype) == (new, new)
    notes = capsys.readouterr().err.splitlines()
    assert "servelab: note: --kv-dtype is deprecated; use --kv-cache-dtype" in notes
    assert f"servelab: note: --kv-cache-dtype {old} is deprecated; use --kv-cache-dtype {new}" in notes
    assert any(n.startswith("servelab: note: --dtype ") and n.endswith(f"use --dtype {new}") for n in notes)
    assert len(notes) == 3


def test_the_cost_model_and_the_python_api_read_old_names_as_the_new_ones():
    for old, new in DEPRECATED_ALIASES.items():
        assert weight_dtype(old) == weight_dtype(new) and weight_dtype(old).name == new
        assert kv_dtype(old) == kv_dtype(new)
    assert EngineArgs(dtype="bf16", kv_cache_dtype="FP16").dtype == "bfloat16"
    assert EngineArgs(dtype="auto").dtype is None


def test_an_old_spelling_gives_the_same_result_as_the_new_one(capsys):
    base = ["roofline", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--json", "--batch", "1,8"]
    assert main([*base, "--dtype", "fp16", "--kv-dtype", "fp32"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main([*base, "--dtype", "float16", "--kv-cache-dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out) == old


@pytest.mark.parametrize("kv, weight, expected", [
    ("auto", "float32", "float32"), ("auto", "bf16", "bfloat16"), ("auto", "fp8", "bfloat16"),
    ("auto", "q4_0", "bfloat16"), ("fp8", "bfloat16", "fp8"),
])  # fmt: skip
def test_a_cost_commands_auto_kv_cache_is_the_compute_dtype(kv, weight, expected):
    args = _parse("sim", "--dtype", weight, "--kv-cache-dtype", kv)
    assert cost_dtypes(args)[1] == expected


@pytest.mark.parametrize("command, argv, message", [
    ("serve", ["--kv-cache-dtype", "fp8"],
     "the engine cannot use KV-cache dtype 'fp8': it supports auto, bfloat16, float16, float32; the cost model"),
    ("generate", ["--dtype", "q4_0"], "the engine cannot use weight dtype 'q4_0': it supports bfloat16, float16"),
    ("calibrate", ["--dtype", "int4"], "the engine cannot use weight dtype 'int4'"),
    ("chat", ["--kv-cache-dtype", "int3"], "unknown KV-cache dtype 'int3'; the engine supports auto, bfloat16"),
    ("sim", ["--dtype", "fp4", "--rate", "1"], "unknown weight dtype 'fp4'; choose one of: bfloat16"),
    ("plan", ["--kv-cache-dtype", "int4", "--slo-tpot", "50ms"], "unknown KV-cache dtype 'int4'"),
    ("roofline", ["--kv-cache-dtype", "q4_0"], "unknown KV-cache dtype 'q4_0'; choose one of: bfloat16"),
])  # fmt: skip
def test_a_dtype_a_command_cannot_act_on_exits_2_saying_so(capsys, tmp_path, command, argv, message):
    argv = [a.replace("p.json", str(tmp_path / "p.json")) for a in [*REQUIRED.get(command, []), *argv]]
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()]


def test_the_engine_refuses_a_cost_model_dtype_from_the_python_api_too():
    with pytest.raises(InvalidArgument, match="the engine cannot use KV-cache dtype 'fp8'") as err:
        EngineArgs(kv_cache_dtype="fp8").validate()
    assert err.value.param == "kv_cache_dtype"
