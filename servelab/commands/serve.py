"""`servelab serve`: the OpenAI-compatible server (FastAPI + uvicorn) over the real engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import socket
import time
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from servelab.commands._cluster_cli import add_cluster_arguments, check_cluster_flags, uses_cluster
from servelab.commands._engine_cli import add_engine_args_flags, engine_args_from
from servelab.commands._scheduler_cli import add_scheduler_arguments
from servelab.engine.args import DEFAULT_MAX_MODEL_LEN
from servelab.errors import InvalidArgument
from servelab.logs import log_to_stderr
from servelab.server.embeddings import parse_pooler_config
from servelab.server.guards import DEFAULT_MAX_REQUEST_BYTES, OPEN_PATHS
from servelab.server.metrics import NAMESPACES
from servelab.server.tool_parsers import TOOL_CALL_PARSERS
from servelab.units import parse_bytes, parse_duration_s, parse_str_list

if TYPE_CHECKING:
    from fastapi import FastAPI

    from servelab.server.connections import ConnectionLimits

HELP = "serve a model over an OpenAI-compatible HTTP API"
# serve's EngineArgs flags (servelab/engine/args.py), in the "model" and "engine and limits" groups
_MODEL_FLAGS = ("model", "served_model_name", "dtype", "kv_cache_dtype", "quantization", "device", "deterministic",
                "exact", "tensor_parallel_size", "seed", "speculative_config")  # fmt: skip
_LIMIT_FLAGS = ("kv_cache_memory_bytes",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Sampling defaults: a request that leaves temperature, top_p, top_k or min_p out gets the value "
        "the model's generation_config.json sets, else temperature 1.0, top_p 1.0, top_k and min_p off "
        "(as OpenAI and vLLM; `generate` and `chat` use the same)."
    )
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every route but {' and '.join(sorted(OPEN_PATHS))} "
                          "(the lab at /lab included)")  # fmt: skip
    net.add_argument("--allowed-origins", default=None,
                     help="comma-separated origins whose web pages may call the API (CORS), e.g. "
                          "https://app.example.com; default: none, no CORS headers are sent")  # fmt: skip
    net.add_argument("--max-request-bytes", default=None,
                     help=f"largest request body; larger ones get 413 before they are read "
                          f"(default {DEFAULT_MAX_REQUEST_BYTES // 2**20}MiB)")  # fmt: skip
    net.add_argument("--shutdown-timeout", default="30s",
                     help="on SIGTERM, how long running requests may take to finish before they are aborted "
                          "(default 30s)")  # fmt: skip
    add_connection_arguments(parser)
    net.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    net.add_argument("--no-lab", action="store_true", help="do not mount the lessons at /lab")
    net.add_argument("--metrics-namespace", choices=list(NAMESPACES), default="servelab",
                     help="/metrics names: servelab (default: servelab:<name>) or vllm (vLLM's names and labels, "
                          "for vLLM's dashboards and alerts; docs/metrics.md)")  # fmt: skip
    net.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="a `servelab calibrate` profile: the lab's 'your machine' panel overlays its prediction",
    )
    net.add_argument(
        "--step-log",
        default=None,
        metavar="FILE.jsonl",
        help="write one JSON line per engine step: its shape (query tokens, sequences, context, "
        "attended pairs) and times (the executor's, the step's, until its outputs were posted, "
        "the idle wait before it); `calibrate --server-term` fits the serving term from it",
    )

    model = parser.add_argument_group("model")
    add_engine_args_flags(model, _MODEL_FLAGS)
    model.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                       help="read tool calls out of the model's text for tool_choice 'auto', in the model "
                            "family's format (vLLM's names): hermes (Qwen2.5, Hermes: <tool_call>{json}</tool_call>), "
                            "llama3_json (Llama 3.x: <|python_tag|>{json}; {json}), mistral ([TOOL_CALLS][{json}, ...]), "
                            "pythonic (Llama 3.2/4: [f(x=1), g()]), qwen3_xml (Qwen3-Coder: <tool_call><function=f>"
                            "<parameter=x>1</parameter>...); without it, 'auto' is refused and 'required' or a named "
                            "function still work")  # fmt: skip
    model.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests send their own chat_template (vLLM's flag); without it such a request is "
                            "a 400: the sandbox bounds what a template reaches, not how long it runs")  # fmt: skip
    model.add_argument("--pooler-config", default=None, metavar="JSON",
                       help='how /v1/embeddings pools the final hidden states, as vLLM\'s flag: '
                            '\'{"pooling_type": "LAST"|"MEAN", "normalize": true|false}\' (default LAST, normalized: '
                            'the last token\'s state, as vLLM does for a decoder model)')  # fmt: skip

    limits = parser.add_argument_group("engine and limits")
    add_scheduler_arguments(
        limits,
        ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "policy", "admission", "order",
         "enable_prefix_caching", "block_size", "num_blocks"),
        # Bounded by default: an overloaded server should shed load with 503s that clients retry,
        # not queue without limit while every TTFT grows; 0 lifts the bound.
        defaults={"max_waiting": 4096},
        unset={"max_model_len": f"the model's, at most {DEFAULT_MAX_MODEL_LEN}", "num_blocks": "from --kv-cache-memory"},
    )  # fmt: skip
    add_engine_args_flags(limits, _LIMIT_FLAGS)
    grammars = parser.add_argument_group("structured outputs")
    grammars.add_argument("--structured-output-compile-timeout", default="10s",
                          help="longest a request's grammar (response_format, tools, structured_outputs, guided_*) "
                               "may take to compile, its wait behind other compiles included; past it the request "
                               "gets a 400 and the compile is killed; cluster workers compile under it too (default "
                               "10s)")  # fmt: skip
    grammars.add_argument("--structured-output-compile-workers", type=int, default=2, metavar="N",
                          help="grammar compiler processes (~270 MB each, started with the server and with each "
                               "cluster worker; default 2)")  # fmt: skip
    grammars.add_argument("--structured-output-cache-mb", type=int, default=256, metavar="MiB",
                          help="memory for compiled grammars kept for reuse, least recently used dropped first, in "
                               "the server and in each cluster worker (default 256)")  # fmt: skip
    add_cluster_arguments(parser)
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="server log verbosity (default: info)",
    )


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    from servelab.server import connections as c

    conn = parser.add_argument_group("connections")
    conn.add_argument("--allowed-hosts", default=None,
                      help="comma-separated Host header names the server answers (a port is ignored; "
                           "'*.example.com' matches its subdomains; '*' any); others get 421. Default: bound to a "
                           "loopback address, only localhost, 127.0.0.1 and [::1] (a web page that rebinds its "
                           "DNS name to 127.0.0.1 cannot reach the API); bound elsewhere, any")  # fmt: skip
    conn.add_argument("--header-timeout", default=f"{c.DEFAULT_HEADER_TIMEOUT_S:g}s",
                      help="a connection must send a request's whole headers within this (default %(default)s); "
                           "slower ones get 408 and are closed")  # fmt: skip
    conn.add_argument(
        "--body-timeout",
        default=f"{c.DEFAULT_BODY_TIMEOUT_S:g}s",
        help="and its whole body within this after them (default %(default)s)",
    )
    conn.add_argument(
        "--keep-alive-timeout",
        default=f"{c.DEFAULT_KEEP_ALIVE_TIMEOUT_S:g}s",
        help="an idle keep-alive connection is closed after this (default %(default)s)",
    )
    conn.add_argument("--max-connections", type=int, default=c.DEFAULT_MAX_CONNECTIONS, metavar="N",
                      help="open connections in all; past it a new one gets 503 with Retry-After "
                           "(default %(default)s; 0: no cap)")  # fmt: skip
    conn.add_argument("--max-connections-per-client", type=int, default=c.DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                      metavar="N", help="open connections from one client address (default %(default)s; 0: no cap; "
                                        "raise it behind a proxy, which is one address)")  # fmt: skip
    conn.add_argument("--max-requests-per-connection", type=int, default=c.DEFAULT_MAX_REQUESTS_PER_CONNECTION,
                      metavar="N", help="a keep-alive connection is closed after this many requests "
                                        "(default %(default)s; 0: no cap)")  # fmt: skip


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    from servelab.server.connections import ConnectionLimits

    counts = {}
    for flag in ("max_connections", "max_connections_per_client", "max_requests_per_connection"):
        value = getattr(args, flag)
        if value < 0:
            raise InvalidArgument(f"--{flag.replace('_', '-')}: must be >= 0 (0: no cap), got {value}")
        counts[flag] = value or None
    return ConnectionLimits(
        header_timeout_s=parse_duration_s(args.header_timeout, name="--header-timeout", positive=True),
        body_timeout_s=parse_duration_s(args.body_timeout, name="--body-timeout", positive=True),
        keep_alive_timeout_s=parse_duration_s(args.keep_alive_timeout, name="--keep-alive-timeout", positive=True),
        **counts,
    )


def allowed_hosts_from_args(args: argparse.Namespace) -> frozenset[str] | None:
    """The Host names the server answers; None: any."""
    from servelab.server.guards import LOOPBACK_HOSTS, is_loopback_address

    if args.allowed_hosts is None:
        return LOOPBACK_HOSTS if is_loopback_address(args.host) else None
    hosts = parse_str_list(args.allowed_hosts, name="--allowed-hosts")
    if not hosts:
        raise InvalidArgument("--allowed-hosts: give at least one name, or '*' for any")
    return None if "*" in hosts else frozenset(h.lower() for h in hosts)


def _raise_open_file_limit(need: int) -> None:
    """Each connection is a file descriptor: a connection cap above the soft limit would fail in
    accept() instead of answering 503, so the soft limit is raised towards the hard one (as vLLM does)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
        if target < need:
            logging.getLogger("servelab.server").warning(
                "servelab: the open-file limit is %d, below --max-connections plus room for the server's own files "
                "(%d): past it new connections fail instead of getting 503",
                target,
                need,
            )


