"""Pydantic models of the OpenAI HTTP API (the subset this server speaks).

Requests are validated here: a wrong type or an out-of-range value becomes a 400 whose OpenAI-shaped
error body names the field (see ``app.py``). Unknown fields are ignored, as vLLM does, so that
clients that send newer OpenAI fields keep working. ``top_k``, ``min_p`` and ``repetition_penalty``
are extensions (vLLM's names).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scratchlm.inference.params import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SEED_RANGE,
)

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# ----------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="served model name; omitted means the served model")
    max_tokens: int | None = Field(
        None, ge=1, description="tokens to generate at most; default: up to the context length"
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 (or below 1e-5) means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="completions per prompt (limit: the server's --max-n and max-num-seqs)")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters, "
                          "not included in the output")
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1], description="any 64-bit integer")
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="extension: sample among the k most likely (k <= vocabulary); -1/0 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension: min probability relative to the top")
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             description="extension: >1 discourages repeats, 1 = off")
    ignore_eos: bool = Field(False, description="extension: keep generating after the end-of-sequence token")
    min_tokens: int = Field(0, ge=0, description="extension: EOS and stops are ignored before this many tokens")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                             description="extension: token ids that end the generation")
    include_stop_str_in_output: bool = Field(False, description="extension: keep the matched stop string")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a prompt, a list of prompts, token ids, or a list of token-id lists"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="return the log-probabilities of the top N tokens")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, description="only best_of == n is supported")


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., description="the conversation; at least one message")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens (newer OpenAI name)")
    add_generation_prompt: bool = Field(True, description="extension: end the prompt with the assistant header")


class TokenizeRequest(BaseModel):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="prepend BOS when the model's tokenizer does")
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "scratchlm"
    max_model_len: int | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON-ready dict of a response model (None fields kept, as OpenAI does)."""
    return model.model_dump(mode="json")
