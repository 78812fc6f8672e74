"""Serving metrics from per-request timestamps, shared by the simulator, the bench client and the server."""

from servelab.metrics.records import RequestRecord
from servelab.metrics.summary import (
    SLO,
    Dist,
    Summary,
    format_summary_table,
    steady_state_summary,
    summarize,
)

__all__ = ["SLO", "Dist", "RequestRecord", "Summary", "format_summary_table", "steady_state_summary", "summarize"]
