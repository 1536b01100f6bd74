"""A sequence (one sample of one request) and its state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from scratchlm.inference.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt plus what has been generated, its KV blocks and its progress.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; the scheduler feeds the rest
    (a prefill chunk, or the one new token of a decode). When a step computes the last token, the
    sampler appends one output token. `block_table` has one entry per logical block; for a model whose
    every layer is windowed, the leading `num_dropped_blocks` entries are the pool's null block (their K/V
    fell out of the window and were freed, block_manager.py).
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    params: SamplingParams
    prompt_ids: list[int]
    arrival: int  # order of arrival: lower = older = scheduled first, preempted last
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full, computed blocks
    num_dropped_blocks: int = 0  # leading block_table entries that are the null block (before the sliding window)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    # Sample 0 of a request with prompt_logprobs: entry j scores prompt token j (entry 0 is None), filled as the
    # prefill goes (the scheduler returns the logits of the positions still missing); ranks alongside (1 = top).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    pending_forks: int = 0  # samples 1..n-1 that fork from this one: the scheduler reserves their slots
    # Detokenization state (see engine._detokenize)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids) + list(self.output_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0 and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first position whose logits the prompt logprobs still need (position p scores token p + 1), or None
        when none are (not asked for, or complete)."""
        lps = self.prompt_logprobs
        return None if lps is None or len(lps) >= len(self.prompt_ids) else len(lps) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
