"""The simulator: the engine's scheduler on a cost-model executor, on a virtual clock."""

from servelab.sim.runner import SimConfig, SimResult, simulate

__all__ = ["SimConfig", "SimResult", "simulate"]
