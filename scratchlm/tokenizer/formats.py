"""Tokenizer file formats: GPT-2 / CS336 files, HF ``tokenizer.json`` directories, GGUF vocabularies.

Byte-level BPE files store tokens as printable strings through GPT-2's byte-to-unicode table
(byte 0x20 -> 'Ġ', ...). Special / added tokens are stored as their raw text.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from scratchlm import atomic
from scratchlm.tokenizer.bpe import Tokenizer
from scratchlm.tokenizer.gguf_meta import read_gguf_metadata
from scratchlm.tokenizer.normalize import normalizer_from_hf
from scratchlm.tokenizer.pipeline import AddedToken
from scratchlm.tokenizer.pretokenize import DIGITS_PATTERN, GPT2_PATTERN, PRESETS, PreTokenizer
from scratchlm.tokenizer.spm import SentencePieceBPE


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_str(token: bytes) -> str:
    """Token bytes -> GPT-2 printable string."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def str_to_token(s: str, where: str = "") -> bytes:
    """GPT-2 printable string -> token bytes (clear error on a character outside the table)."""
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in s)
    except KeyError as e:
        raise ValueError(
            f"{where}token {s!r} has character {e.args[0]!r} outside GPT-2's byte-to-unicode table "
            "(is this a byte-level BPE file?)"
        ) from None


