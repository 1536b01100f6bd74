"""A model's tokenizer when its checkpoint has none, or when the user names another (``--tokenizer PATH``).

Policy: the tokenizer the checkpoint carries is used unless an explicit one is given. A model left with no
tokenizer still loads (token-id prompts work), but the load says so *once, at load time*, naming where it
looked and how to supply one; text prompts are then refused with :data:`NO_TOKENIZER` instead of failing
deep inside the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scratchlm.model.loading.common import CheckpointError, log

NO_TOKENIZER = ("this model has no tokenizer, so it cannot encode text: send the prompt as a list of token ids, "
                "or load the model with a tokenizer (--tokenizer PATH, EngineConfig(tokenizer=PATH))")


def where_tokenizer_looked(path: str | Path, vocab_size: int | None = None) -> str:
    """Where the loader of the model at `path` looks for a tokenizer, in words (for error messages)."""
    path = Path(path)
    if path.is_dir():
        return f"{path / 'tokenizer.json'}"
    if path.suffix == ".gguf":
        return f"the tokenizer.ggml.* metadata of {path}"
    if path.suffix == ".bin":
        names = ([f"tok{vocab_size}.bin"] if vocab_size else []) + ["tokenizer.bin"]
        return " or ".join(str(path.parent / n) for n in names)
    return f"the 'tokenizer' entry of the checkpoint {path}"


def load_tokenizer(path: str | Path) -> Any:
    """A tokenizer from `path`: a folder (tokenizer.json, vocab.json + merges.txt, encoder.json + vocab.bpe),
    a tokenizer.json, a .gguf, a llama2.c tok*.bin, or a scratchlm .pt checkpoint that stores one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path} (expected a folder with tokenizer.json, a "
                                "tokenizer.json, a .gguf, a llama2.c tok*.bin or a scratchlm .pt checkpoint)")
    if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt"):
        from scratchlm.model.loading.checkpoint import read_checkpoint
        from scratchlm.tokenizer import tokenizer_from_state

        state = read_checkpoint(path).get("tokenizer")
        if state is None:
            raise CheckpointError(f"{path}: the checkpoint stores no tokenizer")
        return tokenizer_from_state(state)
    from scratchlm.tokenizer.formats import load_tokenizer as load_files

    return load_files(path)


def attach_tokenizer(tokenizer: Any, model_path: str | Path, vocab_size: int, override: str | Path | None = None
                     ) -> Any:
    """The tokenizer to serve `model_path` with: `override` if given (checked against the vocabulary), else
    `tokenizer`; None (with a warning naming where the loader looked) when there is none."""
    if override is not None:
        tok = load_tokenizer(override)
        n = getattr(tok, "vocab_size", None)
        if n is not None and n > vocab_size:
            raise ValueError(f"tokenizer {override} has {n} ids but the model {model_path} has a vocabulary of "
                             f"{vocab_size}: it is not this model's tokenizer")
        log.info("tokenizer: %s", override)
        return tok
    if tokenizer is None:
        log.warning("no tokenizer found for %s (looked for %s): text prompts will be refused; pass --tokenizer "
                    "PATH (or EngineConfig(tokenizer=PATH)) to supply one, or send token ids", model_path,
                    where_tokenizer_looked(model_path, vocab_size))
    return tokenizer
