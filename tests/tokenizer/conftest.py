"""Shared oracles for the tokenizer tests: GPT-2 files, tiktoken built offline from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from scratchlm.tokenizer.pretokenize import GPT2_PATTERN


@pytest.fixture(scope="session")
def gpt2_dir(data_dir: Path) -> Path:
    return data_dir / "tokenizers" / "gpt2"


@pytest.fixture(scope="session")
def gpt2_tok(gpt2_dir: Path):
    from scratchlm.tokenizer.formats import load_gpt2_files

    return load_gpt2_files(gpt2_dir / "encoder.json", gpt2_dir / "vocab.bpe")


@pytest.fixture(scope="session")
def tiktoken_gpt2(gpt2_dir: Path):
    """tiktoken's `gpt2` encoding, built offline from the same two files."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(str(gpt2_dir / "vocab.bpe"), str(gpt2_dir / "encoder.json"))
    return tiktoken.Encoding("gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def corpus_files(data_dir: Path) -> list[Path]:
    """Every text corpus under data/corpora (Gutenberg books included)."""
    return sorted((data_dir / "corpora").rglob("*.txt"))


def sample_text(path: Path, n_bytes: int = 20_000, n_pieces: int = 3) -> str:
    """A few slices of a file (start, middle, end), cut on UTF-8 boundaries."""
    data = path.read_bytes()
    if len(data) <= n_bytes * n_pieces:
        return data.decode("utf-8", errors="replace")
    step = (len(data) - n_bytes) // (n_pieces - 1)
    parts = [data[i * step : i * step + n_bytes].decode("utf-8", errors="ignore") for i in range(n_pieces)]
    return "\n".join(parts)
