"""Pydantic models of the OpenAI HTTP API (the subset this server speaks).

Requests are validated here: a wrong type or an out-of-range value becomes a 400 whose OpenAI-shaped
error body names the field (see ``app.py``).

No field is silently ignored. Every request model forbids unknown fields (a 400 naming the field, code
``unsupported_parameter``). OpenAI fields this server does not implement (the deprecated ``functions`` and
``function_call``, ``audio``, ``prediction``, ...) are declared so that their error says so, and are accepted
only when absent, null, or set to the value that changes nothing (``function_call: "none"``, ``store: false``,
``modalities: ["text"]``). Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, tool turns in the
history) is implemented; its policy is in server/tool_calls.py. Fields that never change
the output (``user``, ``metadata``, ``safety_identifier``, ``prompt_cache_key``) are accepted. The vLLM-style
extensions the engine implements (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``add_generation_prompt``) are
accepted. Prompt log-probabilities: ``echo`` (with ``logprobs``) on /v1/completions as OpenAI's legacy API (the
prompt's tokens and logprobs first, the first one null), ``max_tokens: 0`` with ``echo`` or ``prompt_logprobs``
(only the prompt is scored; without either it is a 400 saying why), and vLLM's ``prompt_logprobs`` on both routes
(the completion choice's / the chat response's ``prompt_logprobs``: null, then {token id: {logprob, rank,
decoded_token}} per prompt token; not with ``stream``, as vLLM). ``/v1/embeddings`` accepts ``dimensions``
only when it equals the model's width, and the extensions ``pooling`` and ``normalize``. The table is in
docs/server.md.

Structured outputs (grammar-constrained decoding, inference/structured.py) come two ways, never both at once:

- OpenAI's ``response_format`` on /v1/chat/completions: ``{"type": "text"}`` (nothing), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "description"?,
  "schema", "strict"?}}``. The schema is enforced whatever ``strict`` says: OpenAI only promises adherence
  with ``strict: true``, and output that always validates is a valid answer to ``strict: false`` too (nor
  does this server require the subset of JSON Schema OpenAI's strict mode accepts). ``name`` and
  ``description`` never reach the model: the grammar, not a prompt, makes the output follow the schema.
- vLLM's ``structured_outputs`` extension on both routes: exactly one of ``json`` (a schema, or its JSON
  text), ``regex``, ``choice``, ``grammar`` (a Lark grammar in llguidance's dialect) and ``json_object:
  true``. vLLM's tuning options ``disable_any_whitespace``, ``disable_additional_properties``,
  ``whitespace_pattern`` and ``structural_tag`` are 400s unless null/false; ``disable_fallback`` is
  accepted (there is one backend and never a fallback). vLLM's older ``guided_*`` fields are unknown (400).

A schema, regex or grammar the library cannot compile is a 400 carrying its message (app.py checks it before
the request is admitted).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
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


# ------------------------------------------------------------------------------- structured outputs


class ResponseFormatText(StrictModel):
    type: Literal["text"] = Field(description="plain text: no constraint")


class ResponseFormatJSONObject(StrictModel):
    type: Literal["json_object"] = Field(description="the reply is one JSON object (enforced by a grammar)")


class JSONSchemaSpec(StrictModel):
    """OpenAI's ``json_schema`` object. The schema is enforced whatever ``strict`` says (see the module's policy)."""

    name: str = Field(..., min_length=1, max_length=64, description="the schema's name; never shown to the model")
    description: str | None = Field(None, description="accepted; never shown to the model (the grammar enforces "
                                                       "the schema)")
    schema_: dict[str, Any] = Field(..., alias="schema", description="a JSON Schema: every reply validates "
                                                                    "against it")
    strict: bool | None = Field(None, description="true or false: the schema is enforced either way")


class ResponseFormatJSONSchema(StrictModel):
    type: Literal["json_schema"] = Field(description="the reply validates against `json_schema.schema`")
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's constraints, one per request


class StructuredOutputsField(StrictModel):
    """vLLM's ``structured_outputs`` extension (its ``StructuredOutputsParams``): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema, or its JSON text")
    regex: str | None = Field(None, description="the reply matches this regular expression (whole)")
    choice: list[str] | None = Field(None, min_length=1, description="the reply is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar in llguidance's dialect (may embed "
                                                  "`%json { schema }`)")
    json_object: bool | None = Field(None, description="true: the reply is one JSON object")
    disable_fallback: bool | None = Field(None, description="accepted: one backend, never a fallback")
    disable_any_whitespace: bool | None = Field(None, description="not supported: 400 unless null or false")
    disable_additional_properties: bool | None = Field(None, description="not supported: 400 unless null or false")
    whitespace_pattern: str | None = Field(None, description="not supported: 400 unless null")
    structural_tag: str | None = Field(None, description="not supported: 400 unless null")

    @field_validator("disable_any_whitespace", "disable_additional_properties")
    @classmethod
    def _false_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None, False), f"`structured_outputs.{info.field_name}: true`")

    @field_validator("whitespace_pattern", "structural_tag")
    @classmethod
    def _null_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None,), f"`structured_outputs.{info.field_name}`")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsField:
        given = [k for k in STRUCTURED_KINDS if self.kind_value(k) not in (None, False)]
        if len(given) != 1:
            raise PydanticCustomError("invalid_value", "set exactly one of json, regex, choice, grammar and "
                                                       "json_object: true (got {given})",
                                      {"given": ", ".join(given) or "none"})
        return self

    def kind_value(self, kind: str) -> Any:
        return self.json_ if kind == "json" else getattr(self, kind)


