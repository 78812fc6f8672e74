"""`servelab lab`: serve the interactive lessons on inference economics in the browser."""

from __future__ import annotations

import argparse

from servelab.errors import InvalidArgument

HELP = "interactive lessons on inference economics in the browser"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise InvalidArgument(f"--port: must be between 1 and 65535, got {args.port}", param="port")
    import uvicorn

    from servelab.lab.app import create_lab_app

    app = create_lab_app()
    print(f"servelab lab: open http://{args.host}:{args.port}/ (works offline; Ctrl-C to stop)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except OSError as exc:  # port taken, address not available: a user error, not a traceback
        raise InvalidArgument(f"--port: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0
