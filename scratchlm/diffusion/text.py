"""The text encoder: a small bidirectional transformer over scratchlm's byte-level BPE tokens.

Prompts are tokenized by `scratchlm.tokenizer.Tokenizer`, padded (or cut) to `max_len` with the pad
token, embedded (token + learned position), run through pre-norm blocks (RMSNorm, full attention,
SwiGLU: the project's layers) and a final RMSNorm; the denoiser cross-attends to all `max_len` output
tokens. The empty prompt (all padding) is the unconditional input of classifier-free guidance.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from scratchlm.diffusion.layers import attention
from scratchlm.model.layers import Embedding, Linear, RMSNorm, SwiGLU
from scratchlm.tokenizer import Tokenizer, tokenizer_from_state, tokenizer_to_state, train_bpe

PAD = "<|pad|>"


@dataclass
class TextEncoderConfig:
    vocab_size: int = field(default=512, metadata={"help": "BPE vocabulary size (with the pad token)"})
    d_model: int = field(default=128, metadata={"help": "width (= the DiT's cross_attention_dim)"})
    n_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    n_heads: int = field(default=4, metadata={"help": "attention heads"})
    d_ff: int = field(default=256, metadata={"help": "SwiGLU hidden width"})
    max_len: int = field(default=12, metadata={"help": "prompt tokens (padded / truncated)"})


class _Block(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = Linear(d, 3 * d)
        self.out = Linear(d, d)
        self.ff = SwiGLU(d, cfg.d_ff)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)  # (B, T, H, D)
        x = x + self.out(attention(q, k, v).reshape(b, t, d))
        return x + self.ff(self.norm2(x))


class TextEncoder(nn.Module):
    """ids (B, max_len) -> token features (B, max_len, d_model)."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model, std=0.02)
        self.pos_emb = Embedding(cfg.max_len, cfg.d_model, std=0.02)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok_emb(ids) + self.pos_emb.weight[: ids.shape[1]][None]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"_class_name": "scratchlm.TextEncoder", **asdict(self.config)}))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TextEncoder:
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("_class_name", None)
        model = cls(TextEncoderConfig(**cfg))
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        return model


class PromptTokenizer:
    """BPE ids padded to a fixed length; the pad id also fills the empty (unconditional) prompt."""

    def __init__(self, tok: Tokenizer, max_len: int):
        self.tok, self.max_len = tok, max_len
        self.pad_id = tok.encode(PAD)[0]

    @classmethod
    def train(cls, corpus: list[str], vocab_size: int, max_len: int) -> PromptTokenizer:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "prompts.txt"
            p.write_text("\n".join(corpus))
            vocab, merges = train_bpe(p, vocab_size, [PAD], progress=False, num_workers=1)
        return cls(Tokenizer(vocab, merges, special_tokens=[PAD]), max_len)

    def __call__(self, prompts: list[str]) -> Tensor:
        rows = []
        for p in prompts:
            ids = self.tok.encode(p.strip().lower())[: self.max_len]
            rows.append(ids + [self.pad_id] * (self.max_len - len(ids)))
        return torch.tensor(rows, dtype=torch.long)  # (B, max_len)

    @property
    def vocab_size(self) -> int:
        return self.tok.vocab_size

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"tokenizer": tokenizer_to_state(self.tok), "max_len": self.max_len}, path / "tokenizer.pt")

    @classmethod
    def load(cls, path: str | Path) -> PromptTokenizer:
        from scratchlm.model.loading.checkpoint import load_torch_file

        d = load_torch_file(Path(path) / "tokenizer.pt", "diffusion tokenizer")  # weights-only, errors name the file
        return cls(tokenizer_from_state(d["tokenizer"]), d["max_len"])
