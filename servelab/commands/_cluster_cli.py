"""`serve`'s data-parallel flags and `worker`'s rendezvous flags (no torch at import)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from servelab.cluster.channel import HANG_TIMEOUT_S
from servelab.cluster.disagg_config import DEFAULT_KV_TRANSFER_TIMEOUT_S, GRANULARITIES, DisaggConfig, parse_disagg
from servelab.errors import InvalidArgument
from servelab.core.router import ROUTERS
from servelab.units import parse_duration_s

if TYPE_CHECKING:
    from servelab.cluster.front_end import ClusterEngine
    from servelab.engine.grammar_workers import GrammarConfig
    from servelab.engine.llm_engine import EngineArgs

DEFAULT_ROUTER = "least-outstanding"
DEFAULT_JOIN_TIMEOUT = "5m"
DEFAULT_KV_TRANSFER_TIMEOUT = f"{DEFAULT_KV_TRANSFER_TIMEOUT_S:g}s"
DEFAULT_HANG_TIMEOUT = f"{HANG_TIMEOUT_S:g}s"
DEFAULT_RESTART_LIMIT = 3  # cluster/front_end.py's, without importing torch here


def add_rendezvous_arguments(group: argparse._ArgumentGroup, *, role: str) -> None:
    group.add_argument("--master-addr", default=None,
                       help=f"address of the front end's rendezvous (rank 0); {role}")  # fmt: skip
    group.add_argument("--master-port", type=int, default=None, help=f"port of the rendezvous; {role}")
    group.add_argument("--join-timeout", default=DEFAULT_JOIN_TIMEOUT,
                       help=f"how long to wait for every rank to join and build its engine (default {DEFAULT_JOIN_TIMEOUT})")  # fmt: skip


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallelism (docs/multi-worker.md)")
    g.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engine worker processes behind this front end, each with the whole model and its own "
                        "KV cache (default 1: the engine runs in the server's process)")  # fmt: skip
    g.add_argument(
        "--router",
        choices=ROUTERS,
        default=DEFAULT_ROUTER,
        help=f"which worker gets a request (default {DEFAULT_ROUTER})",
    )
    g.add_argument("--external-workers", action="store_true",
                   help="start no worker here: wait for N `servelab worker` processes (other hosts) to join at "
                        "--master-addr:--master-port")  # fmt: skip
    add_rendezvous_arguments(g, role="default 127.0.0.1 and a free port (local workers only)")
    g.add_argument("--worker-hang-timeout", default=DEFAULT_HANG_TIMEOUT,
                   help="a worker whose step loop finishes no step for this long while it has work is hung: its "
                        "requests fail, /health says degraded, the router skips it (a local one is killed); "
                        f"keep it well above the slowest prefill chunk (0: never) (default {DEFAULT_HANG_TIMEOUT})")  # fmt: skip
    g.add_argument("--worker-restart-limit", type=int, default=DEFAULT_RESTART_LIMIT, metavar="N",
                   help="a failed or hung local worker (data-parallel, prefill or decode) is restarted, after 1 s, "
                        "then 2 s, 4 s ... up "
                        f"to 60 s, at most N times per rank (0: never) (default {DEFAULT_RESTART_LIMIT}); its "
                        "requests fail either way")  # fmt: skip

    d = parser.add_argument_group("disaggregated prefill/decode (docs/disaggregation.md)")
    d.add_argument("--disagg", default=None, metavar="P:D",
                   help="P prefill and D decode worker processes: a prompt runs on a prefill worker, its KV blocks "
                        "go point-to-point to a decode worker (chosen by --router), which generates the rest")  # fmt: skip
    d.add_argument("--kv-transfer-timeout", default=DEFAULT_KV_TRANSFER_TIMEOUT,
                   help="a request's KV transfer fails (and the request with it) past this; a busy peer answers "
                        f"between its steps, so leave room for one (default {DEFAULT_KV_TRANSFER_TIMEOUT})")  # fmt: skip
    d.add_argument(
        "--kv-transfer-granularity",
        choices=GRANULARITIES,
        default=GRANULARITIES[0],
        help=f"one message per KV block (all layers) or per layer (all blocks) (default {GRANULARITIES[0]})",
    )


def uses_cluster(args: argparse.Namespace) -> bool:
    return args.data_parallel > 1 or args.external_workers or args.disagg is not None


def disagg_config(args: argparse.Namespace) -> DisaggConfig | None:

    if args.disagg is None:
        return None
    timeout_s = parse_duration_s(args.kv_transfer_timeout, name="--kv-transfer-timeout", positive=True)
    return DisaggConfig(*parse_disagg(args.disagg), kv_timeout_s=timeout_s, granularity=args.kv_transfer_granularity)


def check_cluster_flags(args: argparse.Namespace) -> None:
    from servelab.cluster.launch import check_cluster_args

    check_cluster_args(args.data_parallel)
    if args.disagg is not None and args.data_parallel > 1:
        raise InvalidArgument("--disagg P:D and --data-parallel N: give one (P:D starts P + D workers)")
    if args.disagg is None and (args.kv_transfer_timeout != DEFAULT_KV_TRANSFER_TIMEOUT
                                or args.kv_transfer_granularity != GRANULARITIES[0]):  # fmt: skip
        raise InvalidArgument("--kv-transfer-timeout, --kv-transfer-granularity: only with --disagg P:D")
    disagg_config(args)  # the checks
    if not uses_cluster(args) and (args.master_addr or args.master_port):
        raise InvalidArgument("--master-addr/--master-port: only with --data-parallel N > 1 or --external-workers")
    if args.router != DEFAULT_ROUTER and not uses_cluster(args):
        raise InvalidArgument("--router: only with --data-parallel N > 1 or --disagg P:D (one engine needs no router)")
    if args.external_workers and args.master_port is None:
        raise InvalidArgument("--external-workers: needs --master-port (and --master-addr, the address the workers "
                              "reach this host at), so the workers know where to join")  # fmt: skip
    parse_duration_s(args.join_timeout, name="--join-timeout")
    hang_timeout_s(args)
    if args.worker_restart_limit < 0:
        raise InvalidArgument(
            f"--worker-restart-limit: must be >= 0 (0: never restart), got {args.worker_restart_limit}"
        )
    restarts_local_workers = (args.data_parallel > 1 or args.disagg is not None) and not args.external_workers
    if args.worker_restart_limit != DEFAULT_RESTART_LIMIT and not restarts_local_workers:
        raise InvalidArgument("--worker-restart-limit: only with local workers, --data-parallel N > 1 or --disagg "
                              "P:D (external workers belong to their host's supervisor)")  # fmt: skip
    if args.worker_hang_timeout != DEFAULT_HANG_TIMEOUT and not uses_cluster(args):
        raise InvalidArgument("--worker-hang-timeout: only with --data-parallel N > 1, --external-workers or --disagg "
                              "P:D (one engine has no worker to watch)")  # fmt: skip


def hang_timeout_s(args: argparse.Namespace) -> float | None:
    timeout_s = parse_duration_s(args.worker_hang_timeout, name="--worker-hang-timeout")
    return timeout_s or None


def start_cluster_from_args(args: argparse.Namespace, engine_args: EngineArgs,
                            grammar_config: GrammarConfig | None = None) -> ClusterEngine:  # fmt: skip
    from servelab.cluster.launch import start_cluster

    log = logging.getLogger("servelab")
    addr = args.master_addr or "127.0.0.1"
    disagg = disagg_config(args)
    num_workers = args.data_parallel if disagg is None else disagg.num_prefill + disagg.num_decode
    driver = start_cluster(
        engine_args, num_workers, router=args.router, master_addr=addr, master_port=args.master_port,
        external=args.external_workers, join_timeout_s=parse_duration_s(args.join_timeout, name="--join-timeout"),
        disagg=disagg, hang_timeout_s=hang_timeout_s(args), restart_limit=args.worker_restart_limit,
        grammar_config=grammar_config,
    )  # fmt: skip
    log.info("servelab: %d %s worker(s) (%s), router %s", len(driver.workers),
             "data-parallel" if disagg is None else f"prefill/decode {args.disagg}",
             ", ".join(f"rank {w.index}{'' if disagg is None else ' ' + w.role} on {w.ready.host} pid {w.ready.pid}"
                       for w in driver.workers),
             args.router)  # fmt: skip
    return driver