def _atomic_write_text(path: Path, text: str) -> None:
    """Atomic, with the usual permissions (0666 minus the umask, not mkstemp's 0600)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)


def _read_json(path: Path, what: str):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({what}): {e}") from e


# ---------------------------------------------------------------------------- GPT-2 / CS336 files
def read_vocab_merges(vocab_path: str | Path, merges_path: str | Path) -> tuple[dict[int, bytes], list]:
    """Read ``encoder.json``/``vocab.json`` (token string -> id) and ``vocab.bpe``/``merges.txt``."""
    encoder = _read_json(Path(vocab_path), "vocabulary JSON (token -> id)")
    if not isinstance(encoder, dict):
        raise ValueError(f"{vocab_path}: expected a JSON object mapping token strings to ids")
    vocab: dict[int, bytes] = {}
    for s, i in encoder.items():
        if not isinstance(i, int):
            raise ValueError(f"{vocab_path}: id of token {s!r} is {i!r}, expected an integer")
        try:
            vocab[i] = str_to_token(s)
        except ValueError:
            vocab[i] = s.encode("utf-8")  # an added/special token stored as raw text
    merges_path = Path(merges_path)
    if not merges_path.is_file():
        raise FileNotFoundError(f"merges file not found: {merges_path}")
    merges = []
    with open(merges_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{merges_path}:{lineno}: expected 'left right', got {line!r}")
            merges.append((str_to_token(parts[0], f"{merges_path}:{lineno}: "),
                           str_to_token(parts[1], f"{merges_path}:{lineno}: ")))
    return vocab, merges


def load_gpt2_files(encoder_json: str | Path, vocab_bpe: str | Path, special_tokens: list[str] | None = None
                    ) -> Tokenizer:
    """GPT-2's ``encoder.json`` + ``vocab.bpe``. Special tokens default to ``<|endoftext|>`` when the
    vocabulary has it (as tiktoken's ``gpt2`` encoding); it is also BOS and EOS."""
    vocab, merges = read_vocab_merges(encoder_json, vocab_bpe)
    eot = b"<|endoftext|>"
    eot_id = next((i for i, b in vocab.items() if b == eot), None)
    if special_tokens is None:
        special_tokens = ["<|endoftext|>"] if eot_id is not None else []
    return Tokenizer(vocab, merges, special_tokens, bos_id=eot_id, eos_id=eot_id)


def save_vocab_merges(tok: Tokenizer, vocab_path: str | Path, merges_path: str | Path) -> None:
    """Write ``vocab.json``/``encoder.json`` and ``merges.txt``/``vocab.bpe`` (atomically)."""
    encoder = {token_to_str(b): i for i, b in sorted(tok.vocab.items())}
    if len(encoder) != len(tok.vocab):
        raise ValueError("the vocabulary has duplicate token bytes; it cannot be written as token -> id JSON")
    _atomic_write_text(Path(vocab_path), json.dumps(encoder, ensure_ascii=False))
    lines = ["#version: 0.2"] + [f"{token_to_str(a)} {token_to_str(b)}" for a, b in tok.merges]
    _atomic_write_text(Path(merges_path), "\n".join(lines) + "\n")


def save_gpt2_files(tok: Tokenizer, directory: str | Path) -> None:
    """GPT-2 layout: ``encoder.json`` + ``vocab.bpe``."""
    save_vocab_merges(tok, Path(directory) / "encoder.json", Path(directory) / "vocab.bpe")


def save_cs336_files(tok: Tokenizer, directory: str | Path) -> None:
    """CS336 layout: ``vocab.json`` + ``merges.txt`` (same encoding as GPT-2's files)."""
    save_vocab_merges(tok, Path(directory) / "vocab.json", Path(directory) / "merges.txt")


# ---------------------------------------------------------------------------- HF tokenizer.json
def _pretokenizer_to_hf(pre: PreTokenizer) -> dict:
    if pre.stages == (GPT2_PATTERN,):
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    steps = []
    for stage in pre.stages:
        if stage == DIGITS_PATTERN:
            steps.append({"type": "Digits", "individual_digits": True})
        else:
            steps.append({"type": "Split", "pattern": {"Regex": stage}, "behavior": "Isolated", "invert": False})
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
    return {"type": "Sequence", "pretokenizers": steps}


def _pretokenizer_from_hf(spec: dict | None, where: str) -> PreTokenizer:
    stages: list[str] = []
    byte_level = False

    def walk(node: dict) -> None:
        nonlocal byte_level
        kind = node.get("type")
        if kind == "Sequence":
            for child in node.get("pretokenizers", []):
                walk(child)
        elif kind == "ByteLevel":
            if node.get("add_prefix_space"):
                raise ValueError(f"{where}: ByteLevel add_prefix_space=true is not supported")
            byte_level = True
            if node.get("use_regex", True):
                stages.append(GPT2_PATTERN)
        elif kind == "Digits":
            stages.append(DIGITS_PATTERN if node.get("individual_digits") else r"\p{N}+")
        elif kind == "Split":
            if node.get("behavior") != "Isolated" or node.get("invert"):
                raise ValueError(f"{where}: only Split with behavior=Isolated, invert=false is supported, got {node}")
            pattern = node.get("pattern", {})
            if "Regex" in pattern:
                stages.append(pattern["Regex"])
            elif "String" in pattern:
                import regex

                stages.append(regex.escape(pattern["String"]))
            else:
                raise ValueError(f"{where}: Split pattern {pattern!r} not understood")
        else:
            raise ValueError(
                f"{where}: pre-tokenizer {kind!r} is not supported (expected ByteLevel, Digits, Split, Sequence)"
            )

    if spec is None:
        raise ValueError(f"{where}: no pre_tokenizer; only byte-level BPE tokenizers are supported")
    walk(spec)
    if not byte_level:
        raise ValueError(f"{where}: not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer)")
    if not stages:
        raise ValueError(f"{where}: the pre-tokenizer has no regex stage")
    return PreTokenizer(tuple(stages))


def _template_processing(tok) -> dict | None:
    """An HF TemplateProcessing that adds BOS / EOS around a sequence as `tok.add_bos` / `add_eos` say."""
    ends = [(getattr(tok, "add_bos", False), tok.bos_id), (getattr(tok, "add_eos", False), tok.eos_id)]
    first, last = [(tok.decode([i]), i) if add and i is not None else None for add, i in ends]
    if first is None and last is None:
        return None

    def template(*seqs: str) -> list[dict]:
        out = []
        for seq in seqs:
            out += [{"SpecialToken": {"id": first[0], "type_id": 0}}] if first else []
            out += [{"Sequence": {"id": seq, "type_id": 0}}]
            out += [{"SpecialToken": {"id": last[0], "type_id": 0}}] if last else []
        return out
    return {"type": "TemplateProcessing", "single": template("A"), "pair": template("A", "B"),
            "special_tokens": {c: {"id": c, "ids": [i], "tokens": [c]} for c, i in filter(None, (first, last))}}


def _spm_tokenizer_json(tok: SentencePieceBPE) -> dict:
    vocab = {p: i for i, p in sorted(tok.pieces.items(), reverse=True)}
    if len(vocab) != len(tok.pieces):
        raise ValueError("the vocabulary has duplicate token strings; it cannot be written as tokenizer.json")
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [t.to_hf() for t in tok.added_tokens],
        "normalizer": tok.normalizer.spec if tok.normalizer else None,
        "pre_tokenizer": tok.pre_tokenizer.spec, "post_processor": _template_processing(tok),
        "decoder": tok.decoder.spec,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None if tok.unk_id is None else tok.pieces[tok.unk_id],
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": tok.fuse_unk,
            "byte_fallback": tok.byte_fallback, "ignore_merges": tok.ignore_merges,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": [[a, b] for a, b in tok.hf_merges()],
        },
    }