def _check_args(args: argparse.Namespace) -> None:
    check_cluster_flags(args)
    if not 0 <= args.port < 65536:
        raise InvalidArgument(f"--port: must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise InvalidArgument("--api-key: must not be empty")
    if args.structured_output_compile_workers < 1:
        raise InvalidArgument(f"--structured-output-compile-workers: must be >= 1, got "
                              f"{args.structured_output_compile_workers}")  # fmt: skip
    if args.structured_output_cache_mb < 0:
        raise InvalidArgument(f"--structured-output-cache-mb: must be >= 0, got {args.structured_output_cache_mb}")
    if args.step_log is not None and uses_cluster(args):
        raise InvalidArgument(
            "--step-log: logs one engine's steps; not with --data-parallel, --external-workers or --disagg"
        )


def _open_step_log(path: str | None) -> TextIO | None:
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8", buffering=1)  # a line a step, readable while serving
    except OSError as exc:
        raise InvalidArgument(f"--step-log: cannot write {path}: {exc.strerror or exc}") from None


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a taken port should fail in a second, not after a load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it Nagle holds each response's second write for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidArgument(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def mount_lab(
    app: FastAPI, profile: dict | None = None, profile_path: str | None = None, served_model: str | None = None
) -> bool:
    """Mount the lessons at /lab on the server's app when `servelab.lab` is installed; its live
    panel reads this server's own /metrics text and, with a profile, predicts what the page
    measures. A broken lab never stops the API from serving."""
    import importlib.util

    if importlib.util.find_spec("servelab.lab") is None:
        return False
    state = app.state.servelab
    try:
        from servelab.lab.app import create_lab_app

        lab = create_lab_app(
            engine_metrics_source=lambda: state.metrics.render().decode(),
            profile=profile,
            profile_path=profile_path,
            served_model=lambda: served_model,
        )
    except Exception as exc:
        logging.getLogger("servelab.server").warning(
            "the lab could not be mounted at /lab (%s: %s); serving the API without it", type(exc).__name__, exc
        )
        return False
    app.mount("/lab", lab)
    app.state.stop_lab = lab.state.stop
    return True


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    pooler = None if args.pooler_config is None else parse_pooler_config(args.pooler_config)
    # a long-lived process: its KV memory is claimed at start, RSS stays flat; bad flags fail here,
    # before the port and the model
    engine_args = engine_args_from(args, _MODEL_FLAGS + _LIMIT_FLAGS, kv_cache_prefault=True)
    shutdown_timeout_s = parse_duration_s(args.shutdown_timeout, name="--shutdown-timeout")
    compile_timeout_s = parse_duration_s(args.structured_output_compile_timeout,
                                         name="--structured-output-compile-timeout", positive=True)  # fmt: skip
    max_request_bytes = (
        parse_bytes(args.max_request_bytes, name="--max-request-bytes") if args.max_request_bytes
        else DEFAULT_MAX_REQUEST_BYTES
    )  # fmt: skip
    allowed_origins = parse_str_list(args.allowed_origins, name="--allowed-origins") if args.allowed_origins else None
    limits = connection_limits_from_args(args)
    allowed_hosts = allowed_hosts_from_args(args)
    from servelab.cost.profile import load_profile

    profile = None if args.profile is None else load_profile(args.profile)  # a bad file fails before the model loads
    step_log = _open_step_log(args.step_log)
    log = log_to_stderr("%(levelname)-9s %(message)s", args.log_level)  # uvicorn's shape: the log reads as one

    import prometheus_client
    import uvicorn

    from servelab.engine.grammar_workers import GrammarConfig
    from servelab.engine.client import EngineClient
    from servelab.engine.llm_engine import LLMEngine
    from servelab.server.app import create_app
    from servelab.server.async_engine import AsyncEngine

    grammar_config = GrammarConfig(compile_timeout_s=compile_timeout_s, num_workers=args.structured_output_compile_workers,
                                   cache_bytes=args.structured_output_cache_mb * 2**20)  # fmt: skip
    sock = _bind(args.host, args.port)
    port = sock.getsockname()[1]

    t0 = time.perf_counter()
    cluster = uses_cluster(args)
    client: EngineClient
    if cluster:
        from servelab.commands._cluster_cli import start_cluster_from_args

        client = start_cluster_from_args(args, engine_args, grammar_config)
    else:
        client = AsyncEngine(LLMEngine.from_args(engine_args))
        client.step_log = step_log
    front = client.front
    cfg = front.scheduler_config
    max_waiting = "unbounded" if cfg.max_waiting is None else str(cfg.max_waiting)
    if cluster and cfg.max_waiting is not None:
        max_waiting += " (the cluster's)"  # it bounds all the workers together
    log.info(
        "servelab: loaded %s (%s) in %.1f s", front.model_name, args.model or "bundled model", time.perf_counter() - t0
    )
    log.info(
        "servelab: %smax_model_len=%d, KV cache %d blocks x %d tokens = %d tokens (%s), max_num_seqs=%d, "
        "max_num_batched_tokens=%d, policy=%s, order=%s, prefix caching %s, max waiting %s",
        "per worker: " if cluster else "", front.max_model_len, cfg.num_blocks, cfg.block_size, cfg.num_blocks * cfg.block_size,
        front.kv_cache_dtype, cfg.max_num_seqs,
        cfg.max_num_batched_tokens, cfg.policy, cfg.order, "on" if cfg.enable_prefix_caching else "off",
        max_waiting,
    )  # fmt: skip

    # The *_created series double /metrics and no dashboard reads them (vLLM drops them too).
    prometheus_client.disable_created_metrics()
    app = create_app(
        client,
        api_key=args.api_key,
        max_request_bytes=max_request_bytes,
        allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts,
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        metrics_namespace=args.metrics_namespace,
        grammar_config=grammar_config,
        pooler=pooler,
    )
    state = app.state.servelab
    lab = not args.no_lab and mount_lab(app, profile, args.profile, front.model_name)

    class _Server(uvicorn.Server):
        """Drains before uvicorn shuts down: uvicorn closes the listening socket as soon as it
        is told to exit, so the first signal only starts the drain (new requests get 503 +
        Retry-After, not connection refused) and uvicorn is told once nothing runs or the grace
        period is over. A second signal stops at once."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            stop_lab = getattr(app.state, "stop_lab", None)
            if stop_lab is not None:  # its simulations run in threads the exit would wait for
                stop_lab()
            if state.loop is None:
                super().handle_exit(sig, frame)
                return
            if state.draining:  # the second signal: end the running requests, wait for nothing
                log.info("servelab: signal %d again: stopping now", sig)
                self.should_exit = True
                state.loop.call_soon_threadsafe(self._stop_now)
                return
            log.info("servelab: signal %d: draining (new requests get 503; %.0f s for running ones)", sig,
                     shutdown_timeout_s)  # fmt: skip
            state.begin_drain(grace_s=shutdown_timeout_s)
            state.loop.call_soon_threadsafe(self._watch_drain)

        def _stop_now(self) -> None:
            state.abort_now()
            # a moment for their error events and [DONE] to reach the clients, then uvicorn stops
            # waiting for connections (force_exit; should_exit alone waits out the grace period)
            state.loop.call_later(0.5, setattr, self, "force_exit", True)

        def _watch_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._exit_when_drained())  # held: the loop keeps weak refs

        async def _exit_when_drained(self) -> None:
            # The grace-period abort ends what is left at shutdown_timeout_s; the extra second
            # lets those error events reach their clients.
            await state.wait_drained(shutdown_timeout_s + 1.0)
            self.should_exit = True

    from servelab.server.connections import http_protocol

    _raise_open_file_limit((limits.max_connections or 0) + 256)
    config = uvicorn.Config(
        app,
        http=http_protocol(limits),  # it keeps connections alive for limits.keep_alive_timeout_s
        ws="none",
        log_level=args.log_level,
        access_log=not args.no_access_log,
        # The app itself aborts what is left when the grace period ends (its clients get an error
        # event and [DONE]); uvicorn's own cancellation is only the backstop.
        timeout_graceful_shutdown=math.ceil(shutdown_timeout_s) + 5,
        lifespan="on",
    )
    server = _Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info(
        "servelab: serving %r on http://%s:%d (OpenAI API at /v1, metrics at /metrics%s; Ctrl-C or SIGTERM to stop)",
        front.model_name, host, port, ", lessons at /lab/" if lab else "",
    )  # fmt: skip
    # uvicorn re-raises the signal it caught once it has shut down cleanly; with these handlers
    # in place that re-raise is a no-op, so a graceful SIGTERM exits 0 as a supervisor expects.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
        if step_log is not None:
            step_log.close()
    log.info("servelab: stopped")
    return 0
