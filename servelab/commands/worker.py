"""`servelab worker`: an engine worker that joins a front end (`servelab serve --external-workers`)
on another host, through torch.distributed's env:// rendezvous. The engine's configuration
(model, dtype, KV cache, scheduler) comes from the front end; the model path must exist here."""

from __future__ import annotations

import argparse

from servelab.commands._cluster_cli import add_rendezvous_arguments
from servelab.logs import log_to_stderr
from servelab.units import parse_duration_s

HELP = "an engine worker that joins a `serve --external-workers` front end (another host)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Each flag not given is read from torch's standard variable (MASTER_ADDR, MASTER_PORT, RANK, "
                     "WORLD_SIZE), so torchrun and cluster launchers work. Ranks are 1..N: rank 0 is the front end; "
                     "the world size is N + 1.")  # fmt: skip
    g = parser.add_argument_group("rendezvous")
    add_rendezvous_arguments(g, role="default $MASTER_ADDR / $MASTER_PORT")
    g.add_argument("--rank", type=int, default=None, help="this worker's rank, 1..N (default $RANK)")
    g.add_argument("--world-size", type=int, default=None, help="N workers + 1 front end (default $WORLD_SIZE)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="log verbosity (default: info)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from servelab.cluster.channel import Rendezvous
    from servelab.errors import InvalidArgument

    rdv = Rendezvous.from_env(
        master_addr=args.master_addr, master_port=args.master_port, rank=args.rank, world_size=args.world_size,
        timeout_s=parse_duration_s(args.join_timeout, name="--join-timeout"),
    )  # fmt: skip
    if rdv.rank == 0:
        raise InvalidArgument("--rank: 0 is the front end (`servelab serve --external-workers`); workers are 1..N")
    log = log_to_stderr(f"%(levelname)-9s [worker{rdv.rank}] %(message)s", args.log_level, replace=True)
    log.info("servelab worker %d of %d: joining %s:%d", rdv.rank, rdv.world_size - 1, rdv.master_addr, rdv.master_port)

    from servelab.cluster.worker import worker_main

    return worker_main(rdv)
