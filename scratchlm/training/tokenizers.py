"""The tokenizer of a run: loaded from what `scratchlm tokenizer train` wrote, stored in checkpoints.

Lives here (not in the tokenizer package) because only the trainer needs to guess a tokenizer's
format from a path; the format readers themselves are the tokenizer layer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path):
    """A tokenizer from `path`: a scratchlm checkpoint (.pt), an HF ``tokenizer.json`` (or a folder
    holding one), or the files of `scratchlm tokenizer train`. Clear error for anything else."""
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
    loader = getattr(tk, "load_tokenizer", None)
    if loader is not None:
        return loader(path)
    from scratchlm.tokenizer import formats

    if path.is_dir() and (path / "tokenizer.json").is_file():
        return formats.load_hf_dir(path)
    if path.name.endswith(".json"):
        return formats.load_hf_dir(path.parent)
    raise ValueError(f"{path}: not a tokenizer this trainer can read (expected a tokenizer.json or a folder "
                     "written by `scratchlm tokenizer train`)")


def tokenizer_state(tok) -> dict[str, Any]:
    """The checkpoint form of `tok` (contracts.md: `tokenizer_to_state`)."""
    from scratchlm.tokenizer import tokenizer_to_state

    return tokenizer_to_state(tok)
