"""Cost models: what a step costs on an accelerator, and what fits in its memory."""

from servelab.cost.memory import DEFAULT_MEMORY_FRACTION, MemoryPlan
from servelab.cost.roofline import Efficiency, Roofline
from servelab.cost.step_cost import Shape, StepCost, StepCostModel

__all__ = ["DEFAULT_MEMORY_FRACTION", "Efficiency", "MemoryPlan", "Roofline", "Shape", "StepCost", "StepCostModel"]