def save_hf_tokenizer_json(tok: Tokenizer | SentencePieceBPE, path: str | Path) -> None:
    """Write an HF ``tokenizer.json`` that ``tokenizers.Tokenizer.from_file`` loads and that encodes
    identically (special tokens become special added tokens). A SentencePiece BPE from GGUF scores gets
    HF's converter's merges (every split of a token, by score)."""
    if isinstance(tok, SentencePieceBPE):
        _atomic_write_text(Path(path), json.dumps(_spm_tokenizer_json(tok), ensure_ascii=False))
        return
    # HF takes an added token's id from the model vocab when its content is there (else it appends
    # a new id), so special tokens go into the vocab too, under their raw text.
    specials = {i: s for s, i in tok.special_ids.items()}
    vocab = {specials[i] if i in specials else token_to_str(b): i for i, b in sorted(tok.vocab.items())}
    if len(vocab) != len(tok.vocab):
        raise ValueError("the vocabulary has duplicate token strings; it cannot be written as tokenizer.json")
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s, i in sorted(tok.special_ids.items(), key=lambda kv: kv[1])
    ]
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": tok.normalizer.spec if tok.normalizer is not None else None,
        "pre_tokenizer": _pretokenizer_to_hf(tok.pretokenizer),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": tok.ignore_merges,
            "vocab": vocab,
            "merges": [[token_to_str(a), token_to_str(b)] for a, b in tok.merges],
        },
    }
    _atomic_write_text(Path(path), json.dumps(data, ensure_ascii=False))


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _has_type(node, kind: str, children: str) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "Sequence":
        return any(_has_type(c, kind, children) for c in node.get(children, []))
    return node.get("type") == kind


def _chat_template(config: dict, directory: Path) -> str | None:
    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # named templates: take "default"
        chat_template = next((t.get("template") for t in chat_template if t.get("name") == "default"), None)
    if chat_template is None and (directory / "chat_template.jinja").is_file():
        chat_template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return chat_template


def _hf_metadata(data: dict, config: dict, directory: Path, find) -> dict:
    """bos/eos ids, add_bos/add_eos and chat template from ``tokenizer_config.json`` (else from the
    post-processor's template). `find`: token content -> id or None."""
    post = data.get("post_processor") or {}

    def token(name: str, fallback: int | None) -> int | None:
        content = _token_content(config.get(name))
        return fallback if content is None else find(content)

    first, last = _template_ends(post)
    bos_id, eos_id = token("bos_token", first), token("eos_token", None)
    add_bos = bool(config["add_bos_token"]) if "add_bos_token" in config else first is not None and first == bos_id
    add_eos = bool(config["add_eos_token"]) if "add_eos_token" in config else last is not None and last == eos_id
    return {"bos_id": bos_id, "eos_id": eos_id, "add_bos": add_bos and bos_id is not None,
            "add_eos": add_eos and eos_id is not None,
            "chat_template": _chat_template(config, directory)}


