"""A workload: how many requests, when they arrive and how long they are. Seeded and reproducible."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from servelab.errors import InvalidArgument
from servelab.workload.arrivals import ArrivalProcess
from servelab.workload.datasets import Tokenizer, load_sharegpt, load_trace
from servelab.workload.lengths import LengthDist
from servelab.workload.texts import TEXT_KINDS, TextPrompts

logger = logging.getLogger(__name__)

DEFAULT_NUM_REQUESTS = 1000
DEFAULT_INPUT_LEN = "1024"
DEFAULT_OUTPUT_LEN = "256"
DEFAULT_TEXT_INPUT_LEN = "uniform:128,512"  # an edit's output is as long as its passage
# What the prompts are: seeded random words, a ShareGPT file's, or a task on a passage (texts.py).
DATASET_KINDS = ("random", "sharegpt", *TEXT_KINDS)
MAX_NUM_REQUESTS = 10**6  # each request's record and token times are kept in memory
# A float64 clock past ~1e9 s (32 years) still resolves microseconds; far beyond it, every latency
# of a run rounds to 0. A workload whose expected span passes this is refused, not mis-measured.
MAX_VIRTUAL_SPAN_S = 1e9

# Independent random streams, so that changing (say) the length distribution does not move
# the arrival times of the same seed.
_STREAM_ARRIVALS, _STREAM_INPUT, _STREAM_OUTPUT, _STREAM_GROUPS, _STREAM_DATASET, _STREAM_THINK = range(6)


@dataclass(slots=True)
class RequestSpec:
    index: int
    arrival_s: float | None  # None in closed loop: sent when a client becomes free
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0  # the first prefix_tokens of the prompt are shared within prefix_group
    prefix_group: int = 0
    prompt_text: str | None = None
    think_s: float = 0.0  # closed loop: its client's pause after it ended (reading it) before taking the next

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefix_tokens": self.prefix_tokens,
            "prefix_group": self.prefix_group,
            "think_s": self.think_s,
        }


@dataclass(slots=True)
class WorkloadSpec:
    """`rate` (requests/s) makes an open-loop workload; `concurrency` alone a closed loop; both: open
    loop with at most `concurrency` requests in flight (as vLLM's --max-concurrency). Neither:
    every request at t = 0. `input_len`/`output_len` are LengthDist strings; with a dataset or a
    trace they default to the file's lengths (an explicit `output_len` overrides a dataset's).
    `think_time_s`: in a closed loop, how long a client waits after its request ends (last token
    or error) before it sends the next one, constant or, with `think_time_dist` "exponential", its
    mean (drawn per request from the seed); refused with a rate or a trace's own send times.
    `dataset_kind`: what the prompts are (DATASET_KINDS); None means `sharegpt` with a dataset and
    `random` otherwise. The text kinds (`edit`, `summarize`) draw `input_len` as the whole
    prompt's length, default DEFAULT_TEXT_INPUT_LEN."""

    num_requests: int | None = None  # None: 1000, or every row of a trace
    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    input_len: str | LengthDist | None = None
    output_len: str | LengthDist | None = None
    shared_prefix_fraction: float = 0.0
    num_prefix_groups: int = 1
    seed: int = 0
    dataset: str | None = None
    trace: str | None = None
    arrival: str | None = None  # force "poisson" | "gamma" | "constant" | "closed"
    think_time_s: float = 0.0
    think_time_dist: str = "constant"
    dataset_kind: str | None = None
    # counts a text's tokens for the text kinds and datasets (None: estimated from words); bench
    # passes its tokenizer to generate(), the simulator sets it here (`sim --tokenizer`)
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    _arrivals: ArrivalProcess = field(init=False, repr=False)
    _trace_rows: int | None = field(init=False, repr=False, compare=False, default=None)  # what the trace gives

    def __post_init__(self) -> None:
        self._arrivals = ArrivalProcess.create(
            self.rate, self.concurrency, self.burstiness, self.arrival, self.think_time_s, self.think_time_dist
        )
        if self.num_requests is not None and self.num_requests < 1:
            raise InvalidArgument(f"num_requests must be >= 1, got {self.num_requests}", param="num_requests")
        if self.num_requests is not None and self.num_requests > MAX_NUM_REQUESTS:
            raise InvalidArgument(
                f"num_requests must be at most {MAX_NUM_REQUESTS:,}, got {self.num_requests:,}", param="num_requests"
            )
        self._check_span()
        if not 0.0 <= self.shared_prefix_fraction < 1.0:
            raise InvalidArgument(
                f"shared prefix fraction must be in [0, 1), got {self.shared_prefix_fraction}", param="shared_prefix"
            )
        if self.num_prefix_groups < 1:
            raise InvalidArgument(f"num_prefix_groups must be >= 1, got {self.num_prefix_groups}")
        if self.seed < 0:
            # numpy's generators take only non-negative seeds; say so instead of its traceback.
            raise InvalidArgument(f"seed must be >= 0, got {self.seed}", param="seed")
        if self.dataset and self.trace:
            raise InvalidArgument("give either a dataset (--dataset) or a trace (--trace), not both")
        if self.trace and self.rate is not None:
            raise InvalidArgument("a trace carries its own arrival times; drop --rate (or use --concurrency)")
        if self.trace and self.think_time_s and self.concurrency is None:
            raise InvalidArgument(
                "a trace without --concurrency is sent at its own arrival times; --think-time "
                "paces a closed loop: add --concurrency C or drop --think-time",
                param="think_time",
            )
        if self.trace and self.input_len is not None:
            raise InvalidArgument("a trace carries its own prompt lengths; drop --input-len")
        if self.dataset and self.input_len is not None:
            raise InvalidArgument("a dataset gives the prompt lengths; drop --input-len")
        if self.dataset and self.shared_prefix_fraction:
            raise InvalidArgument(
                "a dataset's prompts are sent as their own text, which shares no prefix: drop --shared-prefix",
                param="shared_prefix",
            )
        self._check_kind()
        # Parse now so a bad string fails before any work is done.
        if self.input_len is not None:
            self.input_len = LengthDist.parse(self.input_len, name="input length")
        if self.output_len is not None:
            self.output_len = LengthDist.parse(self.output_len, name="output length")

    def _check_kind(self) -> None:
        kind = self.dataset_kind
        if kind is None:
            return
        if kind not in DATASET_KINDS:
            raise InvalidArgument(
                f"--dataset-kind must be one of {', '.join(DATASET_KINDS)}, got {kind!r}", param="dataset_kind"
            )
        if kind == "sharegpt" and not self.dataset:
            raise InvalidArgument("--dataset-kind sharegpt reads a file: give it with --dataset FILE", param="dataset")
        if kind in ("random", *TEXT_KINDS) and self.dataset:
            raise InvalidArgument(
                f"--dataset FILE is a ShareGPT file; --dataset-kind {kind} makes its own prompts: drop one",
                param="dataset_kind",
            )
        if kind in TEXT_KINDS and self.trace:
            raise InvalidArgument(
                f"a trace carries its own prompts; --dataset-kind {kind} makes its own: drop one", param="dataset_kind"
            )
        if kind in TEXT_KINDS and self.shared_prefix_fraction:
            raise InvalidArgument(
                f"--dataset-kind {kind} prompts share only their instruction; drop --shared-prefix",
                param="shared_prefix",
            )
        if kind == "edit" and self.output_len is not None:
            raise InvalidArgument(
                "--dataset-kind edit: the output is the edited passage, as long as the prompt makes it; "
                "drop --output-len",
                param="output_len",
            )

    @property
    def kind(self) -> str:
        """What the prompts are: one of DATASET_KINDS."""
        if self.dataset_kind is not None:
            return self.dataset_kind
        return "sharegpt" if self.dataset else "random"

    def _check_span(self) -> None:
        """Refuse a load whose expected span passes MAX_VIRTUAL_SPAN_S (a tiny rate, a huge think time)."""
        n = self.num_requests or DEFAULT_NUM_REQUESTS
        if self.rate is not None and n / self.rate > MAX_VIRTUAL_SPAN_S:
            raise InvalidArgument(
                f"rate {self.rate:g} requests/s spreads {n:,} requests over about {n / self.rate:.3g} s, past the "
                f"{MAX_VIRTUAL_SPAN_S:.0e} s a run's clock measures latencies over: use a rate of at least "
                f"{n / MAX_VIRTUAL_SPAN_S:.3g} requests/s",
                param="rate",
            )
        if self.think_time_s and self.concurrency:
            span = math.ceil(n / self.concurrency) * self.think_time_s
            if span > MAX_VIRTUAL_SPAN_S:
                raise InvalidArgument(
                    f"think time {self.think_time_s:g} s: {n:,} requests over {self.concurrency} clients pause for "
                    f"about {span:.3g} s in all, past the {MAX_VIRTUAL_SPAN_S:.0e} s a run's clock measures "
                    f"latencies over: use a think time of at most "
                    f"{MAX_VIRTUAL_SPAN_S / math.ceil(n / self.concurrency):.3g} s",
                    param="think_time",
                )

    @property
    def arrivals(self) -> ArrivalProcess:
        return self._arrivals

    @property
    def input_dist(self) -> LengthDist:
        if isinstance(self.input_len, LengthDist):
            return self.input_len
        return LengthDist.parse(DEFAULT_TEXT_INPUT_LEN if self.kind in TEXT_KINDS else DEFAULT_INPUT_LEN)

    @property
    def output_dist(self) -> LengthDist:
        return self.output_len if isinstance(self.output_len, LengthDist) else LengthDist.parse(DEFAULT_OUTPUT_LEN)

    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream])

    def generate(self, tokenizer: Tokenizer | None = None) -> list[RequestSpec]:
        tokenizer = tokenizer or self.tokenizer
        if self.trace:
            return self._from_trace(self.trace)
        n = self.num_requests or DEFAULT_NUM_REQUESTS
        texts: list[str | None] = [None] * n
        if self.dataset:
            convs = load_sharegpt(self.dataset, tokenizer)
            rng = self._rng(_STREAM_DATASET)
            # Without replacement while the file lasts (as vLLM's bench), with replacement past that.
            picks = rng.permutation(len(convs))[:n] if n <= len(convs) else rng.integers(len(convs), size=n)
            if n > len(convs):
                logger.warning("%s: %d usable conversations for %d requests: prompts repeat, and a server's prefix "
                               "cache serves the repeats", self.dataset, len(convs), n)  # fmt: skip
            prompt = np.array([convs[i].prompt_tokens for i in picks], dtype=np.int64)
            output = np.array([convs[i].output_tokens for i in picks], dtype=np.int64)
            texts = [convs[i].prompt_text for i in picks]
            if self.output_len is not None:
                output = self.output_dist.sample(self._rng(_STREAM_OUTPUT), n)
        elif self.kind in TEXT_KINDS:
            targets = self.input_dist.sample(self._rng(_STREAM_INPUT), n)
            outs = None if self.output_len is None else self.output_dist.sample(self._rng(_STREAM_OUTPUT), n)
            maker = TextPrompts(self.kind, self.seed, tokenizer)
            made = [maker.prompt(i, int(targets[i]), None if outs is None else int(outs[i])) for i in range(n)]
            prompt = np.array([m.prompt_tokens for m in made], dtype=np.int64)
            output = np.array([m.output_tokens for m in made], dtype=np.int64)
            texts = [m.text for m in made]
        else:
            prompt = self.input_dist.sample(self._rng(_STREAM_INPUT), n)
            output = self.output_dist.sample(self._rng(_STREAM_OUTPUT), n)
        arrivals = self._arrivals.arrival_times_s(self._rng(_STREAM_ARRIVALS), n)
        thinks = self._arrivals.think_times_s(self._rng(_STREAM_THINK), n)
        # One prefix length for the whole workload, like a system prompt: a fraction of the length
        # distribution's mean (not the sample's: more requests must not move every prefix), cut
        # short only where a prompt is shorter (each prompt keeps one token of its own).
        prefix_len = int(self.shared_prefix_fraction * self.input_dist.mean)
        prefix = np.minimum(prefix_len, prompt - 1)
        groups = self._rng(_STREAM_GROUPS).integers(self.num_prefix_groups, size=n)
        # Plain Python numbers in one C pass each (indexing numpy arrays per request costs more).
        columns = (
            repeat(None, n) if arrivals is None else np.asarray(arrivals, dtype=np.float64).tolist(),
            np.asarray(prompt).astype(np.int64).tolist(),
            np.asarray(output).astype(np.int64).tolist(),
            prefix.astype(np.int64).tolist(),
            groups.tolist(),
            texts,
            np.asarray(thinks, dtype=np.float64).tolist(),
        )
        return [
            RequestSpec(
                index=i,
                arrival_s=arrival,
                prompt_tokens=p,
                output_tokens=o,
                prefix_tokens=pre,
                prefix_group=g,
                prompt_text=text,
                think_s=think,
            )
            for i, (arrival, p, o, pre, g, text, think) in enumerate(zip(*columns, strict=True))
        ]

    def _from_trace(self, trace: str) -> list[RequestSpec]:
        rows = load_trace(trace)
        # a shared prefix is a fraction of the whole trace's mean prompt, as of a distribution's
        prefix_len = int(self.shared_prefix_fraction * sum(r.prompt_tokens for r in rows) / len(rows))
        if self.num_requests is not None:
            rows = rows[: self.num_requests]
        self._trace_rows = len(rows)
        closed = self._arrivals.closed_loop
        output = None
        if self.output_len is not None:
            output = self.output_dist.sample(self._rng(_STREAM_OUTPUT), len(rows))
        thinks = self._arrivals.think_times_s(self._rng(_STREAM_THINK), len(rows))
        specs = []
        for i, row in enumerate(rows):
            prefix, group = row.prefix_tokens, row.prefix_group
            if self.shared_prefix_fraction > 0 and prefix == 0:
                prefix = min(prefix_len, row.prompt_tokens - 1)
            specs.append(
                RequestSpec(
                    index=i,
                    arrival_s=None if closed else row.arrival_s,
                    prompt_tokens=row.prompt_tokens,
                    output_tokens=row.output_tokens if output is None else int(output[i]),
                    prefix_tokens=prefix,
                    prefix_group=group,
                    prompt_text=row.prompt_text,
                    think_s=float(thinks[i]) if closed else 0.0,
                )
            )
        return specs

    def to_dict(self) -> dict[str, Any]:
        """Everything that defines the workload, for a run's `config`."""
        return {
            "num_requests": self.num_requests,
            "arrival": self._arrivals.kind,
            "rate": None if self.rate is None or math.isinf(self.rate) else self.rate,
            "concurrency": self.concurrency,
            "burstiness": self.burstiness if math.isfinite(self.burstiness) else "inf",
            "input_len": None if self.input_len is None else str(self.input_len),
            "output_len": None if self.output_len is None else str(self.output_len),
            "shared_prefix_fraction": self.shared_prefix_fraction,
            "num_prefix_groups": self.num_prefix_groups,
            "seed": self.seed,
            "dataset": None if self.dataset is None else str(Path(self.dataset)),
            "trace": None if self.trace is None else str(Path(self.trace)),
            "think_time_s": self.think_time_s,
            "think_time_dist": self.think_time_dist,
            "dataset_kind": None if self.trace else self.kind,
        }

    def describe(self) -> str:
        n = self.num_requests or DEFAULT_NUM_REQUESTS
        arrivals = self._arrivals.describe()
        if self.trace:
            if self._trace_rows is None:  # not generated yet: count what it will give
                rows = len(load_trace(self.trace))
                self._trace_rows = rows if self.num_requests is None else min(rows, self.num_requests)
            n = self._trace_rows
            lengths = f"trace {self.trace}"
            if not self._arrivals.closed_loop:  # sent at the trace's own times, not at a rate
                arrivals = "at the trace's arrival times"
                if self.concurrency is not None:
                    arrivals += f", at most {self.concurrency} in flight"
        elif self.dataset:
            lengths = f"dataset {self.dataset}"
        elif self.kind == "edit":
            lengths = f"edit a Python docs passage, {self.input_dist} in, the edited passage out"
        elif self.kind == "summarize":
            out = "a quarter of the passage" if self.output_len is None else str(self.output_dist)
            lengths = f"summarize a Python docs passage, {self.input_dist} in, {out} out"
        else:
            lengths = f"{self.input_dist} in, {self.output_dist} out"
        text = f"{n} request{'' if n == 1 else 's'}, {lengths}, {arrivals}"
        if self.shared_prefix_fraction:
            text += f", {self.shared_prefix_fraction:.0%} shared prefix in {self.num_prefix_groups} group(s)"
        return text
