"""`ServerConfig`: the HTTP side of `scratchlm serve` (the engine has its own `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        metadata={"help": "requests allowed to wait beyond the running batch (max-num-seqs); more get 429"},
    )
    max_n: int = field(default=16, metadata={"help": "largest `n` (completions per prompt) a request may ask"})
    max_prompts: int = field(default=64, metadata={"help": "largest number of prompts in one /v1/completions call"})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "request bodies above this get 413"})
    cors_origins: list[str] | None = field(
        default=None, metadata={"help": "origins allowed by CORS (e.g. '*'); CORS is off unless given"}
    )
    retry_after_s: int = field(default=1, metadata={"help": "Retry-After seconds sent with a 429"})
    log_level: str = field(default="info", metadata={"help": "logging level: debug, info, warning, error"})

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port={self.port} (expected 0..65535)")
        for name in ("max_queue", "max_n", "max_prompts", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) < (0 if name in ("max_queue", "retry_after_s") else 1):
                problems.append(f"{name}={getattr(self, name)} (expected a positive integer)")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            problems.append(f"log_level={self.log_level!r} (expected debug, info, warning, error or critical)")
        if self.api_key is not None and not self.api_key:
            problems.append("api_key is empty (omit it to serve without a key)")
        if problems:
            raise ValueError("invalid server options: " + "; ".join(problems))
