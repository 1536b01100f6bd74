"""The FastAPI application: OpenAI-compatible endpoints in front of one :class:`EngineLoop`.

``create_app(engine, config)`` builds the app around an engine that honours the contract in
docs/contracts.md ("Inference engine"). Every request is validated before it reaches the engine;
every failure becomes an OpenAI-shaped error body (``{"error": {"message", "type", "param", "code"}}``)
and the server keeps serving. A field the server does not implement is a 400 naming it in ``param``
(code ``unsupported_parameter``), never silently ignored (the policy is in protocol.py).

Error bodies follow one rule (`internal_error`): a request the client got wrong gets a message written for it,
naming the field and the numbers; a failure that is not the client's (an engine exception, a dead rank, a bug)
gets a generic message with an error id, and the exception's text (addresses, pids, source paths) goes to the
log under that same id, never to the response, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from scratchlm.server import tool_calls, tool_parsers
from scratchlm.server.auth import authorization_ok
from scratchlm.server.config import ServerConfig
from scratchlm.server.engine_loop import (
    EngineDeadError,
    EngineHungError,
    EngineLoop,
    RequestFailedError,
    RequestStream,
    TimedOutput,
)
from scratchlm.server.health import HealthConfig
from scratchlm.server.metrics import ServerMetrics
from scratchlm.server.protocol import (
    STRUCTURED_KINDS,
    UNSUPPORTED,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    dump,
)

log = logging.getLogger("scratchlm.server")

STATIC_DIR = Path(__file__).resolve().parent / "static"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error answered to the client with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    # a message may quote the client's input: lone surrogates would make the UTF-8 body itself fail (a 500)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(dump(body), status_code=status, headers=headers)


# --------------------------------------------------------------------------------------- middleware


class GuardMiddleware:
    """Pure ASGI: the Host check (DNS rebinding), the Bearer API key, the body size limit and strict UTF-8
    bodies, before any route runs. It sits inside the CORS middleware, so its 401/403/413 carry CORS headers.

    The body is read whole (at most ``max_body_bytes`` + 1 bytes) and replayed to the app.
    """

    def __init__(self, app: Any, config: ServerConfig):
        self.app = app
        self.config = config
        self.api_key = config.api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        head_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + len(scope.get("raw_path") or b"")
        if head_bytes > self.config.max_header_bytes:  # a head h11 got in one piece (it only bounds partial ones)
            await error_response(431, f"The request line and headers are larger than {self.config.max_header_bytes} "
                                      "bytes.", code="headers_too_large")(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if not self.config.host_allowed(None if host is None else host.decode("latin-1")):
            shown = host.decode("latin-1")[:100]
            accepted = ("loopback names" if self.config.allowed_hosts is None
                        else ", ".join(self.config.allowed_hosts))
            await error_response(403, f"Host header {shown!r} is not allowed: this server (bound to "
                                      f"{self.config.host}) accepts only {accepted} (DNS-rebinding guard); "
                                      "start it with --allowed-hosts NAME to accept another.",
                                 "permission_error", code="host_not_allowed")(scope, receive, send)
            return
        if (self.api_key is not None and path.startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS"
                and not authorization_ok(headers.get(b"authorization"), self.api_key)):
            await error_response(401, "Invalid or missing API key: send the header `Authorization: Bearer KEY`.",
                                 "authentication_error", code="invalid_api_key")(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(int(declared), scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(size, scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            await error_response(400, f"The request body is not valid UTF-8 (invalid byte at offset {e.start}); "
                                      "send UTF-8 encoded JSON.", code="invalid_utf8")(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope: dict, receive: Callable, send: Callable) -> None:
        await error_response(413, f"The request body is too large ({size} bytes or more); the limit is "
                                  f"{self.config.max_body_bytes} bytes.", code="body_too_large")(scope, receive, send)


# --------------------------------------------------------------------------------------- state


@dataclass
class ServerState:
    """Everything the handlers share; lives on ``app.state.server``."""

    engine: Any
    loop: EngineLoop
    config: ServerConfig
    model_name: str
    model_root: str | None
    sampling_params_cls: type
    metrics: ServerMetrics
    max_model_len: int
    capacity: int  # sequences (every sample of every prompt) in the running batch + queue: beyond it, 429
    max_prompt_chars: int  # no text longer than this can tokenize to fewer than max_model_len tokens
    tokenize_pool: ThreadPoolExecutor  # tokenization and chat templates run here, off the event loop
    active: int = 0  # requests in flight
    active_seqs: int = 0  # their sequences (prompts x n): what admission counts
    started: float = field(default_factory=time.time)
    grammars: Any = None  # the server's own GrammarCompiler (checks before admission; made on first use)
    grammar_lock: threading.Lock = field(default_factory=threading.Lock)  # the compiler is not thread-safe

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


def _default_sampling_params_cls() -> type:
    from scratchlm.inference import SamplingParams

    return SamplingParams


def create_app(engine: Any, config: ServerConfig | None = None, model_name: str | None = None,
               model_root: str | None = None, sampling_params_cls: type | None = None,
               engine_loop: Any | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine loop starts and stops with the app's lifespan.

    By default the engine runs in a thread of this process (:class:`EngineLoop`). Pass
    ``engine_loop=EngineProcessLoop(...)`` (and its ``.engine`` as `engine`) to run it in a child process.
    """
    config = config or ServerConfig()
    engine_config = engine.config
    name = config.served_model_name or model_name or "scratchlm"
    state = ServerState(
        engine=engine,
        loop=engine_loop if engine_loop is not None else EngineLoop(engine, health=HealthConfig.from_server(config)),
        config=config,
        model_name=name,
        model_root=model_root,
        sampling_params_cls=sampling_params_cls or _default_sampling_params_cls(),
        metrics=ServerMetrics(name),
        max_model_len=int(getattr(engine, "max_model_len", None) or engine_config.max_model_len
                          or engine.model_config.max_seq_len),
        capacity=int(engine_config.max_num_seqs) + config.max_queue,
        max_prompt_chars=0,
        tokenize_pool=_tokenize_pool(),
    )
    state.max_prompt_chars = state.max_model_len * max_chars_per_token(engine.tokenizer)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        log.info("serving model %r (max_model_len=%d, max_num_seqs=%d, queue=%d)", name, state.max_model_len,
                 engine_config.max_num_seqs, config.max_queue)
        try:
            yield
        finally:
            state.loop.stop()
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            state.tokenize_pool = _tokenize_pool()  # threads start on first use: ready if the app is served again

    app = FastAPI(title="scratchlm OpenAI-compatible server", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat on a scratchlm engine.")
    app.state.server = state
    _install_error_handlers(app)
    _install_routes(app, state)
    from scratchlm.server import inspector

    inspector.install(app, state)  # GET /inspector: the live engine page (server/inspector.py)
    app.add_middleware(GuardMiddleware, config=config)
    if config.cors_origins:  # added last = outermost: the guard's own 401/403/413 get the CORS headers too
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    return app


def _tokenize_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="scratchlm-tokenize")


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token of `tokenizer` stands for: the longest single-token decode,
    + 1 for a leading space a SentencePiece-style decode drops. Text longer than max_model_len x this cannot
    fit the context, so it is rejected before it is tokenized (tokenizing megabytes takes seconds)."""
    if tokenizer is None:
        return 1
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    longest = 1
    for i in range(vocab):
        try:
            longest = max(longest, len(tokenizer.decode([i])))
        except Exception:  # an id the tokenizer cannot decode alone (reserved, special)
            continue
    return longest + 1


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        unsupported = [e for e in errors if e.get("type") in ("extra_forbidden", UNSUPPORTED)]
        if unsupported:  # a field the server does not implement: named (dotted path) in `param`, never ignored
            def path_of(err: dict) -> str:  # "messages.0.tool_calls" (pydantic's union-branch tags left out)
                return _body_path(err.get("loc", ()), exc.body)

            parts = []
            for err in unsupported[:5]:
                path = path_of(err)
                if err.get("type") == "extra_forbidden":
                    parts.append(f"`{path}` is not a field this server implements")
                else:
                    parts.append(f"`{path}`: {err.get('msg', 'not supported')}")
            first = path_of(unsupported[0])
            message = ("Unsupported parameter: " + "; ".join(parts) + ". Remove it (docs/server.md lists the "
                       "fields this server supports).")
            if len(unsupported) > 5:
                message += f" And {len(unsupported) - 5} more."
            return error_response(400, message, param=first, code=UNSUPPORTED)
        by_field: dict[str, list[dict]] = {}
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            by_field.setdefault(loc[0] if loc else "body", []).append(err)
        parts, param = [], None
        for where, errs in list(by_field.items())[:5]:
            err = errs[0]
            if err.get("type") == "json_invalid":
                ctx = err.get("ctx", {})
                parts.append(f"the body is not valid JSON ({ctx.get('error', 'parse error')})")
                continue
            param = param or where
            got = err.get("input")
            got_text = "" if isinstance(got, dict | list) else f" (got {json.dumps(got, default=str)[:80]})"
            if len(errs) > 1 and len({tuple(e.get("loc", ())) for e in errs}) > 1:
                parts.append(f"{where}: wrong type or value{got_text}: " + "; ".join(
                    ".".join(str(x) for x in e["loc"][1:]) + ": " + e.get("msg", "") for e in errs[:4]))
            else:
                sub = _body_path(err.get("loc", ()), exc.body)
                parts.append(f"{sub or where}: {err.get('msg', 'invalid value')}{got_text}")
        message = "Invalid request: " + "; ".join(parts)
        if len(by_field) > 5:
            message += f"; and {len(by_field) - 5} more fields"
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path} (see /docs for the routes)"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, type_, headers=getattr(exc, "headers", None))

    async def not_the_clients_fault(request: Request, exc: Exception) -> JSONResponse:
        status, info = internal_error(exc, f"{request.method} {request.url.path}")
        return JSONResponse(dump(ErrorResponse(error=info)), status_code=status)

    for kind, *_ in _INTERNAL_ERRORS:  # Exception last: Starlette's outermost handler (which also re-raises it)
        app.add_exception_handler(kind, not_the_clients_fault)


# (exception class, status, type, code, what the client reads): the first class that matches wins
_INTERNAL_ERRORS: tuple[tuple[type, int, str, str, str], ...] = (
    (RequestFailedError, 500, "internal_server_error", "engine_request_failed",
     "The engine failed this request (the other requests continue)"),
    (EngineHungError, 503, "service_unavailable", "engine_hung",  # server/health.py
     "The engine is hung (no progress within the server's --step-timeout-s); the server is exiting so that a "
     "supervisor restarts it"),
    (EngineDeadError, 503, "service_unavailable", "engine_unavailable",
     "The engine is not available (it failed or the server is stopping)"),
    (Exception, 500, "internal_server_error", "internal_error", "Internal server error"),
)


def internal_error(exc: BaseException, where: str) -> tuple[int, ErrorInfo]:
    """(status, error body) for a failure that is not the client's: a generic message per kind of failure and a
    new error id; the exception's text (which may hold addresses, pids, paths) is logged in full with that id and
    never returned. A failure the engine already logged (RequestFailedError, EngineDeadError) is logged on one
    line; anything else with its traceback."""
    status, type_, code, what = next((s, t, c, w) for k, s, t, c, w in _INTERNAL_ERRORS if isinstance(exc, k))
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    expected = isinstance(exc, RequestFailedError | EngineDeadError)
    log.error("%s failed [error id %s]: %s: %s", where, error_id, type(exc).__name__, exc,
              exc_info=None if expected else exc)
    message = f"{what}. Error id {error_id}: the server log has the details."
    return status, ErrorInfo(message=message, type=type_, code=code)


def _body_path(loc: tuple, body: Any) -> str:
    """The dotted path in the request body of a validation error's `loc` ("response_format.json_schema.schema").
    pydantic's loc also names union branches ("list[str]", a discriminated union's tag "json_schema"); walking
    the body tells them apart from keys: what is not a key (or the last, missing key of an object) is left out."""
    items = list(loc[1:] if loc[:1] == ("body",) else loc)
    if not isinstance(body, dict):  # no parsed body to walk: drop the tags that look like types
        return ".".join(str(x) for x in items if not (isinstance(x, str) and "[" in x))
    parts, node = [], body
    for i, x in enumerate(items):
        key = isinstance(node, dict) and isinstance(x, str) and x in node
        if key or isinstance(node, list) and isinstance(x, int) and 0 <= x < len(node):
            node = node[x]
        elif isinstance(node, dict) and i == len(items) - 1 and not (isinstance(x, str) and "[" in x):
            node = None  # a required key that is missing
        else:
            continue  # a union branch's tag
        parts.append(str(x))
    return ".".join(parts)


# --------------------------------------------------------------------------------------- helpers


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}` "
                            "(see GET /v1/models).", "not_found_error", param="model", code="model_not_found")


def _require_tokenizer(state: ServerState, param: str) -> Any:
    """The tokenizer, or a 400 saying this model has none (token-id prompts still work)."""
    if state.tokenizer is None:
        from scratchlm.model.loading.tokenizers import NO_TOKENIZER

        raise APIError(400, f"`{param}`: {NO_TOKENIZER}.", param=param, code="no_tokenizer")
    return state.tokenizer


def reject_surrogates(value: Any, param: str) -> None:
    """400 for a lone UTF-16 surrogate (valid JSON, e.g. "\\ud800", but not Unicode text: it cannot be encoded)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"`{param}` holds a lone UTF-16 surrogate (\\u{ord(value[e.start]):04x} at character "
                                f"{e.start}); send valid Unicode text.", param=param, code="invalid_unicode") from None
    elif isinstance(value, list | tuple):
        for v in value:
            reject_surrogates(v, param)
    elif isinstance(value, dict):
        for k, v in value.items():
            reject_surrogates(k, param)
            reject_surrogates(v, param)
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            reject_surrogates(getattr(value, name), param)