def load_hf_dir(path: str | Path) -> Tokenizer | SentencePieceBPE:
    """An HF ``tokenizer.json`` (+ optional ``tokenizer_config.json``: chat_template, bos/eos tokens,
    add_bos_token) as saved by ``transformers``; `path` may also be the JSON file.

    A byte-level BPE (a ``ByteLevel`` pre-tokenizer: GPT-2, Llama 3, Qwen2, OLMo-2, SmolLM2) loads as a
    :class:`Tokenizer`; any other BPE (byte fallback, ``Metaspace`` or a ``Prepend``/``Replace``
    normalizer: Llama 2, Mistral, Phi-3, Gemma) as a :class:`SentencePieceBPE`. Other models (Unigram,
    WordPiece) and unimplemented normalizers / pre-tokenizers / decoders raise ValueError."""
    path = Path(path)
    directory = path.parent if path.is_file() else path
    tj_path = path if path.is_file() else path / "tokenizer.json"
    data = _read_json(tj_path, "HF tokenizer.json")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{tj_path}: model type {model.get('type')!r} is not supported (only BPE: byte-level or "
                         "SentencePiece-style)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError(f"{tj_path}: BPE options continuing_subword_prefix/end_of_word_suffix are not supported")
    if model.get("dropout"):
        raise ValueError(f"{tj_path}: BPE dropout {model['dropout']} is not supported (it makes encoding random)")
    config = {}
    if (directory / "tokenizer_config.json").is_file():
        config = _read_json(directory / "tokenizer_config.json", "tokenizer_config.json")
    byte_level = _has_type(data.get("pre_tokenizer"), "ByteLevel", "pretokenizers")
    if byte_level and model.get("byte_fallback"):
        raise ValueError(f"{tj_path}: a ByteLevel pre-tokenizer with byte_fallback is not supported")
    if not byte_level:
        return _load_hf_spm(data, model, config, directory, tj_path)
    normalizer = normalizer_from_hf(data.get("normalizer"), f"{tj_path}: normalizer")
    pre = _pretokenizer_from_hf(data.get("pre_tokenizer"), str(tj_path))
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab: dict[int, bytes] = {}
    for s, i in model.get("vocab", {}).items():
        vocab[i] = s.encode("utf-8") if s in added else str_to_token(s, f"{tj_path}: ")
    for s, i in added.items():
        vocab[i] = s.encode("utf-8")
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ") if isinstance(m, str) else m
        merges.append((str_to_token(a, f"{tj_path}: merge "), str_to_token(b, f"{tj_path}: merge ")))
    token_ids = {b: i for i, b in vocab.items()}
    meta = _hf_metadata(data, config, directory, lambda content: token_ids.get(content.encode("utf-8")))
    del meta["add_eos"]
    return Tokenizer(vocab, merges, list(added), pretokenizer=pre, ignore_merges=bool(model.get("ignore_merges")),
                     normalizer=normalizer, **meta)


def _load_hf_spm(data: dict, model: dict, config: dict, directory: Path, tj_path: Path) -> SentencePieceBPE:
    """A SentencePiece-style BPE ``tokenizer.json`` (Llama 2, Mistral, Phi-3, Gemma)."""
    pieces = {int(i): s for s, i in model.get("vocab", {}).items()}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    added = [AddedToken.from_hf(t) for t in data.get("added_tokens", [])]
    lookup = {s: i for i, s in sorted(pieces.items(), reverse=True)} | {t.content: t.id for t in added}
    unk = model.get("unk_token")
    if unk is not None and unk not in lookup:
        raise ValueError(f"{tj_path}: unk_token {unk!r} is not in the vocab")
    meta = _hf_metadata(data, config, directory, lookup.get)
    return SentencePieceBPE(
        pieces, merges, added_tokens=added, unk_id=None if unk is None else lookup[unk],
        byte_fallback=bool(model.get("byte_fallback")), fuse_unk=bool(model.get("fuse_unk")),
        ignore_merges=bool(model.get("ignore_merges")), normalizer=data.get("normalizer"),
        pre_tokenizer=data.get("pre_tokenizer"), decoder=data.get("decoder"), where=str(tj_path), **meta,
    )


def _template_ends(post: dict) -> tuple[int | None, int | None]:
    """The ids of the special tokens an HF TemplateProcessing puts first / last around a single sequence."""
    nodes = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for node in nodes:
        if node.get("type") == "TemplateProcessing":
            single, specials = node.get("single") or [], node.get("special_tokens", {})
            ids = [(specials.get(item.get("SpecialToken", {}).get("id")) or {}).get("ids") or [None]
                   for item in single]
            if not single:
                return None, None
            return ids[0][0], ids[-1][0] if len(single) > 1 else None
    return None, None


# ---------------------------------------------------------------------------- GGUF
_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_UNUSED, _GGUF_BYTE = 1, 2, 3, 4, 5, 6


def from_gguf(path: str | Path, metadata: dict | None = None) -> Tokenizer | SentencePieceBPE:
    """The tokenizer stored in a GGUF file's metadata. ``tokenizer.ggml.model = gpt2``: byte-level BPE
    (tokens, merges, control/user-defined tokens as special tokens, the pre-tokenizer named by
    ``tokenizer.ggml.pre``: gpt2, smollm, llama-bpe, qwen2, ...). ``llama``: a SentencePiece vocabulary
    (tokens, scores, token types) encoded as llama.cpp does, merges by score (see
    :mod:`scratchlm.tokenizer.spm`). Both carry bos/eos ids, add_bos and the chat template.
    `metadata`: the file's already-parsed metadata (the model loader passes it, to read the header once)."""
    meta = read_gguf_metadata(path) if metadata is None else metadata
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens", [])
    if model not in ("gpt2", "llama"):
        raise ValueError(f"{path}: tokenizer.ggml.model is {model!r}; supported: 'gpt2' (byte-level BPE) and "
                         "'llama' (SentencePiece BPE)")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the metadata")
    types = meta.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    if model == "llama":
        return _gguf_spm(path, meta, tokens, types)
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRESETS:
        raise ValueError(f"{path}: pre-tokenizer {pre_name!r} is not supported; known: {sorted(PRESETS)}")
    vocab: dict[int, bytes] = {}
    specials: list[str] = []
    for i, (s, t) in enumerate(zip(tokens, types)):
        if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED):
            vocab[i] = s.encode("utf-8")
            specials.append(s)
        else:
            vocab[i] = str_to_token(s, f"{path}: ")
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        a, b = m.split(" ")
        merges.append((str_to_token(a, f"{path}: merge "), str_to_token(b, f"{path}: merge ")))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        vocab, merges, specials, pretokenizer=PreTokenizer(PRESETS[pre_name]),
        bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def _gguf_spm(path, meta: dict, tokens: list[str], types: list[int]) -> SentencePieceBPE:
    """llama.cpp's SPM vocabulary: control, user-defined and unknown tokens are split out of the text first;
    a space is prefixed to the text after each of them (``add_space_prefix``, default true), spaces become
    "▁"; characters outside the vocabulary fall back to ``<0xNN>`` byte tokens."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ValueError(f"{path}: {len(scores)} scores for {len(tokens)} tokens")
    added = [AddedToken(s, i, special=t != _GGUF_USER_DEFINED)
             for i, (s, t) in enumerate(zip(tokens, types)) if t in (_GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == _GGUF_UNKNOWN), None)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]
                  } if space_prefix else replace
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.get(key, default)
        return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

    return SentencePieceBPE(
        list(tokens), None, [float(x) for x in scores], added_tokens=added, unk_id=unk,
        byte_fallback=_GGUF_BYTE in types, normalizer=normalizer, decoder={"type": "Sequence", "decoders": decoders},
        bos_id=token_id("tokenizer.ggml.bos_token_id", 1), eos_id=token_id("tokenizer.ggml.eos_token_id", 2),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"), where=str(path),
    )


# ---------------------------------------------------------------------------- any of the above
def load_tokenizer(path: str | Path):
    """Load a tokenizer from whatever `path` is: a directory with ``tokenizer.json`` (HF, also what
    ``scratchlm tokenizer train`` writes), ``vocab.json`` + ``merges.txt`` (CS336), ``encoder.json`` +
    ``vocab.bpe`` (GPT-2); a ``.gguf`` file; a llama2.c tokenizer ``.bin``."""
    from scratchlm.tokenizer.llama2c import Llama2cTokenizer

    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return load_hf_dir(path)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return Tokenizer.from_files(path / "vocab.json", path / "merges.txt")
        if (path / "encoder.json").is_file() and (path / "vocab.bpe").is_file():
            return load_gpt2_files(path / "encoder.json", path / "vocab.bpe")
        raise FileNotFoundError(
            f"{path}: no tokenizer found (expected tokenizer.json, vocab.json + merges.txt, "
            "or encoder.json + vocab.bpe)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if path.suffix == ".gguf":
        return from_gguf(path)
    if path.name == "tokenizer.json":
        return load_hf_dir(path)
    if path.suffix == ".bin":
        return Llama2cTokenizer.from_file(path)
    raise ValueError(f"{path}: unknown tokenizer file type (expected a directory, .gguf, tokenizer.json or "
                     "a llama2.c .bin)")
