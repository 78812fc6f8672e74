"""Tensor parallelism is `--tp` or `--tensor-parallel-size` on every command that takes it, both
spellings into one destination."""

from __future__ import annotations

import pytest

from servelab.cli import build_parser

# command -> (its other required flags, the destination both spellings set)
COMMANDS = {
    "serve": ([], "tensor_parallel_size"),
    "generate": (["--prompt", "x"], "tensor_parallel_size"),
    "chat": ([], "tensor_parallel_size"),
    "calibrate": (["--out", "p.json"], "tensor_parallel_size"),
    "sim": ([], "tp"),
    "plan": ([], "tp"),
    "roofline": (["--model", "llama-3.1-8b", "--hardware", "h100-sxm"], "tp"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("flag", ["--tp", "--tensor-parallel-size"])
def test_both_spellings_set_the_same_destination(command, flag):
    required, dest = COMMANDS[command]
    args = build_parser(command).parse_args([command, *required, flag, "2"])
    assert str(getattr(args, dest)) == "2"
    assert not hasattr(args, "tensor_parallel_size" if dest == "tp" else "tp")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_default_is_one_device(command):
    required, dest = COMMANDS[command]
    assert str(getattr(build_parser(command).parse_args([command, *required]), dest)) == "1"


def test_engine_args_take_tp_from_either_spelling():
    from servelab.commands._engine_cli import engine_args_from

    for flag in ("--tp", "--tensor-parallel-size"):
        args = build_parser("generate").parse_args(["generate", "--prompt", "x", flag, "3"])
        assert engine_args_from(args).tensor_parallel_size == 3
