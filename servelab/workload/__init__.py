"""Workloads shared by the simulator and the bench client: arrivals, lengths, datasets, traces."""

from servelab.workload.args import add_workload_arguments, workload_from_args
from servelab.workload.arrivals import ArrivalProcess
from servelab.workload.datasets import estimate_tokens, load_sharegpt, load_trace
from servelab.workload.lengths import LengthDist
from servelab.workload.spec import RequestSpec, WorkloadSpec
from servelab.workload.tokens import has_own_tokens, simulated_prompt, token_ids_for

__all__ = [
    "ArrivalProcess",
    "LengthDist",
    "RequestSpec",
    "WorkloadSpec",
    "add_workload_arguments",
    "estimate_tokens",
    "has_own_tokens",
    "load_sharegpt",
    "load_trace",
    "simulated_prompt",
    "token_ids_for",
    "workload_from_args",
]
