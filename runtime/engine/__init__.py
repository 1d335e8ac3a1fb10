"""The engine: scheduler, paged KV cache, model runner, sampler, detokenizer.

Importing this package needs torch but not the server's packages (fastapi, uvicorn, pydantic).
"""

from envex.runtime.engine.config import EngineConfig
from envex.runtime.engine.engine import Completion, EngineStats, LLMEngine
from envex.runtime.engine.types import (
    EngineError,
    EngineInternalError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "Completion", "EngineConfig", "EngineError", "EngineInternalError", "EngineStats", "LLMEngine",
    "PromptTooLongError", "QueueFullError", "RequestOutput", "SamplingParams", "TokenLogprob",
]
