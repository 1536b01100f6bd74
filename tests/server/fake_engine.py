"""A small deterministic engine for the HTTP-layer tests only (never used by the shipped server).

It honours the engine contract of docs/contracts.md: ``add_request`` / ``abort_request`` / ``step`` /
``has_unfinished_requests`` / ``stats``, a paged KV pool with ``max_num_seqs`` and recompute
preemption, cumulative ``text``/``token_ids``, stop strings, ``n`` and logprobs. Its "model" echoes
the prompt's bytes cyclically (completion ``i`` starts ``i`` bytes later), so every expected output can
be computed by :func:`expected_text` without running the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is BOS, 257 is EOS."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    add_bos = True
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class FakeEngineConfig:
    max_num_seqs: int = 8
    max_model_len: int = 256
    block_size: int = 4
    num_blocks: int = 512
    step_delay_s: float = 0.002  # a real engine takes time per step; so does this one


@dataclass
class FakeSamplingParams:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # accepted, not applied (the echo engine does not sample)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: got {self.max_tokens!r}, expected >= 1")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    stop_reason: str | int | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


def chat_prompt(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages)


def echo_token(prompt_ids: list[int], index: int, position: int) -> int:
    body = [t for t in prompt_ids if t < 256] or [ord("x")]
    return body[(index + position) % len(body)]


def expected_text(prompt: str, max_tokens: int, index: int = 0, stop: list[str] | None = None) -> tuple[str, str]:
    """(text, finish_reason) the fake engine produces for a text prompt."""
    ids = [ByteTokenizer.bos_id, *ByteTokenizer().encode(prompt)]
    gen = [echo_token(ids, index, k) for k in range(max_tokens)]
    text = ByteTokenizer().decode(gen)
    for k in range(1, max_tokens + 1):
        partial = ByteTokenizer().decode(gen[:k])
        for s in stop or []:
            if s in partial:
                return partial[: partial.index(s)], "stop"
    return text, "length"


@dataclass
class _Seq:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: FakeSamplingParams
    generated: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    stop_text: list[str | None] = field(default_factory=list)
    blocks: int = 0

    def total_tokens(self) -> int:
        return len(self.prompt_ids) + max((len(g) for g in self.generated), default=0) * max(1, len(self.generated))


class FakeEngine:
    def __init__(self, config: FakeEngineConfig | None = None):
        self.config = config or FakeEngineConfig()
        self.tokenizer = ByteTokenizer()
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.free_blocks = self.config.num_blocks
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted: list[str] = []
        self.step_batches: list[int] = []  # running batch size at each step (continuous batching proof)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Like the real engine on a model without a template: the contents joined by newlines (``tools`` reach such
        a prompt through the generic format's system message, which is a message)."""
        return chat_prompt(messages)

    # -- contract
    def add_request(self, request_id: str, prompt: str | list[int], params: FakeSamplingParams) -> None:
        ids = [self.tokenizer.bos_id, *self.tokenizer.encode(prompt)] if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.config.max_model_len}")
        seq = _Seq(request_id, prompt if isinstance(prompt, str) else None, ids, params)
        seq.generated = [[] for _ in range(params.n)]
        seq.finish = [None] * params.n
        seq.stop_text = [None] * params.n
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> None:
        for pool in (self.waiting, self.running):
            for seq in list(pool):
                if seq.request_id == request_id:
                    pool.remove(seq)
                    self.free_blocks += seq.blocks
                    seq.blocks = 0
                    self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        total = self.config.num_blocks
        return EngineStats(len(self.running), len(self.waiting), total, self.free_blocks,
                           (total - self.free_blocks) / total, 0, 0, self.preemptions, self.prompt_tokens,
                           self.generation_tokens)

    def _blocks_needed(self, seq: _Seq, extra: int) -> int:
        bs = self.config.block_size
        per = -(-(len(seq.prompt_ids) + max(len(g) for g in seq.generated) + extra) // bs)
        return per * len(seq.generated)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.config.step_delay_s)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = self._blocks_needed(seq, 1)
            if need > self.free_blocks:
                break
            self.waiting.pop(0)
            self.free_blocks -= need
            seq.blocks = need
            self.prompt_tokens += len(seq.prompt_ids)
            self.running.append(seq)
        self.step_batches.append(len(self.running))
        outputs = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted by a sequence ahead of it in this step
            need = self._blocks_needed(seq, 1) - seq.blocks
            while need > self.free_blocks and len(self.running) > 1:
                victim = self.running[-1] if self.running[-1] is not seq else self.running[0]
                self.running.remove(victim)
                self.free_blocks += victim.blocks
                victim.blocks = 0
                self.waiting.insert(0, victim)
                self.preemptions += 1
            if need > self.free_blocks:
                continue
            self.free_blocks -= need
            seq.blocks += need
            for i, gen in enumerate(seq.generated):
                if seq.finish[i] is not None:
                    continue
                gen.append(echo_token(seq.prompt_ids, i, len(gen)))
                self.generation_tokens += 1
                text = self.tokenizer.decode(gen)
                for s in seq.params.stop:
                    if s in text:
                        seq.finish[i], seq.stop_text[i] = "stop", s
                if seq.finish[i] is None and len(gen) >= (seq.params.max_tokens or 10**9):
                    seq.finish[i] = "length"
            finished = all(f is not None for f in seq.finish)
            if finished:
                self.running.remove(seq)
                self.free_blocks += seq.blocks
                seq.blocks = 0
            outputs.append(self._output(seq, finished))
        return outputs

    def _output(self, seq: _Seq, finished: bool) -> RequestOutput:
        outs = []
        for i, gen in enumerate(seq.generated):
            text = self.tokenizer.decode(gen)
            if seq.stop_text[i] is not None:
                text = text[: text.index(seq.stop_text[i])]
            lps = None
            if seq.params.logprobs is not None:
                lps = [{t: -0.25, (t + 1) % 256: -1.5} for t in gen]
            outs.append(CompletionOutput(i, text, list(gen), seq.finish[i], lps, seq.stop_text[i]))
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_ids, outs, finished)
