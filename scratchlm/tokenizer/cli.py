"""`scratchlm tokenizer train|encode`: train a byte-level BPE on your text, or encode a corpus to ids.

    scratchlm tokenizer train --input data.txt --vocab-size 10000 --special-token '<|endoftext|>' --out tok/
    scratchlm tokenizer encode --tokenizer tok/ --input data.txt --out data.bin
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from scratchlm.config import add_dataclass_arguments, dataclass_from_args, load_config

log = logging.getLogger("scratchlm.tokenizer")


@dataclass
class TrainTokenizerConfig:
    """Options of `scratchlm tokenizer train`."""

    input: list[Path] = field(default_factory=list, metadata={"help": "text file(s) to learn from (UTF-8)"})
    vocab_size: int = field(default=10_000, metadata={
        "help": "final vocabulary size: 256 bytes + special tokens + merges"})
    special_token: list[str] = field(default_factory=list, metadata={
        "help": "special token(s), e.g. '<|endoftext|>'; they split the text and are never merged across"})
    out: Path | None = field(default=None, metadata={
        "help": "output directory: tokenizer.json (HF), vocab.json + merges.txt (CS336), encoder.json + vocab.bpe "
                "(GPT-2), tokenizer_config.json"})
    pretokenizer: str = field(default="gpt2", metadata={
        "help": "pre-tokenizer regex preset: gpt2, smollm, llama3, qwen2"})
    workers: int = field(default=0, metadata={"help": "processes for pre-tokenization (0 = all usable cores)"})
    chunk_mb: float = field(default=1.0, metadata={"help": "size of the chunks handed to each worker, in MB"})


@dataclass
class EncodeCorpusConfig:
    """Options of `scratchlm tokenizer encode`."""

    tokenizer: Path | None = field(default=None, metadata={
        "help": "tokenizer: a directory written by `tokenizer train` (or any HF tokenizer.json / CS336 / GPT-2 "
                "files directory) or a .gguf file"})
    input: list[Path] = field(default_factory=list, metadata={"help": "text file(s) to encode, concatenated in order"})
    out: Path | None = field(default=None, metadata={
        "help": "output token file NAME.bin (a NAME.bin.json sidecar is written next to it)"})
    workers: int = field(default=0, metadata={"help": "encoder processes (0 = all usable cores)"})
    block_mb: float = field(default=1.0, metadata={"help": "size of the blocks handed to each worker, in MB"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = sub.add_parser(
        "train", help="learn a byte-level BPE vocabulary from text files",
        description="Train a byte-level BPE (GPT-2 regex pre-tokenization, ties to the lexicographically greater "
                    "pair) and write it as HF tokenizer.json, CS336 vocab.json + merges.txt and GPT-2 "
                    "encoder.json + vocab.bpe.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--config", type=Path, help="TOML/JSON file with these options (flags override it)")
    add_dataclass_arguments(train, TrainTokenizerConfig)
    encode = sub.add_parser(
        "encode", help="turn a text corpus into a flat uint16/uint32 token file for training",
        description="Encode text files with a tokenizer, in parallel, into NAME.bin (flat token ids, uint16 when "
                    "the vocabulary fits, else uint32) plus NAME.bin.json (dtype, count, vocab_size, tokenizer, "
                    "source, bytes), the input of `scratchlm train`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    encode.add_argument("--config", type=Path, help="TOML/JSON file with these options (flags override it)")
    add_dataclass_arguments(encode, EncodeCorpusConfig)


def _config(cls, args):
    base = load_config(cls, args.config) if getattr(args, "config", None) else cls()
    return dataclass_from_args(cls, args, base=base)


def _fail(message: str) -> int:
    log.error("error: %s", message)
    return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.tokenizer_command == "train":
            return _train(_config(TrainTokenizerConfig, args))
        return _encode(_config(EncodeCorpusConfig, args))
    except (FileNotFoundError, ValueError, TypeError) as e:
        return _fail(str(e))


def _train(cfg: TrainTokenizerConfig) -> int:
    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.formats import (
        _atomic_write_text,
        save_cs336_files,
        save_gpt2_files,
        save_hf_tokenizer_json,
    )
    from scratchlm.tokenizer.pretokenize import PreTokenizer
    from scratchlm.tokenizer.train import train_bpe

    if not cfg.input:
        return _fail("tokenizer train: --input FILE... is required")
    if cfg.out is None:
        return _fail("tokenizer train: --out DIR is required")
    pre = PreTokenizer.named(cfg.pretokenizer)
    t0 = time.perf_counter()
    vocab, merges = train_bpe(cfg.input, cfg.vocab_size, cfg.special_token, pretokenizer=pre,
                              num_workers=cfg.workers or None, chunk_bytes=int(cfg.chunk_mb * 1e6))
    eos = cfg.special_token[0] if cfg.special_token else None
    tok = Tokenizer(vocab, merges, cfg.special_token, pretokenizer=pre,
                    eos_id=None if eos is None else vocab_id(vocab, eos))
    out = Path(cfg.out)
    save_hf_tokenizer_json(tok, out / "tokenizer.json")
    save_cs336_files(tok, out)
    save_gpt2_files(tok, out)
    _atomic_write_text(out / "tokenizer_config.json", json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": None, "add_bos_token": False,
         "special_tokens": cfg.special_token, "pretokenizer": cfg.pretokenizer}, indent=2))
    log.info("trained %d merges (vocab %d) in %.1fs; wrote %s", len(merges), len(vocab),
             time.perf_counter() - t0, out)
    return 0


def vocab_id(vocab: dict[int, bytes], token: str) -> int:
    b = token.encode("utf-8")
    return next(i for i, v in vocab.items() if v == b)


def _encode(cfg: EncodeCorpusConfig) -> int:
    from scratchlm.tokenizer.encode_corpus import encode_corpus
    from scratchlm.tokenizer.formats import load_tokenizer

    if cfg.tokenizer is None:
        return _fail("tokenizer encode: --tokenizer DIR is required")
    if not cfg.input:
        return _fail("tokenizer encode: --input FILE... is required")
    if cfg.out is None:
        return _fail("tokenizer encode: --out FILE.bin is required")
    tok = load_tokenizer(cfg.tokenizer)
    t0 = time.perf_counter()
    meta = encode_corpus(tok, cfg.input, cfg.out, num_workers=cfg.workers or None,
                         block_bytes=int(cfg.block_mb * 1e6), tokenizer_name=str(cfg.tokenizer))
    dt = time.perf_counter() - t0
    log.info("%d tokens from %.1f MB in %.1fs (%.2f MB/s)", meta["count"], meta["bytes"] / 1e6, dt,
             meta["bytes"] / 1e6 / dt)
    return 0
