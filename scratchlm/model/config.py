"""`ModelConfig`: everything needed to rebuild a `TransformerLM`; stored inside every checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU hidden size: about 8/3 * d_model, rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only Llama-style transformer LM.

    `n_kv_heads`, `d_ff` and `head_dim` may be left as None and are then derived
    (n_heads, ~8/3 d_model rounded to 64, d_model // n_heads).
    """

    vocab_size: int = field(default=10_000, metadata={"help": "number of token ids (rows of the embedding)"})
    d_model: int = field(default=256, metadata={"help": "width of the residual stream"})
    n_layers: int = field(default=4, metadata={"help": "number of transformer blocks"})
    n_heads: int = field(default=8, metadata={"help": "number of query heads"})
    n_kv_heads: int | None = field(
        default=None, metadata={"help": "number of key/value heads (grouped-query attention); None = n_heads"}
    )
    d_ff: int | None = field(
        default=None, metadata={"help": "SwiGLU hidden size; None = 8/3 d_model rounded up to a multiple of 64"}
    )
    max_seq_len: int = field(default=256, metadata={"help": "longest context the model is meant for"})
    rope_theta: float = field(default=10_000.0, metadata={"help": "RoPE base frequency"})
    norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon"})
    rope_layout: Literal["half", "adjacent", "none"] = field(
        default="half",
        metadata={"help": "RoPE pair layout: 'half' = HF rotate-half, 'adjacent' = llama2.c/CS336 (x0,x1),(x2,x3)..; "
                          "'none' = no position embedding (NoPE)"},
    )
    tie_embeddings: bool = field(default=True, metadata={"help": "output head shares the token embedding matrix"})
    qkv_bias: bool = field(default=False, metadata={"help": "add biases to the q/k/v projections (Qwen2)"})
    head_dim: int | None = field(default=None, metadata={"help": "width of one head; None = d_model // n_heads"})

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = default_d_ff(self.d_model)
        if self.head_dim is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise ValueError(
                    f"ModelConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly or change one of them"
                )
            self.head_dim = self.d_model // self.n_heads
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming every inconsistent field."""
        problems = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive int")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if not problems and self.head_dim % 2 and self.rope_layout != "none":
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_layout not in ("half", "adjacent", "none"):
            problems.append(f"rope_layout={self.rope_layout!r} must be 'half', 'adjacent' or 'none'")
        if not (self.rope_theta > 0):
            problems.append(f"rope_theta={self.rope_theta!r} must be > 0")
        if not (self.norm_eps > 0):
            problems.append(f"norm_eps={self.norm_eps!r} must be > 0")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @classmethod
    def cs336(cls, vocab_size: int = 10_000, context_length: int = 256, d_model: int = 512, num_layers: int = 4,
              num_heads: int = 16, d_ff: int = 1344, rope_theta: float = 10_000.0, **overrides: Any) -> ModelConfig:
        """The architecture of CS336 assignment 1's `TransformerLM`, with its argument names (defaults: the
        assignment's TinyStories model). What differs from this class's own defaults: RoPE rotates adjacent
        pairs (`rope_layout="adjacent"`), the output head is a separate `lm_head` (`tie_embeddings=False`),
        `d_ff` is given rather than derived, and there are as many kv heads as query heads. `overrides` set
        any other field, e.g. `rope_layout="none"` for the NoPE ablation."""
        fields = dict(vocab_size=vocab_size, max_seq_len=context_length, d_model=d_model, n_layers=num_layers,
                      n_heads=num_heads, n_kv_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta, norm_eps=1e-5,
                      rope_layout="adjacent", tie_embeddings=False, qkv_bias=False)
        return cls(**(fields | overrides))

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/pickle-safe) that `from_dict` turns back into this config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild from `to_dict()` output; unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; expected some of {sorted(names)}")
        return cls(**data)

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds."""
        d, hd, h, kv = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads
        attn = d * hd * h * 2 + d * hd * kv * 2 + (hd * (h + 2 * kv) if self.qkv_bias else 0)
        block = attn + 3 * d * self.d_ff + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul weights, plus 12*L*H*D*T for attention
        scores and values (PaLM, appendix B). The embedding lookup is not a matmul; the head always is."""
        t = seq_len or self.max_seq_len
        d, hd = self.d_model, self.head_dim
        per_layer = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * d * self.d_ff
        n_matmul = self.n_layers * per_layer + self.vocab_size * d
        return 6 * n_matmul + 12 * self.n_layers * self.n_heads * hd * t
