"""Scheduling core: sequences, the paged-KV block manager, the scheduler, plans and executors.

Pure Python (no torch, no numpy): the simulator and the bench client import it to start fast.
"""

from servelab.core.block_manager import BlockManager
from servelab.core.config import SchedulerConfig
from servelab.core.plan import (
    Executor,
    RequestOutput,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from servelab.core.scheduler import Scheduler, SchedulerStats
from servelab.core.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "BlockManager",
    "Executor",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
]
