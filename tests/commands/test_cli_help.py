"""Every flag of every subcommand says what it does, and `servelab --version` answers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from servelab import __version__
from servelab.cli import COMMANDS, build_parser


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield parser.prog, action


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_help(command):
    parser = build_parser(command)
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _actions(parser)
               if (a.help is None or not a.help.strip()) and a.help != argparse.SUPPRESS
               and (command in prog.split() or prog == "servelab")]  # fmt: skip
    assert not missing, f"flags without help text: {missing}"


def test_version():
    out = subprocess.run([sys.executable, "-m", "servelab", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"servelab {__version__}"


def test_generate_and_the_api_share_sampling_defaults():
    from servelab.commands._engine_cli import sampling_params_from
    from servelab.core.sequence import SamplingParams

    args = build_parser("generate").parse_args(["generate", "--prompt", "x"])
    assert sampling_params_from(args).temperature == SamplingParams().temperature == 1.0
    assert sampling_params_from(args, {"temperature": 0.6, "top_k": 20}).temperature == 0.6
    assert sampling_params_from(args, {"top_k": 20.0}).top_k == 20  # generation_config.json may write a float
    args = build_parser("generate").parse_args(["generate", "--prompt", "x", "--temperature", "0"])
    assert sampling_params_from(args, {"temperature": 0.6}).temperature == 0.0