def _check_request_text(req: Any) -> None:
    for name in type(req).model_fields:
        reject_surrogates(getattr(req, name), name)


def _check_text_length(state: ServerState, chars: int, param: str) -> None:
    if chars > state.max_prompt_chars:
        raise APIError(400, f"The {param} has {chars} characters; this model's maximum context length is "
                            f"{state.max_model_len} tokens and one token stands for at most "
                            f"{state.max_prompt_chars // state.max_model_len} characters, so no text longer than "
                            f"{state.max_prompt_chars} characters can fit; shorten it.", param=param,
                       code="context_length_exceeded")


def _encode_sync(tok: Any, texts: list[str], add_bos: bool) -> list[list[int]]:
    out = []
    bos = getattr(tok, "bos_id", None)
    for text in texts:
        ids = list(tok.encode(text))
        if add_bos and getattr(tok, "add_bos", False) and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        out.append(ids)
    return out


async def _encode(state: ServerState, texts: list[str], param: str, add_bos: bool = True) -> list[list[int]]:
    """Token ids of `texts` (BOS added as the engine does), computed in the tokenizer pool, off the event loop;
    each text is first checked against the longest text that could fit the context."""
    if not texts:
        return []
    tok = _require_tokenizer(state, param)
    for text in texts:
        _check_text_length(state, len(text), param)
    return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, _encode_sync, tok, texts, add_bos)


