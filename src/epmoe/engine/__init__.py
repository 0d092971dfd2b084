"""The inference engine: requests and continuous batching, a paged KV cache, attention over it, the
model runner with whole-step CUDA graphs per batch bucket, and sampling (DESIGN.md, "The engine")."""

from .config import EngineConfig
from .engine import Engine
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
