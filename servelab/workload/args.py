"""The workload flags shared by `servelab sim` and `servelab bench`."""

from __future__ import annotations

import argparse

from servelab.errors import InvalidArgument
from servelab.workload.arrivals import parse_think_time
from servelab.workload.lengths import LengthDist
from servelab.workload.spec import DATASET_KINDS, DEFAULT_TEXT_INPUT_LEN, MAX_NUM_REQUESTS, WorkloadSpec


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_float, default=None, help="open loop: requests per second (inf = all at t=0)")
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: clients each sending the next request when the last one ends "
        "(with --rate: the most requests in flight)",
    )
    g.add_argument(
        "--think-time",
        default=None,
        metavar="[exp:]DURATION",
        help="closed loop: each client waits this long after a request ends before it sends the next: "
        "50ms, or exp:5s for exponential pauses of mean 5 s (users reading; a constant pause keeps "
        "clients that started together in lockstep) (default 0: at once)",
    )
    g.add_argument(
        "--burstiness",
        type=_float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, inf = constant rate (default 1)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to send (default 1000, or all of a trace; at most 1,000,000)",
    )
    g.add_argument(
        "--input-len",
        default=None,
        help="prompt tokens: 1024 | 512-2048 | uniform:512,2048 | lognormal:MEAN,SIGMA (default 1024)",
    )
    g.add_argument("--output-len", default=None, help="output tokens, same forms (default 256)")
    g.add_argument(
        "--shared-prefix",
        type=_float,
        default=0.0,
        metavar="FRACTION",
        help="a prefix each group's prompts share, as a system prompt, this fraction of the mean prompt (a "
        "shorter prompt shares all but its last token), so prefix caching shows (default 0)",
    )
    g.add_argument("--prefix-groups", type=int, default=1, help="number of distinct shared prefixes (default 1)")
    load.add_argument("--trace", default=None, help="JSONL trace: arrival_s, prompt_tokens, output_tokens per line")
    g.add_argument("--dataset", default=None, help="ShareGPT-format JSON file to draw prompt/output lengths from")
    g.add_argument(
        "--dataset-kind",
        choices=DATASET_KINDS,
        default=None,
        help="what the prompts are: random (seeded random words, the default), sharegpt (--dataset's), "
        "edit (copy a Python docs passage with a small edit: speculative decoding's n-gram lookup hits) "
        "or summarize (summarize a passage: some hits); edit and summarize draw --input-len "
        f"(default {DEFAULT_TEXT_INPUT_LEN}) as the whole prompt's length",
    )
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the lengths, arrivals and prompt texts (default 0: the same requests every run; "
                        "vary it between bench runs against one server, or its prefix cache serves the repeats)")  # fmt: skip


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    if args.input_len is not None:
        LengthDist.parse(args.input_len, name="--input-len")
    if args.output_len is not None:
        LengthDist.parse(args.output_len, name="--output-len")
    if args.rate is not None and not args.rate > 0:
        raise InvalidArgument(f"--rate must be > 0 requests/s, got {args.rate:g}")
    if args.concurrency is not None and args.concurrency < 1:
        raise InvalidArgument(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.num_requests is not None and args.num_requests < 1:
        raise InvalidArgument(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.num_requests is not None and args.num_requests > MAX_NUM_REQUESTS:
        raise InvalidArgument(f"--num-requests must be at most {MAX_NUM_REQUESTS:,}, got {args.num_requests:,}")
    if not args.burstiness > 0:
        raise InvalidArgument(f"--burstiness must be > 0, got {args.burstiness:g}")
    think_time_s, think_time_dist = (0.0, "constant") if args.think_time is None else parse_think_time(args.think_time)
    if not 0 <= args.shared_prefix < 1:
        raise InvalidArgument(f"--shared-prefix must be a fraction in [0, 1), got {args.shared_prefix:g}")
    return WorkloadSpec(
        num_requests=args.num_requests,
        rate=args.rate,
        concurrency=args.concurrency,
        burstiness=args.burstiness,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_fraction=args.shared_prefix,
        num_prefix_groups=args.prefix_groups,
        seed=args.seed,
        dataset=args.dataset,
        trace=args.trace,
        think_time_s=think_time_s,
        think_time_dist=think_time_dist,
        dataset_kind=args.dataset_kind,
    )
