"""The serving engine: paged KV cache, prefix caching, continuous batching with chunked prefill,
preemption by recompute, full sampling. `LLM` is the offline API, `LLMEngine` the streaming one."""

from scratchlm.inference.config import EngineConfig
from scratchlm.inference.engine import LLMEngine
from scratchlm.inference.llm import LLM
from scratchlm.inference.outputs import CompletionOutput, EngineStats, RequestOutput
from scratchlm.inference.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