async def _render_chat(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                       tools: list[dict] | None = None, fallback: list[dict] | None = None) -> str:
    """The chat template, in the tokenizer pool (the contents' total length is checked first); `tools` are passed
    to it only when given (an engine without tool support keeps working for plain chats). `fallback`: messages
    rendered instead when the template refuses `messages` (tool_calls.ToolPlan.no_system)."""
    _check_text_length(state, sum(len(m.get("content") or "") for m in messages), "messages")
    kwargs = {} if tools is None else {"tools": tools}

    def render() -> str:
        try:
            return state.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError:
            if fallback is None:
                raise
            return state.engine.apply_chat_template(fallback, add_generation_prompt=add_generation_prompt, **kwargs)

    try:
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, render)
    except ValueError as e:  # a template that rejects the conversation (e.g. roles out of order)
        raise APIError(400, f"The chat template could not render these messages: {e}", param="messages") from e


def _vocab_size(state: ServerState) -> int:
    return int(getattr(state.tokenizer, "vocab_size", None) or state.engine.model_config.vocab_size)


def _check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = _vocab_size(state)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"`{param}` holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param=param,
                       code="invalid_token_id")


def _context_limit(state: ServerState) -> str:
    """"This model's maximum context length is N tokens", saying when the KV cache is what sets N: the engine lowers
    max_model_len to what its cache holds, so a longer sequence could never run, however long it waited."""
    text = f"This model's maximum context length is {state.max_model_len} tokens"
    config = state.engine.config
    asked = int(getattr(config, "max_model_len", None) or state.engine.model_config.max_seq_len)
    if state.max_model_len < asked:
        block = int(config.block_size) * int(getattr(config, "context_parallel_size", 1) or 1)
        text += (f" (lowered from {asked}: the whole KV cache holds {state.max_model_len // block} blocks of {block} "
                 f"tokens = {state.max_model_len} tokens; --kv-cache-memory sets its size)")
    return text


def _resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    """The request's max_tokens, or what is left of the context when it gives none; a 400 naming the numbers when
    the prompt (+ max_tokens) could never fit the context (or the KV cache that bounds it)."""
    limit = state.max_model_len
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty: send at least one token.", param="prompt", code="empty_prompt")
    if prompt_len > limit or (prompt_len == limit and requested != 0):  # max_tokens 0 only scores the prompt
        raise APIError(400, f"{_context_limit(state)}, but the prompt has {prompt_len} tokens; shorten the prompt.",
                       param="prompt", code="context_length_exceeded")
    if requested is None:  # the rest of the context (vLLM's and OpenAI's default), or --default-max-tokens
        cap = state.config.default_max_tokens
        return limit - prompt_len if cap is None else min(cap, limit - prompt_len)
    if prompt_len + requested > limit:
        raise APIError(400, f"{_context_limit(state)}. However, you requested {prompt_len + requested} tokens "
                            f"({prompt_len} in the prompt, {requested} for the completion). Reduce the prompt or "
                            "max_tokens.", param="max_tokens", code="context_length_exceeded")
    return requested


