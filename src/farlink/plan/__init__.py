"""Planner: predicted time, utilization, bytes and money for decentralized training runs too big
to try on one machine. Pure Python + numpy; importing it does not import torch (asking an algorithm's capabilities,
which live with the algorithm, does)."""

from farlink.plan.model import (
    PlanResult,
    RoundPrediction,
    Scenario,
    plan,
    plan_many,
    planned_algorithms,
    predict_round,
    required_bandwidth,
    step_seconds,
)
from farlink.plan.payload import codec_cost
from farlink.plan.sizes import parse_model_size
from farlink.plan.tables import GPU, PlanInputError, load_hardware

__all__ = [
    "GPU",
    "PlanInputError",
    "PlanResult",
    "RoundPrediction",
    "Scenario",
    "codec_cost",
    "load_hardware",
    "parse_model_size",
    "plan",
    "plan_many",
    "planned_algorithms",
    "predict_round",
    "required_bandwidth",
    "step_seconds",
]
