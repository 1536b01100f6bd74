"""Pydantic models of the OpenAI HTTP API (the subset this server speaks).

Requests are validated here: a wrong type or an out-of-range value becomes a 400 whose OpenAI-shaped
error body names the field (see ``app.py``).

No field is silently ignored. Every request model forbids unknown fields (a 400 naming the field, code
``unsupported_parameter``). OpenAI fields this server does not implement (``tools``, ``tool_choice``,
``functions``, ``function_call``, ``response_format`` other than ``{"type": "text"}``,
``parallel_tool_calls``, ``audio``, ``prediction``, ...) are declared so that their error says so, and
are accepted only when absent, null, or set to the value that changes nothing (``tool_choice: "none"``
with no tools, ``store: false``, ``modalities: ["text"]``). Fields that never change the output
(``user``, ``metadata``, ``safety_identifier``, ``prompt_cache_key``) are accepted. The vLLM-style
extensions the engine implements (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``add_generation_prompt``) are
accepted; vLLM's ``prompt_logprobs`` is not implemented (400). ``/v1/embeddings`` accepts ``dimensions``
only when it equals the model's width, and the extensions ``pooling`` and ``normalize``. The table is in
docs/server.md.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from scratchlm.inference.params import (
    MAX_LOGIT_BIAS,
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


UNSUPPORTED = "unsupported_parameter"  # the pydantic error type (and the 400's code) of an unimplemented field


def unsupported(what: str) -> PydanticCustomError:
    """The validation error of a field this server does not implement (its 400 names the field)."""
    return PydanticCustomError(UNSUPPORTED, "{what} is not supported by this server", {"what": what})


def _reject_unless(value: Any, allowed: tuple, what: str) -> Any:
    """`value` when it is one of `allowed` (the values that change nothing), else the unsupported error."""
    if any(value == a and type(value) is type(a) for a in allowed):
        return value
    raise unsupported(what)


class StrictModel(BaseModel):
    """A request model that answers an unknown field with a 400 naming it instead of ignoring it."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""

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
    user: str | None = Field(None, description="an end-user id; accepted, changes nothing")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = Field(
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit before sampling; "
                          "ids must be in the vocabulary")
    # OpenAI fields that change nothing here (accepted) or are not implemented (400 unless null / the no-op value).
    metadata: dict[str, str] | None = Field(None, description="stored-completion tags; accepted, changes nothing")
    safety_identifier: str | None = Field(None, description="accepted, changes nothing")
    prompt_cache_key: str | None = Field(None, description="a caching hint; accepted, changes nothing "
                                                           "(the prefix cache is automatic)")
    store: bool | None = Field(None, description="only false: stored completions are not implemented")
    service_tier: str | None = Field(None, description="only \"auto\" or \"default\"")
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

    @field_validator("store")
    @classmethod
    def _store(cls, v: Any) -> Any:
        return _reject_unless(v, (None, False), "`store: true` (stored completions)")

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v: Any) -> Any:
        return _reject_unless(v, (None, "auto", "default"),
                              f"`service_tier: {repr(v)[:40]}` (only \"auto\" or \"default\")")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v: Any) -> Any:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError("invalid_value", "logit_bias keys must be token ids (decimal integers), got "
                                                           "{key}", {"key": repr(key)[:40]})
        return v


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
    prompt_logprobs: Any = Field(None, description="not supported (vLLM extension): 400 unless null")

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, v: Any) -> Any:
        return _reject_unless(v, (None,), "`prompt_logprobs`")


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One message. Only `role` and `content` reach the chat template; the fields an OpenAI client echoes back
    from a reply (``tool_calls``, ``function_call``, ``refusal``, ``audio``, ``annotations``) are accepted
    when null or empty, and are a 400 otherwise (tool calling is not implemented), as are ``name`` and
    ``tool_call_id``, which the template would never see."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: Any = Field(None, description="not supported: 400 unless null")
    tool_calls: Any = Field(None, description="not supported: 400 unless null or empty")
    tool_call_id: Any = Field(None, description="not supported: 400 unless null")
    function_call: Any = Field(None, description="not supported: 400 unless null")
    refusal: Any = Field(None, description="400 unless null")
    audio: Any = Field(None, description="not supported: 400 unless null")
    annotations: Any = Field(None, description="400 unless null or empty")

    @field_validator("name", "tool_call_id", "function_call", "refusal", "audio")
    @classmethod
    def _null_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None,), f"a message's `{info.field_name}`")

    @field_validator("tool_calls", "annotations")
    @classmethod
    def _null_or_empty(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None, []), f"a message's `{info.field_name}`")

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
    # OpenAI fields that are not implemented: 400 unless null (or the value that changes nothing).
    tools: Any = Field(None, description="not supported (tool calling): 400 unless null")
    tool_choice: Any = Field(None, description="only \"none\" (no tools can be given)")
    functions: Any = Field(None, description="not supported (deprecated tool calling): 400 unless null")
    function_call: Any = Field(None, description="only \"none\"")
    parallel_tool_calls: Any = Field(None, description="not supported (tool calling): 400 unless null")
    response_format: Any = Field(None, description='only {"type": "text"}: structured outputs are not supported')
    modalities: Any = Field(None, description='only ["text"]')
    audio: Any = Field(None, description="not supported: 400 unless null")
    prediction: Any = Field(None, description="not supported (predicted outputs): 400 unless null")
    reasoning_effort: Any = Field(None, description="not supported: 400 unless null")
    verbosity: Any = Field(None, description="not supported: 400 unless null")
    web_search_options: Any = Field(None, description="not supported: 400 unless null")

    @field_validator("tools", "functions", "parallel_tool_calls", "audio", "prediction", "reasoning_effort",
                     "verbosity", "web_search_options")
    @classmethod
    def _null_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None,), f"`{info.field_name}`")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _none_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None, "none"), f"`{info.field_name}` other than \"none\" (tool calling)")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        return _reject_unless(v, (None, {"type": "text"}), '`response_format` other than {"type": "text"} '
                                                           "(structured outputs)")

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: Any) -> Any:
        return _reject_unless(v, (None, ["text"]), '`modalities` other than ["text"]')


class TokenizeRequest(StrictModel):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="prepend BOS when the model's tokenizer does")
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(StrictModel):
    """POST /v1/embeddings. The vector is the model's final hidden state (after the final norm) pooled over the
    input (inference/embeddings.py). ``dimensions`` is accepted only when it equals the model's width
    (truncating a vector is not implemented); ``pooling`` and ``normalize`` are extensions (vLLM-style)."""

    model: str | None = Field(None, description="served model name; omitted means the served model")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a text, a list of texts, token ids, or a list of token-id lists (none empty)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="\"base64\": each vector as base64 of its little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="only the model's width (hidden size)")
    user: str | None = Field(None, description="an end-user id; accepted, changes nothing")
    pooling: Literal["last", "mean"] | None = Field(
        None, description="extension: the last token's state or the mean over tokens; default: the server's "
                          "--embedding-pooling")
    normalize: bool = Field(True, description="extension: L2-normalise each vector (false: the raw pooled state)")


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


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


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