def _sampling_params(state: ServerState, req: SamplingFields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> Any:
    max_num_seqs = int(state.engine.config.max_num_seqs)
    if req.n > min(state.config.max_n, max_num_seqs):
        raise APIError(400, f"n={req.n} is above this server's limit of {min(state.config.max_n, max_num_seqs)} "
                            f"(--max-n {state.config.max_n}, --max-num-seqs {max_num_seqs}: every sample is one "
                            "running sequence).", param="n", code="invalid_value")
    vocab = _vocab_size(state)
    if req.top_k is not None and req.top_k > vocab:
        raise APIError(400, f"top_k={req.top_k} is above the vocabulary size: expected -1 or 0 (off) or an integer "
                            f"in [1, {vocab}].", param="top_k", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "`stop` strings must not be empty.", param="stop")
    if req.stop_token_ids:
        _check_token_ids(state, req.stop_token_ids, "stop_token_ids")
    logit_bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
    if logit_bias:
        _check_token_ids(state, list(logit_bias), "logit_bias")
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=stop or None,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos, logprobs=logprobs, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    if req.min_p is not None:
        kwargs["min_p"] = req.min_p
    if req.repetition_penalty is not None:
        kwargs["repetition_penalty"] = req.repetition_penalty
    if logit_bias:
        kwargs["logit_bias"] = logit_bias
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    structured = _structured_outputs(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    try:
        return state.sampling_params_cls(**kwargs)
    except (ValueError, TypeError) as e:
        named = str(e).partition(":")[0].removeprefix("SamplingParams.")  # "SamplingParams.min_tokens: got ..."
        raise APIError(400, f"Invalid sampling parameters: {e}", param=named if named.isidentifier() else None,
                       code="invalid_value") from e


def _structured_param(req: SamplingFields) -> str:
    """The field a structured-outputs error names."""
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def _structured_outputs(req: SamplingFields) -> Any:
    """The request's constraint as the engine's ``StructuredOutputs``, or None: OpenAI's ``response_format`` (chat;
    ``{"type": "text"}`` is none) or vLLM's ``structured_outputs`` (both routes), never both. A tool-call grammar
    (tool_choice required or named) with one of them is a 400 (`_with_tool_grammar`)."""
    fmt, ext = getattr(req, "response_format", None), req.structured_outputs
    if fmt is not None and fmt.type != "text" and ext is not None:
        raise APIError(400, "`response_format` and `structured_outputs` both constrain the reply: send one of them.",
                       param="structured_outputs", code="invalid_value")
    if ext is not None:
        kind = next(k for k in STRUCTURED_KINDS if ext.kind_value(k) not in (None, False))
        kwargs = {kind: ext.kind_value(kind)}
    elif fmt is None or fmt.type == "text":
        return None
    elif fmt.type == "json_object":
        kwargs = {"json_object": True}
    else:
        kwargs = {"json": fmt.json_schema.schema_}
    from scratchlm.inference.params import StructuredOutputs

    try:
        return StructuredOutputs(**kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"Invalid {_structured_param(req)}: {e}", param=_structured_param(req),
                       code="invalid_value") from e


async def _check_structured(state: ServerState, params: Any, param: str) -> None:
    """400 carrying the grammar library's message when `params`' constraint cannot be compiled, before the request
    is admitted. Compiled in the tokenizer pool by the server's own `GrammarCompiler` (its LRU makes a repeated
    spec free; the engine, in a thread or a process, compiles with its own), one check at a time."""
    spec = getattr(params, "structured_outputs", None)
    if spec is None:
        return
    from scratchlm.inference.structured import GrammarCompiler, check_structured

    tokenizer = _require_tokenizer(state, param)

    def check() -> None:
        with state.grammar_lock:
            if state.grammars is None:
                state.grammars = GrammarCompiler(tokenizer)
            check_structured(spec, state.grammars)

    try:
        await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, check)
    except ValueError as e:  # "structured_outputs.regex: llguidance cannot compile it: ..."
        where, _, message = str(e).partition(": ")
        if not (where.startswith("structured_outputs.") and message):
            where, message = "structured_outputs", str(e)
        if param != "structured_outputs":
            where = param
        raise APIError(400, f"`{where}` cannot be compiled into a grammar: {message}", param=param,
                       code="invalid_value") from e


def _tool_plan(state: ServerState, req: Any, tool_choice: Any = None, parallel: bool | None = None
               ) -> tool_calls.ToolPlan:
    """The request's tools as prompt, parser and grammar (server/tool_calls.py); its errors are 400s."""
    tok = state.tokenizer
    try:
        return tool_calls.plan(req.messages, req.tools, tool_choice, parallel, getattr(tok, "chat_template", None),
                               state.config.tool_call_parser,
                               tool_calls.single_token(tok) if tok is not None else lambda text: None)
    except tool_calls.ToolRequestError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from e
    except RecursionError:  # a parameters schema nested past Python's stack
        raise APIError(400, "`tools`: a function's parameters are nested too deeply.", param="tools",
                       code="invalid_value") from None


def _with_tool_grammar(params: Any, grammar: str) -> Any:
    """`params` constrained to the tool-call grammar; a 400 when the request already constrains the reply."""
    if not hasattr(params, "structured_outputs"):
        raise APIError(400, "This engine has no constrained decoding, which a forced tool call needs.",
                       param="tool_choice", code="unsupported")
    if params.structured_outputs is not None:
        raise APIError(400, "The tool call's grammar (tool_choice required or a named function; any tool_choice "
                            "but none on a template without tool syntax) and `response_format` / "
                            "`structured_outputs` both constrain the reply: send one of them.", param="tool_choice",
                       code="invalid_value")
    import dataclasses

    from scratchlm.inference.params import StructuredOutputs

    return dataclasses.replace(params, structured_outputs=StructuredOutputs(grammar=grammar))


def _tool_chunks(head: dict, index: int, calls: list, finish: str | None) -> list[dict]:
    """The streamed calls of one choice in OpenAI's shape: per call a delta with index, id, type, the name and
    arguments "", then one with the arguments; then the finish."""
    out = []
    for k, call in enumerate(calls):
        first = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        for delta in (first, {"index": k, "function": {"arguments": call.arguments}}):
            out.append({**head, "choices": [{"index": index, "delta": {"content": None, "tool_calls": [delta]},
                                             "logprobs": None, "finish_reason": None}]})
    out.append({**head, "choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]})
    return out


def _admit(state: ServerState, prompts: int, n: int) -> None:
    """Admission counts sequences (prompts x n), as the engine's running batch does. A request that could never be
    admitted, even by an idle server, is a 400 saying why; one that has to wait for others to finish is a 429 with
    Retry-After."""
    seqs = prompts * n
    if seqs > state.capacity:
        limits = (f"--max-num-seqs {state.engine.config.max_num_seqs} + --max-queue {state.config.max_queue}")
        raise APIError(400, f"This request needs {seqs} sequences ({prompts} prompt(s) x n={n}), more than this "
                            f"server ever holds at once: {state.capacity} ({limits}). It could never be admitted: "
                            "send fewer prompts or a smaller n.", param="prompt" if prompts > 1 else "n",
                       code="request_too_large")
    if state.active_seqs + seqs > state.capacity:
        state.metrics.requests_rejected_queue_full += 1
        raise APIError(429, f"The server is at capacity ({state.active_seqs} sequences running or queued, this "
                            f"request adds {seqs}, limit {state.capacity} = max-num-seqs + max-queue); retry later.",
                       "rate_limit_error", code="queue_full", headers={"Retry-After": str(state.config.retry_after_s)})


@dataclass
class _Tracked:
    """Per-engine-request bookkeeping for latency metrics and deltas."""

    stream: RequestStream
    prompt_index: int
    first_time: float | None = None
    last_time: float | None = None
    done: bool = False
    sent_text: dict[int, int] = field(default_factory=dict)  # completion index -> chars already sent
    sent_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> token ids already sent
    final: Any = None


async def _start(state: ServerState, prompts: list[str | list[int]], params: Any, base_id: str) -> list[_Tracked]:
    """Submit one engine request per prompt and wait until the engine accepted them all."""
    if not state.loop.alive:
        hung = getattr(state.loop, "failure_status", None) == "hung"  # given up for want of progress (health.py)
        raise (EngineHungError if hung else EngineDeadError)(getattr(state.loop, "failure", None)
                                                             or "the engine loop is not running; see the server log")
    n = int(getattr(params, "n", 1))
    _admit(state, len(prompts), n)

    def done() -> None:
        state.active -= 1
        state.active_seqs -= n

    tracked = []
    for i, p in enumerate(prompts):
        stream = state.loop.submit(f"{base_id}-{i}", p, params)
        stream.on_done = done
        state.active += 1
        state.active_seqs += n
        tracked.append(_Tracked(stream, i))
    try:
        for t in tracked:
            await t.stream.accepted
    except BaseException as e:
        _release(state, tracked, aborted=False)
        if isinstance(e, ValueError):  # the engine's "bad input" (anything else is not the client's: 500)
            raise APIError(400, f"The engine rejected the request: {e}", code="invalid_value") from e
        raise
    return tracked


def _release(state: ServerState, tracked: list[_Tracked], aborted: bool) -> None:
    """Abort what is still running (a disconnected client) and give back the admission slots."""
    for t in tracked:
        if not t.done:
            state.loop.abort(t.stream.request_id)
            if aborted:
                state.metrics.requests_aborted_by_client += 1
            t.done = True
        t.stream.close()


def _observe(state: ServerState, t: _Tracked, item: TimedOutput) -> None:
    out = item.output
    has_tokens = any(c.token_ids for c in out.outputs)
    if has_tokens:
        if t.first_time is None:
            t.first_time = item.time
            state.metrics.time_to_first_token.observe(item.time - t.stream.arrival)
        elif t.last_time is not None and item.time > t.last_time:
            state.metrics.inter_token_latency.observe(item.time - t.last_time)
        t.last_time = item.time
    if out.finished:
        t.done = True
        t.final = out
        state.metrics.e2e_request_latency.observe(item.time - t.stream.arrival)
        for c in out.outputs:
            state.metrics.request_success[c.finish_reason or "abort"] += 1


async def _merged(state: ServerState, tracked: list[_Tracked]) -> AsyncIterator[tuple[_Tracked, TimedOutput]]:
    """Outputs of several engine requests, as they arrive."""
    if len(tracked) == 1:
        t = tracked[0]
        async for item in t.stream:
            _observe(state, t, item)
            yield t, item
        return
    queue: asyncio.Queue[tuple[_Tracked, TimedOutput | BaseException | None]] = asyncio.Queue()

    async def pump(t: _Tracked) -> None:
        try:
            async for item in t.stream:
                await queue.put((t, item))
        except BaseException as e:  # delivered to the consumer, which re-raises it
            await queue.put((t, e))
            return
        await queue.put((t, None))

    tasks = [asyncio.create_task(pump(t)) for t in tracked]
    try:
        remaining = len(tasks)
        while remaining:
            t, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            _observe(state, t, item)
            yield t, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(tracked: list[_Tracked]) -> UsageInfo:
    prompt = sum(len(t.final.prompt_token_ids) for t in tracked if t.final is not None)
    completion = sum(len(c.token_ids) for t in tracked if t.final is not None for c in t.final.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _usage_so_far(latest: dict[int, Any]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in latest.values())
    completion = sum(len(c.token_ids) for o in latest.values() for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _token_text(state: ServerState, token_id: int) -> str:
    if state.tokenizer is None:  # vLLM's spelling (--return-tokens-as-token-ids): the ids survive without text
        return f"token_id:{token_id}"
    return state.tokenizer.decode([token_id])


def _completion_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                         start: int, offset: int) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    out = CompletionLogprobs()
    for tid, lp in zip(token_ids[start:], logprobs[start:]):
        text = _token_text(state, tid)
        out.tokens.append(text)
        out.token_logprobs.append(float(lp[tid]) if tid in lp else None)
        out.top_logprobs.append({_token_text(state, k): float(v) for k, v in lp.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _check_scoring(req: SamplingFields, requested: int | None, scores: bool, how: str) -> None:
    """`max_tokens: 0` only scores the prompt (`scores`: echo or prompt_logprobs asked for); vLLM's `prompt_logprobs`
    is not streamed (as vLLM)."""
    if requested == 0 and not scores:
        raise APIError(400, f"`max_tokens: 0` generates nothing: it is accepted only to score the prompt, with {how}.",
                       param="max_tokens", code="invalid_value")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "`prompt_logprobs` is not supported with `stream: true` (as vLLM); request it without "
                            "streaming.", param="prompt_logprobs", code=UNSUPPORTED)


def _top_entries(lp: dict[int, float], n: int, token: int) -> list[tuple[int, float]]:
    """The n most likely entries of an engine dict (which holds at least its top n and `token`), then `token`'s when
    it is not among them."""
    top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
    return top if any(t == token for t, _ in top) else [*top, (token, lp[token])]


def _echo_logprobs(state: ServerState, prompt_ids: list[int], prompt_lps: list[dict[int, float] | None] | None,
                   top_n: int) -> CompletionLogprobs:
    """The prompt's part of `echo`'s legacy logprobs: its tokens, their logprobs and `top_n` alternatives (OpenAI:
    the first token's null), text offsets counted over the token texts from 0."""
    out = CompletionLogprobs()
    offset = 0
    for j, tid in enumerate(prompt_ids):
        text = _token_text(state, tid)
        lp = prompt_lps[j] if prompt_lps is not None else None
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else float(lp[tid]))
        out.top_logprobs.append(None if lp is None else
                                {_token_text(state, k): float(v) for k, v in _top_entries(lp, top_n, tid)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _vllm_prompt_logprobs(state: ServerState, out: Any, n: int | None) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then {token id: {logprob, rank, decoded_token}} with
    the token itself and the n most likely (ranks 1..n; the token's own rank over the vocabulary)."""
    lps = getattr(out, "prompt_logprobs", None)
    if n is None or lps is None:
        return None
    ranks = out.prompt_logprob_ranks
    result: list[dict[str, dict] | None] = []
    for j, (tid, lp) in enumerate(zip(out.prompt_token_ids, lps)):
        if lp is None:
            result.append(None)
            continue
        entry = {}
        for r, (k, v) in enumerate(_top_entries(lp, n, tid), 1):
            entry[str(k)] = {"logprob": float(v), "rank": ranks[j] if k == tid else r,
                             "decoded_token": _token_text(state, k)}
        result.append(entry)
    return result


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict[int, float]] | None, start: int,
                   top_n: int) -> ChatChoiceLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for tid, lp in zip(token_ids[start:], logprobs[start:]):
        text = _token_text(state, tid)
        tops = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            token=text, logprob=float(lp.get(tid, float("-inf"))), bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=(s := _token_text(state, k)), logprob=float(v), bytes=list(s.encode()))
                          for k, v in tops]))
    return ChatChoiceLogprobs(content=content)


async def _wait_all(state: ServerState, request: Request, tracked: list[_Tracked]) -> None:
    """Consume every output; abort everything if the client goes away in the meantime."""

    async def consume() -> None:
        async for _ in _merged(state, tracked):
            pass

    task = asyncio.create_task(consume())
    disconnected = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return
            if await request.is_disconnected():
                log.info("client disconnected; aborting %s", [t.stream.request_id for t in tracked])
                disconnected = True
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
        _release(state, tracked, aborted=disconnected)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _stream_events(state: ServerState, tracked: list[_Tracked],
                         make_chunks: Callable[[_Tracked, Any], list[dict]],
                         first_chunks: list[dict], final_usage: Callable[[dict[int, Any]], dict | None]
                         ) -> AsyncIterator[bytes]:
    """SSE bytes: the first chunks, one chunk per output delta, the usage chunk, then ``[DONE]``.
    A client disconnect cancels this generator: its requests are aborted in ``finally``."""
    latest: dict[int, Any] = {}
    try:
        for chunk in first_chunks:
            yield _sse(chunk)
        async for t, item in _merged(state, tracked):
            latest[t.prompt_index] = item.output
            for chunk in make_chunks(t, item.output):
                yield _sse(chunk)
        usage = final_usage(latest)
        if usage is not None:
            yield _sse(usage)
        yield _sse("[DONE]")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # an engine failure after the headers went out: report it in-band, by the same rule
        _, info = internal_error(e, f"stream {tracked[0].stream.request_id if tracked else ''}")
        yield _sse(dump(ErrorResponse(error=info)))
        yield _sse("[DONE]")
    finally:
        if any(not t.done for t in tracked):
            log.info("stream closed early; aborting %s", [t.stream.request_id for t in tracked if not t.done])
        _release(state, tracked, aborted=True)


def _streaming_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --------------------------------------------------------------------------------------- routes


def _install_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"))

    @app.get("/favicon.ico", include_in_schema=False)
    @app.get("/favicon.svg", include_in_schema=False)
    async def favicon() -> Response:  # browsers ask for it; an SVG serves both names
        return Response((STATIC_DIR / "favicon.svg").read_bytes(), media_type="image/svg+xml",
                        headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/health", summary="200 when a step can run now: every heartbeat fresh, no step stuck (docs/server.md)")
    async def health() -> Response:
        look = getattr(state.loop, "health", None)  # server/health.py: heartbeats of the loop, process, ranks
        if look is None:
            if not state.loop.alive:
                return error_response(503, "the engine loop is not running", "service_unavailable")
            return JSONResponse({"status": "ok"})
        report = look()
        config = getattr(state.loop, "health_config", None) or HealthConfig.from_server(state.config)
        return JSONResponse(report.body(config), status_code=200 if report.ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (vLLM-style names)")
    async def metrics() -> PlainTextResponse:
        body = state.metrics.render(state.loop.stats(), state.active)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        # the model's name, never its local path (which says where the server's files are)
        root = None if state.model_root is None else Path(state.model_root).name
        card = ModelCard(id=state.model_name, max_model_len=state.max_model_len, root=root,
                         created=int(state.started))
        return dump(ModelList(data=[card]))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> dict:
        _check_request_text(req)
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Send exactly one of `prompt` (text) or `messages` (chat).", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "`messages` is empty: send at least one message.", param="messages")
            plan = _tool_plan(state, req)
            text = await _render_chat(state, plan.messages, req.add_generation_prompt, plan.tools, plan.no_system)
        else:
            text = req.prompt
        (ids,) = await _encode(state, [text], "messages" if req.messages is not None else "prompt",
                               add_bos=req.add_special_tokens)
        return dump(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids))

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> dict:
        _check_request_text(req)
        _check_model(state, req.model)
        _check_token_ids(state, req.tokens, "tokens")
        return dump(DetokenizeResponse(prompt=_require_tokenizer(state, "tokens").decode(req.tokens)))

    @app.post("/v1/embeddings", response_model=EmbeddingResponse,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def embeddings(req: EmbeddingRequest) -> dict:
        """Pooled final hidden states (after the final norm), L2-normalised unless ``normalize: false``; run by
        the engine between steps in chunks of at most max_num_batched_tokens tokens (inference/embeddings.py)."""
        _check_request_text(req)
        _check_model(state, req.model)
        width = getattr(getattr(state.engine, "model_config", None), "d_model", None)  # None: not a model's engine
        if req.dimensions is not None and req.dimensions != width:
            raise APIError(400, f"`dimensions: {req.dimensions}` is not supported by this server: this model's "
                                f"embeddings have {width} dimensions and only that value is accepted.",
                           param="dimensions", code=UNSUPPORTED)
        inputs = _embedding_inputs(state, req.input)
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i, ids in zip(texts, await _encode(state, [inputs[i] for i in texts], "input")):
            inputs[i] = ids
        for i, ids in enumerate(inputs):
            if len(ids) > state.max_model_len:
                raise APIError(400, f"input {i} has {len(ids)} tokens; this model's maximum context length is "
                                    f"{state.max_model_len} tokens: shorten it.", param="input",
                               code="context_length_exceeded")
        pooling = req.pooling or state.config.embedding_pooling
        budget = int(getattr(state.engine.config, "max_num_batched_tokens", 0) or 0)
        vectors: list[list[float]] = []
        chunk: list[list[int]] = []
        for ids in [*inputs, None]:  # chunks of <= budget tokens (one input at least): the engine steps between
            if chunk and (ids is None or sum(map(len, chunk)) + len(ids) > budget):
                try:
                    vectors += await state.loop.embed(chunk, pooling, req.normalize)
                except ValueError as e:
                    raise APIError(400, str(e), param="input") from e
                except NotImplementedError as e:
                    raise APIError(400, f"Embeddings are not available: {e}.", code="unsupported") from e
                chunk = []
            if ids is not None:
                chunk.append(ids)
        data = [EmbeddingData(index=i, embedding=v if req.encoding_format == "float" else _base64_f32(v))
                for i, v in enumerate(vectors)]
        n = sum(map(len, inputs))
        return dump(EmbeddingResponse(data=data, model=state.model_name,
                                      usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)))

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                         429: {"model": ErrorResponse}})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        _check_request_text(req)
        _check_model(state, req.model)
        _check_scoring(req, req.max_tokens, req.echo or req.prompt_logprobs is not None,
                       "`echo` (and `logprobs`) or `prompt_logprobs`")
        if req.suffix:
            raise APIError(400, "`suffix` is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "`best_of` is not supported (only best_of == n).", param="best_of")
        prompts = _normalize_prompts(state, req.prompt)
        originals = list(prompts)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        for i, ids in zip(texts, await _encode(state, [prompts[i] for i in texts], "prompt")):
            prompts[i] = ids  # the engine gets token ids: tokenized once, off the event loop
        lengths = [len(p) for p in prompts]
        max_tokens = min(_resolve_max_tokens(state, n, req.max_tokens) for n in lengths)
        # the prompt is scored in the prefill for echo's logprobs and vLLM's prompt_logprobs (the larger top-N)
        scoring = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        params = _sampling_params(state, req, max_tokens, req.logprobs,
                                  max(scoring) if scoring else 0 if max_tokens == 0 else None)
        # echo: the text prompt as sent, a token-id prompt decoded (no tokenizer: no text)
        echoed = [("" if state.tokenizer is None else state.tokenizer.decode(p)) if isinstance(p, list) else p
                  for p in originals] if req.echo else None
        await _check_structured(state, params, _structured_param(req))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tracked = await _start(state, prompts, params, request_id)
        n = req.n

        def choice_index(t: _Tracked, c: Any) -> int:
            return t.prompt_index * n + c.index

        def with_echo(t: _Tracked, out: Any, text: str, lp: CompletionLogprobs | None) -> tuple[str, Any]:
            """`echo`: the prompt's text before the completion's, and its tokens' logprobs before the completion's
            (whose text offsets move past the prompt's text)."""
            prompt_text = echoed[t.prompt_index]
            if lp is None:
                return prompt_text + text, None
            head = _echo_logprobs(state, out.prompt_token_ids, out.prompt_logprobs, req.logprobs)
            for field_name in ("tokens", "token_logprobs", "top_logprobs"):
                getattr(head, field_name).extend(getattr(lp, field_name))
            head.text_offset.extend(len(prompt_text) + o for o in lp.text_offset)
            return prompt_text + text, head

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunks(t: _Tracked, out: Any) -> list[dict]:
                result = []
                for c in out.outputs:
                    first = c.index not in t.sent_text
                    sent = t.sent_text.get(c.index, 0)
                    sent_tok = t.sent_tokens.get(c.index, 0)
                    delta = c.text[sent:]
                    if not delta and c.finish_reason is None and not (first and echoed is not None):
                        continue
                    lp = _completion_logprobs(state, c.token_ids, c.logprobs, sent_tok, sent)
                    if echoed is not None:  # the prompt first (its logprobs are there with the first token)
                        if first:
                            delta, lp = with_echo(t, out, delta, lp)
                        elif lp is not None:
                            lp.text_offset = [len(echoed[t.prompt_index]) + o for o in lp.text_offset]
                    t.sent_text[c.index], t.sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    # plain dicts (the CompletionResponse shape): this runs once per token and stream
                    choice = {"index": choice_index(t, c), "text": delta, "logprobs": None if lp is None else dump(lp),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    result.append({"id": request_id, "object": "text_completion", "created": created,
                                   "model": state.model_name, "choices": [choice], "usage": None})
                return result

            def usage_chunk(latest: dict[int, Any]) -> dict | None:
                if not include_usage:
                    return None
                return dump(CompletionResponse(id=request_id, model=state.model_name, choices=[],
                                               usage=_usage_so_far(latest)))

            return _streaming_response(_stream_events(state, tracked, chunks, [], usage_chunk))

        await _wait_all(state, request, tracked)
        choices = []
        for t in tracked:
            vllm_lps = _vllm_prompt_logprobs(state, t.final, req.prompt_logprobs)
            for c in t.final.outputs:
                text, lp = c.text, _completion_logprobs(state, c.token_ids, c.logprobs, 0, 0)
                if echoed is not None:
                    text, lp = with_echo(t, t.final, text, lp)
                choices.append(CompletionChoice(
                    index=choice_index(t, c), text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=lp, prompt_logprobs=vllm_lps))
        choices.sort(key=lambda ch: ch.index)
        return JSONResponse(dump(CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                                    usage=_usage(tracked))))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                         429: {"model": ErrorResponse}})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        _check_request_text(req)
        _check_model(state, req.model)
        if not req.messages:
            raise APIError(400, "`messages` is empty: send at least one message.", param="messages",
                           code="empty_messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
        plan = _tool_plan(state, req, req.tool_choice, req.parallel_tool_calls)
        text = await _render_chat(state, plan.messages, req.add_generation_prompt, plan.tools, plan.no_system)
        (prompt,) = await _encode(state, [text], "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        _check_scoring(req, requested, req.prompt_logprobs is not None, "`prompt_logprobs`")
        max_tokens = _resolve_max_tokens(state, len(prompt), requested)
        top_n = req.top_logprobs or 0
        params = _sampling_params(state, req, max_tokens, top_n if req.logprobs else None, req.prompt_logprobs)
        if plan.grammar is not None:
            params = _with_tool_grammar(params, plan.grammar)
        await _check_structured(state, params, "tools" if plan.grammar is not None else _structured_param(req))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tracked = await _start(state, [prompt], params, request_id)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices: list[ChatStreamChoice]) -> dict:
                return dump(ChatCompletionChunk(id=request_id, model=state.model_name, choices=choices))

            first = [chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                     for i in range(req.n)]

            tool_streams: dict[int, tool_calls.ToolStream] = {}  # choice -> its held-back text (tools only)

            def chunks(t: _Tracked, out: Any) -> list[dict]:
                result = []
                head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": state.model_name, "usage": None}
                for c in out.outputs:
                    sent_tok = t.sent_tokens.get(c.index, 0)
                    calls: list = []
                    if plan.fmt is None:
                        delta = c.text[t.sent_text.get(c.index, 0):]
                    else:
                        stream = tool_streams.setdefault(c.index, tool_calls.ToolStream(plan.fmt))
                        delta, calls = stream.step(c.text, c.finish_reason is not None)
                    if not delta and c.finish_reason is None:
                        continue
                    lp = _chat_logprobs(state, c.token_ids, c.logprobs, sent_tok, top_n)
                    t.sent_text[c.index], t.sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    # plain dicts (the ChatCompletionChunk shape): this runs once per token and stream
                    choice = {"index": c.index, "delta": {"content": delta or None},
                              "logprobs": None if lp is None else dump(lp), "finish_reason": c.finish_reason}
                    if calls:
                        if delta or lp is not None:
                            result.append({**head, "choices": [{**choice, "finish_reason": None}]})
                        result += _tool_chunks(head, c.index, calls, "tool_calls")
                    else:
                        result.append({**head, "choices": [choice]})
                return result

            def usage_chunk(latest: dict[int, Any]) -> dict | None:
                if not include_usage:
                    return None
                return dump(ChatCompletionChunk(id=request_id, model=state.model_name, choices=[],
                                                usage=_usage_so_far(latest)))

            return _streaming_response(_stream_events(state, tracked, chunks, first, usage_chunk))

        await _wait_all(state, request, tracked)
        out = tracked[0].final
        choices = []
        for c in out.outputs:
            message, finish = ChatResponseMessage(content=c.text), c.finish_reason
            if plan.fmt is not None:
                content, calls = tool_parsers.parse(plan.fmt, c.text)
                message = ChatResponseMessage(content=content, tool_calls=[
                    ToolCallOut.model_validate(call.to_openai()) for call in calls] or None)
                finish = "tool_calls" if calls else finish
            choices.append(ChatCompletionChoice(index=c.index, message=message, finish_reason=finish,
                                                stop_reason=c.stop_reason,
                                                logprobs=_chat_logprobs(state, c.token_ids, c.logprobs, 0, top_n)))
        return JSONResponse(dump(ChatCompletionResponse(
            id=request_id, model=state.model_name, choices=choices, usage=_usage(tracked),
            prompt_logprobs=_vllm_prompt_logprobs(state, out, req.prompt_logprobs))))


def _normalize_prompts(state: ServerState, prompt: Any) -> list[str | list[int]]:
    """The request's `prompt` as a list of prompts (text or token ids), checked."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif not prompt:
        raise APIError(400, "`prompt` is empty: send a string, a list of strings or token ids.", param="prompt",
                       code="empty_prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if len(prompts) > state.config.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts in one request is above the limit of "
                            f"{state.config.max_prompts} (--max-prompts).", param="prompt")
    for p in prompts:
        if isinstance(p, list):
            if not p:
                raise APIError(400, "A token-id prompt is empty.", param="prompt", code="empty_prompt")
            _check_token_ids(state, p, "prompt")
    return prompts


def _embedding_inputs(state: ServerState, value: Any) -> list[str | list[int]]:
    """The request's `input` as a list of texts and token-id lists, checked (none empty, ids in the vocabulary)."""
    if isinstance(value, str):
        inputs: list[str | list[int]] = [value]
    elif not value:
        raise APIError(400, "`input` is empty: send a string, a list of strings or token ids.", param="input",
                       code="empty_input")
    elif all(isinstance(x, int) for x in value):
        inputs = [list(value)]
    else:
        inputs = list(value)
    if len(inputs) > state.config.max_prompts:
        raise APIError(400, f"{len(inputs)} inputs in one request is above the limit of {state.config.max_prompts} "
                            "(--max-prompts).", param="input")
    vocab = _vocab_size(state)
    for i, x in enumerate(inputs):
        if not x:
            raise APIError(400, f"input {i} is empty.", param="input", code="empty_input")
        if isinstance(x, list):
            bad = [t for t in x if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"input {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                               param="input", code="invalid_token_id")
    return inputs


def _base64_f32(vector: list[float]) -> str:
    """OpenAI's base64 encoding of an embedding: its little-endian float32 bytes."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def api_key_from_env(config: ServerConfig) -> ServerConfig:
    """`config` with api_key taken from $SCRATCHLM_API_KEY when no flag gave one."""
    if config.api_key is None and os.environ.get("SCRATCHLM_API_KEY"):
        from dataclasses import replace

        return replace(config, api_key=os.environ["SCRATCHLM_API_KEY"])
    return config
