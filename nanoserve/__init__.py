"""nanoserve: a from-scratch LLM inference engine you can read end to end, measure honestly and change."""

from nanoserve.config import EngineConfig, PlanOverrides
from nanoserve.engine import Engine, EngineStats
from nanoserve.params import PoolingParams, SamplingParams
from nanoserve.request import RequestOutput

__all__ = ["Engine", "EngineConfig", "EngineStats", "PlanOverrides", "PoolingParams", "RequestOutput", "SamplingParams"]
