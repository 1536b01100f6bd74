"""`ServerConfig`: the HTTP side of `scratchlm serve` (the engine has its own `EngineConfig`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "generic")


def is_loopback(host: str) -> bool:
    """localhost, *.localhost, 127.0.0.0/8 and ::1 (names a DNS rebinding attack cannot point elsewhere)."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerConfig:
    """Options of the HTTP server; every field is also a `scratchlm serve` flag."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind; use 0.0.0.0 to accept remote clients"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0 = pick a free one)"})
    api_key: str | None = field(
        default=None,
        metadata={"help": "require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                  "(also read from $SCRATCHLM_API_KEY)"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "the model name clients send and see in /v1/models; None = the file's stem"}
    )
    max_queue: int = field(
        default=256,
        metadata={"help": "sequences (prompts x n samples) allowed to wait beyond the running batch (max-num-seqs); "
                  "more get 429"},
    )
    default_max_tokens: int | None = field(
        default=None,
        metadata={"help": "most tokens a completion may generate when its request sends no max_tokens; None = up to "
                  "the end of the context (max-model-len minus the prompt), as vLLM and OpenAI do. A small model "
                  "that loops can then stream for minutes: clients should send max_tokens"},
    )
    max_n: int = field(default=16, metadata={"help": "largest `n` (completions per prompt) a request may ask"})
    max_prompts: int = field(default=64, metadata={"help": "largest number of prompts in one /v1/completions call "
                                                            "(inputs in one /v1/embeddings call)"})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "request bodies above this get 413"})
    cors_origins: list[str] | None = field(
        default=None, metadata={"help": "origins allowed by CORS (e.g. '*'); CORS is off unless given"}
    )
    retry_after_s: int = field(default=1, metadata={"help": "Retry-After seconds sent with a 429"})
    allowed_hosts: list[str] | None = field(
        default=None,
        metadata={"help": "Host header names accepted (DNS-rebinding guard; '*' = any). Default: when bound to a "
                  "loopback address, only loopback names (localhost, *.localhost, 127.x.x.x, [::1]); else any"},
    )
    header_timeout_s: float = field(
        default=10.0, metadata={"help": "a connection that has not sent a complete request head within this many "
                                "seconds (from connecting, or from the previous response) is answered 408 and closed"}
    )
    max_header_bytes: int = field(
        default=16384, metadata={"help": "request line + headers larger than this get 431 (h11's incomplete-event "
                                 "limit)"}
    )
    keep_alive_timeout_s: float = field(
        default=5.0, metadata={"help": "idle keep-alive connections are closed after this many seconds"}
    )
    embedding_pooling: str = field(
        default="last", metadata={"help": "how /v1/embeddings pools the final hidden states when a request does not "
                                          "say: 'last' (the last token's) or 'mean' (over every token)"}
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "generic"] = field(
        default="auto", metadata={"help": "how tool calls are written and read back (server/tool_parsers.py): 'auto' "
                                          "= from the chat template's text (<tool_call>: hermes, [TOOL_CALLS]: "
                                          "mistral, <|python_tag|>/ipython: llama3_json, else generic JSON)"}
    )
    log_level: str = field(default="info", metadata={"help": "logging level: debug, info, warning, error"})
    heartbeat_timeout_s: float = field(
        default=5.0, metadata={"help": "/health answers 503 naming the part when the engine loop, the engine process "
                                       "or a TP/PP rank has shown no heartbeat for this many seconds (they beat every "
                                       "0.5 s; server/health.py)"}
    )
    step_timeout_s: float = field(
        default=120.0, metadata={"help": "a step running longer than this, or a part silent that long, means the "
                                         "engine is hung: requests in flight fail (503 / an error event) and the "
                                         "server exits with status 4 so a supervisor restarts it"}
    )
    first_step_timeout_s: float = field(
        default=600.0, metadata={"help": "the same bound for the first step (it may build kernels and warm caches)"}
    )

    def host_allowed(self, host_header: str | None) -> bool:
        """The DNS-rebinding guard: whether a request's Host header (``name[:port]``) may be served."""
        if host_header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_header.strip().lower()
        if name.startswith("["):
            name = name[: name.find("]") + 1] if "]" in name else name
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        allowed = self.allowed_hosts
        if allowed is None:
            if not is_loopback(self.host):
                return True
            return is_loopback(name.strip("[]"))
        return "*" in allowed or name in {h.lower() for h in allowed} or name.strip("[]") in {
            h.lower().strip("[]") for h in allowed}

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port={self.port} (expected 0..65535)")
        for name in ("max_queue", "max_n", "max_prompts", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) < (0 if name in ("max_queue", "retry_after_s") else 1):
                problems.append(f"{name}={getattr(self, name)} (expected a positive integer)")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            problems.append(f"default_max_tokens={self.default_max_tokens} (expected a positive integer, or omit it)")
        for name in ("header_timeout_s", "keep_alive_timeout_s", "heartbeat_timeout_s", "step_timeout_s",
                     "first_step_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} (expected a positive number of seconds)")
        if self.max_header_bytes < 1024:
            problems.append(f"max_header_bytes={self.max_header_bytes} (expected at least 1024)")
        if self.allowed_hosts is not None and not all(isinstance(h, str) and h for h in self.allowed_hosts):
            problems.append(f"allowed_hosts={self.allowed_hosts!r} (expected host names, or '*')")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            problems.append(f"log_level={self.log_level!r} (expected debug, info, warning, error or critical)")
        if self.api_key is not None and not self.api_key:
            problems.append("api_key is empty (omit it to serve without a key)")
        if self.embedding_pooling not in ("last", "mean"):
            problems.append(f"embedding_pooling={self.embedding_pooling!r} (expected last or mean)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            problems.append(f"tool_call_parser={self.tool_call_parser!r} (expected one of "
                            f"{', '.join(TOOL_CALL_PARSERS)})")
        if problems:
            raise ValueError("invalid server options: " + "; ".join(problems))
