"""Continuous-batching generation over kvcompile's paged KV pool (vLLM-style)."""

from kvcompile.engine.engine import Engine
from kvcompile.engine.params import RequestError, SamplingParams
from kvcompile.engine.request import RequestOutput
from kvcompile.engine.stats import EngineStats, StepStats

__all__ = ["Engine", "SamplingParams", "RequestOutput", "RequestError", "EngineStats",
           "StepStats"]
