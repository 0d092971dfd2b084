"""The inference engine: requests and continuous batching, a paged KV cache, attention over it, the
model runner with whole-step CUDA graphs per batch bucket, and sampling (DESIGN.md, "The engine")."""

from epmoe.engine.config import EngineConfig
from epmoe.engine.engine import Engine
from epmoe.engine.logprobs import TokenLogprobs
from epmoe.engine.request import RequestOutput
from epmoe.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "TokenLogprobs"]
