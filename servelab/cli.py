"""`servelab` command line. Each subcommand lives in `servelab/commands/<name>.py` and exposes
`HELP`, `add_arguments(parser)` and `run(args) -> int`. Only the chosen subcommand's module is
imported, so `servelab roofline` or `servelab sim` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from servelab import __version__
from servelab.errors import ServelabError

# name -> one-line help; the module is servelab.commands.<name>
COMMANDS: dict[str, str] = {
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "generate": "generate text for one prompt and print timings",
    "chat": "interactive chat in the terminal, streaming tokens",
    "bench": "load-test any OpenAI-compatible server (TTFT, TPOT, goodput, capacity)",
    "sim": "simulate serving a model on an accelerator (same scheduler, cost-model executor)",
    "plan": "capacity plan: tokens/s per device at an SLO across hardware and TP",
    "calibrate": "time the engine on a grid of step shapes and write a step-cost profile for sim/plan/roofline",
    "validate": "bench a live server, replay the run in the simulator with a profile, and print the errors",
    "roofline": "roofline cost of decode/prefill steps for a model on an accelerator",
    "models": "list the model catalog",
    "hardware": "list the accelerator catalog",
    "lab": "interactive lessons on inference economics in the browser",
    "worker": "an engine worker that joins a `serve --external-workers` front end (another host)",
}


def _module_name(command: str) -> str:
    return "servelab.commands." + command.replace("-", "_")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servelab",
        description="An LLM serving engine that knows its own economics.",
    )
    parser.add_argument("--version", action="version", version=f"servelab {__version__}",
                        help="print servelab's version and exit")  # fmt: skip
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(_module_name(name)).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(_module_name(args.command))
    try:
        return int(module.run(args) or 0)
    except ServelabError as exc:
        print(f"servelab {args.command}: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `servelab models | head`: the reader left; silence the flush at exit too.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
