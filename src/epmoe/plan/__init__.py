"""The planner: whether tensor or expert parallelism wins for a model, machine and batch (prices only;
it never runs anything).

``request`` holds the request and result values, ``costs`` the cost and memory model, ``hardware/`` the
hardware profiles (JSON files with their sources) and their parser, ``planner`` the strategies priced,
``report`` the ``epmoe plan`` table, plot and JSON, ``plot`` a ``--plot`` path's check and format (``epmoe
balance`` too), ``draft`` a speculative-decoding draft's sizes, ``speculative`` whether speculative decoding
pays per strategy (verify step, drafts, break-even, tokens/s).
"""

from __future__ import annotations

from epmoe.plan.hardware import HardwareProfile, LinkProfile, hardware_names, load_hardware
from epmoe.plan.planner import plan
from epmoe.plan.request import Plan, PlanRequest, StepEstimate, StrategyPlan

__all__ = [
    "HardwareProfile", "LinkProfile", "Plan", "PlanRequest", "StepEstimate", "StrategyPlan", "hardware_names",
    "load_hardware", "plan",
]