class SamplingFields(StrictModel):
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="served model name; omitted means the served model")
    max_tokens: int | None = Field(
        None, ge=0, description="tokens to generate at most; default: up to the context length; 0 only with echo or "
                                "prompt_logprobs (score the prompt alone)"
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
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="extension (vLLM): each prompt token's logprob, rank and the top N "
                                                 "alternatives (the first token's: null); not with stream")
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="extension (vLLM): constrain the reply to a JSON schema, regex, choice or grammar")

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


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(StrictModel):
    name: str = Field(..., description="the function called")
    arguments: str | dict[str, Any] = Field(..., description="its arguments: JSON text (OpenAI), or an object")


class ToolCallIn(StrictModel):
    """A call in an assistant turn of the history (what an OpenAI client echoes back from a reply)."""

    id: str | None = Field(None, description="the call's id; a `tool` message answers it by `tool_call_id`")
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictModel):
    """One message. ``role``, ``content`` (a string or text parts, joined), ``name``, an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` reach the chat template (server/tool_calls.py). The other
    fields an OpenAI client echoes back from a reply (``function_call``, ``refusal``, ``audio``, ``annotations``)
    are accepted when null or empty, and are a 400 otherwise."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, description="the author's name, or a tool result's function name")
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant turn's function calls")
    tool_call_id: str | None = Field(None, description="a tool result: the id of the call it answers")
    function_call: Any = Field(None, description="deprecated (use tool_calls): 400 unless null")
    refusal: Any = Field(None, description="400 unless null")
    audio: Any = Field(None, description="not supported: 400 unless null")
    annotations: Any = Field(None, description="400 unless null or empty")

    @field_validator("function_call", "refusal", "audio")
    @classmethod
    def _null_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None,), f"a message's `{info.field_name}`")

    @field_validator("annotations")
    @classmethod
    def _null_or_empty(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None, []), f"a message's `{info.field_name}`")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_TOOLS = 128  # OpenAI's limit on `tools`


class FunctionDefinition(StrictModel):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a-z, A-Z, 0-9, _ and -, at most 64")
    description: str | None = Field(None, description="shown to the model by the chat template")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments (an object); "
                                                                "omitted: no arguments")
    strict: bool | None = Field(None, description="true or false: a forced call's arguments always follow the schema")

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: Any) -> Any:
        kind = (v or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise PydanticCustomError("invalid_value", "must be a JSON Schema of type \"object\" (arguments are an "
                                                       "object), got type {kind}", {"kind": json.dumps(kind)[:40]})
        return v


class ToolDefinition(StrictModel):
    type: Literal["function"] = Field(description="only function tools")
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., description="the conversation; at least one message")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=0, description="same as max_tokens (newer OpenAI name)")
    add_generation_prompt: bool = Field(True, description="extension: end the prompt with the assistant header")
    tools: list[ToolDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description=f"functions the model may call (at most {MAX_TOOLS}); rendered by the "
                                                "model's chat template (server/tool_calls.py)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required (a call, forced by a grammar) or "
                          '{"type": "function", "function": {"name": ...}} (a call to that function, forced)')
    parallel_tool_calls: bool | None = Field(None, description="true (default): one or more calls; false: at most one")
    # OpenAI fields that are not implemented: 400 unless null (or the value that changes nothing).
    functions: Any = Field(None, description="deprecated (use tools): 400 unless null")
    function_call: Any = Field(None, description="deprecated (use tool_choice): only \"none\"")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (the reply validates against the "
                          "schema): enforced by a grammar")
    modalities: Any = Field(None, description='only ["text"]')
    audio: Any = Field(None, description="not supported: 400 unless null")
    prediction: Any = Field(None, description="not supported (predicted outputs): 400 unless null")
    reasoning_effort: Any = Field(None, description="not supported: 400 unless null")
    verbosity: Any = Field(None, description="not supported: 400 unless null")
    web_search_options: Any = Field(None, description="not supported: 400 unless null")

    @field_validator("functions", "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options")
    @classmethod
    def _null_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None,), f"`{info.field_name}`")

    @field_validator("function_call")
    @classmethod
    def _none_only(cls, v: Any, info: Any) -> Any:
        return _reject_unless(v, (None, "none"), f"`{info.field_name}` other than \"none\" (deprecated: use "
                                                 "tools and tool_choice)")

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: Any) -> Any:
        return _reject_unless(v, (None, ["text"]), '`modalities` other than ["text"]')


class TokenizeRequest(StrictModel):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS,
                                               description="with messages: rendered as /v1/chat/completions does")
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
    """The legacy completions shape: parallel lists, one entry per token (with ``echo``: the prompt's tokens first,
    the first one's logprob and top_logprobs null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one entry of a prompt token's {token id: ...} dict."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # one per prompt token, the first null (vLLM's shape)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension (vLLM), with `prompt_logprobs`


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension (vLLM: on the response, not the choice)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call: its first delta has index, id, type, the name and arguments ""; later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


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
