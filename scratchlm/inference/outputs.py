"""What the engine returns: `RequestOutput` with one `CompletionOutput` per sample, and `EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One sample of a request. `text` and `token_ids` are cumulative (streaming: take the delta)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the engine failed this request alone (it is then finished)
    # SamplingParams.prompt_logprobs: entry j = {prompt token j: its logprob, + the top-k alternatives} (raw model
    # log-softmax at position j - 1; entry 0 is None), once per request (n > 1 too); None until the prompt is scored.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank in the vocabulary (1 = top)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    prefix_cache_queries: int  # full blocks looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # mixture-of-experts models under expert parallelism: {layer: token rows routed to each expert} since the engine
    # started (every rank's tokens); None when the runner does not count them (one process: not counted)
    expert_load: dict[int, list[int]] | None = None
