"""`servelab lab`: serve the interactive lessons on inference economics in the browser."""

from __future__ import annotations

import argparse
import signal
import socket
from types import FrameType

from servelab.errors import InvalidArgument

HELP = "interactive lessons on inference economics in the browser"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="a `servelab calibrate` profile: the 'your machine' panel shows its fit",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise InvalidArgument(f"--port: must be between 1 and 65535, got {args.port}", param="port")
    import uvicorn

    from servelab.lab.app import create_lab_app

    from servelab.cost.profile import load_profile

    profile = None if args.profile is None else load_profile(args.profile)  # a bad file fails here, exit 2
    _check_can_listen(args.host, args.port)
    from servelab.server.connections import ConnectionLimits, http_protocol
    from servelab.server.guards import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS, is_loopback_address

    # On its own the lab is a web server too: the same guards and connection limits as `servelab serve`.
    allowed_hosts = LOOPBACK_HOSTS if is_loopback_address(args.host) else None
    app = create_lab_app(profile=profile, profile_path=args.profile, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES,
                         allowed_hosts=allowed_hosts)  # fmt: skip

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.state.stop()  # a running simulation's thread would keep the process alive
            super().handle_exit(sig, frame)

    limits = ConnectionLimits()
    # the protocol keeps connections alive for limits.keep_alive_timeout_s
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=http_protocol(limits),
                            ws="none")  # fmt: skip
    print(f"servelab lab: open http://{args.host}:{args.port}/ (works offline; Ctrl-C to stop)", flush=True)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler then lets a
    # graceful SIGTERM exit 0, as a supervisor expects.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _Server(config).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _check_can_listen(host: str, port: int) -> None:
    """uvicorn logs a bind failure and exits 3; say it in one line, naming the address, instead."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidArgument(f"--host: cannot resolve {host!r}: {exc.strerror}", param="host") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise InvalidArgument(
                f"--port: cannot listen on {host}:{port}: {exc.strerror or exc}", param="port"
            ) from None
