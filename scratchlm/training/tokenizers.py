"""The tokenizer of a run: loaded from what `scratchlm tokenizer train` wrote, stored in checkpoints.

Lives here (not in the tokenizer package) because only the trainer needs to guess a tokenizer's
format from a path; the format readers themselves are the tokenizer layer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path):
    """A tokenizer from `path`: a scratchlm checkpoint (.pt) holding one, or anything the tokenizer
    layer's `formats.load_tokenizer` reads (a folder written by `scratchlm tokenizer train`, an HF
    ``tokenizer.json`` folder, CS336 / GPT-2 files, a .gguf)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    import scratchlm.tokenizer as tk

    if path.suffix == ".pt":
        from scratchlm.training.checkpoint import read_checkpoint

        state = read_checkpoint(path, require=("tokenizer",))["tokenizer"]
        if state is None:
            raise ValueError(f"{path}: the checkpoint holds no tokenizer")
        return tk.tokenizer_from_state(state)
    from scratchlm.tokenizer.formats import load_tokenizer as load_files

    return load_files(path)


def tokenizer_state(tok) -> dict[str, Any]:
    """The checkpoint form of `tok` (contracts.md: `tokenizer_to_state`)."""
    from scratchlm.tokenizer import tokenizer_to_state

    return tokenizer_to_state(tok)


def save_run_tokenizer(tok, out_dir: str | Path) -> Path | None:
    """Write the run's byte-level BPE tokenizer to ``out_dir/tokenizer.json`` (so `--tokenizer RUN_DIR` works
    and the run folder does not depend on where the tokenizer was); None for other kinds (llama2.c), which
    live in the checkpoint only."""
    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.formats import save_hf_tokenizer_json

    if not isinstance(tok, Tokenizer):
        return None
    path = Path(out_dir) / "tokenizer.json"
    save_hf_tokenizer_json(tok, path)
    return path
