"""`--disagg P:D`: the prefill and decode pools and how their KV moves (torch-free: the CLI
reads it). cluster/disagg_worker.py runs the workers, cluster/kv_transfer.py forms their
transfer groups and moves the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from servelab.errors import InvalidArgument

# one message per block (every layer's K and V) or per layer (every block's); block is the default:
# 0.5-0.9x layer's time here (docs/disaggregation.md, benchmarks/kv_transfer.py)
GRANULARITIES = ("block", "layer")
# a whole request's KV; a busy peer answers between its steps, so one step must fit in it
DEFAULT_KV_TRANSFER_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """The prefill and decode pools: ranks 1..P prefill, P+1..P+D decode (rank 0: the front end)."""

    num_prefill: int
    num_decode: int
    kv_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S
    granularity: str = GRANULARITIES[0]

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidArgument(
                f"--disagg needs at least one prefill and one decode worker, got {self.num_prefill}:{self.num_decode}",
                param="disagg",
            )
        if not self.kv_timeout_s > 0:
            raise InvalidArgument(
                f"--kv-transfer-timeout must be > 0 s, got {self.kv_timeout_s}", param="kv_transfer_timeout"
            )
        if self.granularity not in GRANULARITIES:
            raise InvalidArgument(f"KV transfer granularity must be one of {', '.join(GRANULARITIES)}, "
                                  f"got {self.granularity!r}", param="granularity")  # fmt: skip

    @property
    def prefill_ranks(self) -> list[int]:
        return list(range(1, self.num_prefill + 1))

    @property
    def decode_ranks(self) -> list[int]:
        return list(range(self.num_prefill + 1, self.num_prefill + self.num_decode + 1))

    def role_of(self, rank: int) -> str:
        return "prefill" if rank <= self.num_prefill else "decode"


def parse_disagg(text: str) -> tuple[int, int]:
    """ "P:D" -> (P, D)."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise InvalidArgument(f"--disagg takes P:D, the prefill and decode worker counts (e.g. 1:1), got {text!r}",
                              param="disagg") from None  # fmt: skip
    DisaggConfig(p, d)  # the checks
    return p, d
