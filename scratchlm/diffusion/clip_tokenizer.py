"""The CLIP tokenizer (Stable Diffusion's `tokenizer/` folder), written here; ids equal transformers' `CLIPTokenizer`.

Which one we match: transformers 5's `CLIPTokenizer` (the class diffusers' pipelines load from `model_index.json`)
*is* the tokenizers-backed one (`CLIPTokenizerFast` is the same class), so that is the oracle, exactly:

    text -> NFC -> every run of whitespace -> " " -> lower-case (per character: no final-sigma rule)
         -> pre-tokens: the regex  <|startoftext|> | <|endoftext|> | 's|'t|'re|'ve|'m|'ll|'d | \\p{L}+ | \\p{N} |
            [^\\s\\p{L}\\p{N}]+   (matches kept, whitespace between them dropped; each digit its own pre-token);
            transformers' ByteLevel step then re-splits every piece with GPT-2's regex, which leaves all of them
            whole but the two special-token strings: those become "<|", "endoftext", "|>"
         -> each pre-token's UTF-8 bytes through GPT-2's bytes-to-unicode table, `</w>` glued to its last symbol
         -> BPE by merge rank (lowest first, leftmost among equals; OpenAI's loop and tokenizers' heap agree)
         -> ids; <|startoftext|> + ids[:max_length - 2] + <|endoftext|>, padded with the folder's pad token.

"Whitespace" is Oniguruma's `\\s` (what tokenizers' Regex uses): U+0009-000D, U+0085 and the Zs / Zl / Zp
characters. (Python's `str.isspace` adds U+001C-001F; the `regex` module's `\\s` is Unicode White_Space: neither
is used.) The exact strings of the special tokens (bos, eos, unk, pad) in a prompt become those tokens: they are
split off before normalising, as transformers' added tokens are, so with SD 2's pad token "!" every "!" in a prompt
is the token "!" (id 0), not "!</w>"; other spellings ("<|EndOfText|>") are lower-cased and BPE-encoded as text.

transformers 4.x's *slow* `CLIPTokenizer` (gone in 5) without ftfy (its fallback: `BasicTokenizer(strip_accents=False,
do_split_on_punc=False)`, then the same regex and BPE) differs from this on: control and format characters (Cc / Cf
other than tab, newline, CR), NUL and U+FFFD, which it deletes (here U+000B / U+000C / U+0085 are whitespace and the
others punctuation-like pre-tokens); CJK ideographs, which it spaces apart (one pre-token each; here a run of them
is one `\\p{L}+` pre-token); `str.lower`'s final sigma; and "<|startoftext|>" / "<|endoftext|>" typed in another
case, which it maps to those tokens. On text without those the two agree. With ftfy installed the slow one also
rewrites mojibake and some punctuation first, which nothing here does.

BPE work is cached per pre-token (prompts repeat words), up to `CACHE_LIMIT` entries.

`train` learns a CLIP-format vocabulary (the 256 byte symbols, the same 256 with `</w>`, one token per merge, then
<|startoftext|>, <|endoftext|>) with `scratchlm.tokenizer`'s BPE trainer: for tests (no real CLIP vocab offline)
and for small recipes. Folders: `vocab.json`, `merges.txt` (`#version: 0.2` header), `special_tokens_map.json`,
`tokenizer_config.json` (`model_max_length`, `pad_token`: SD 1.x pads with <|endoftext|>, SD 2.x with "!");
a `tokenizer.json` alone is read too. A setting we do not implement (extra added tokens, `do_lower_case: false`,
another tokenizer class) is an error naming it.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex
import torch

from scratchlm import atomic
from scratchlm.tokenizer.formats import bytes_to_unicode, unicode_to_bytes

SOT, EOT, EOW = "<|startoftext|>", "<|endoftext|>", "</w>"
CACHE_LIMIT = 50_000

# Oniguruma's \s: \t \n \v \f \r, NEL, and the space / line / paragraph separators.
_WS = r"\t\n\x0b\x0c\r\x85\p{Zs}\p{Zl}\p{Zp}"
_WS_RUN = regex.compile(f"[{_WS}]+")
# CLIP's regex. transformers' ByteLevel step (use_regex) then re-splits every piece with GPT-2's regex, which leaves
# all of them whole except the two special-token strings: "<|endoftext|>" -> "<|", "endoftext", "|>" (_RESPLIT).
PATTERN = regex.compile(
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^" + _WS + r"\p{L}\p{N}]+")
_RESPLIT = {SOT: ["<|", "startoftext", "|>"], EOT: ["<|", "endoftext", "|>"]}
_SPECIAL = regex.compile(r"(<\|startoftext\|>|<\|endoftext\|>)")  # what `train` leaves out of its counts

# tokenizer_config.json keys: understood (read), or transformers bookkeeping (read past). Others are errors.
_CONFIG_KEYS = {"bos_token", "eos_token", "unk_token", "pad_token", "model_max_length", "do_lower_case",
                "tokenizer_class", "added_tokens_decoder", "add_prefix_space", "errors"}
_CONFIG_METADATA = {"name_or_path", "special_tokens_map_file", "clean_up_tokenization_spaces", "extra_special_tokens",
                    "model_input_names", "padding_side", "truncation_side", "backend", "processor_class",
                    "additional_special_tokens", "tokenizer_file", "use_fast", "is_local", "local_files_only"}


def normalize(text: str) -> str:
    """transformers' CLIP normalizer: NFC, whitespace runs -> one space, per-character lower-case."""
    text = _WS_RUN.sub(" ", unicodedata.normalize("NFC", text))
    if "\u03a3" in text:  # str.lower() would apply the final-sigma rule; tokenizers lower-cases char by char
        return "".join(c.lower() for c in text)
    return text.lower()


def pre_tokenize(normalized: str) -> list[str]:
    """The pre-tokens of normalized text (whitespace between them dropped)."""
    pieces = PATTERN.findall(normalized)
    if "<|" not in normalized:
        return pieces
    return [q for p in pieces for q in _RESPLIT.get(p, (p,))]


class CLIPTokenizer:
    """Text -> CLIP ids. `vocab`: token string -> id; `merges`: pairs of token strings, in rank order."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]], *, bos_token: str = SOT,
                 eos_token: str = EOT, unk_token: str = EOT, pad_token: str = EOT, model_max_length: int = 77):
        self.vocab = dict(vocab)
        self.merges = [tuple(m) for m in merges]
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        for name, token in self._tokens.items():
            if token not in self.vocab:
                raise ValueError(f"CLIPTokenizer: {name}={token!r} is not in the vocabulary")
        self.model_max_length = model_max_length
        # The special tokens' strings are cut out of the raw text first, as transformers' added tokens: with SD 2's
        # pad token "!", every "!" in a prompt becomes that token (id of "!", not of "!</w>"), as it does there.
        self.specials = sorted({bos_token, eos_token, unk_token, pad_token}, key=len, reverse=True)
        self._special_re = regex.compile("(" + "|".join(regex.escape(t) for t in self.specials) + ")")
        self.byte_encoder = bytes_to_unicode()
        self._cache: dict[str, list[int]] = {}

    # --- the special tokens and their ids (transformers' names; fixed at construction) -------------------
    bos_token = property(lambda self: self._tokens["bos_token"])
    eos_token = property(lambda self: self._tokens["eos_token"])
    unk_token = property(lambda self: self._tokens["unk_token"])
    pad_token = property(lambda self: self._tokens["pad_token"])
    bos_token_id = property(lambda self: self.vocab[self.bos_token])
    eos_token_id = property(lambda self: self.vocab[self.eos_token])
    unk_token_id = property(lambda self: self.vocab[self.unk_token])
    pad_token_id = property(lambda self: self.vocab[self.pad_token])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    # --- encoding ------------------------------------------------------------------------------------
    def bpe(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols by rank until no ranked pair is left (OpenAI's loop)."""
        ranks = self.ranks
        while len(symbols) > 1:
            best = min(zip(symbols, symbols[1:]), key=lambda p: ranks.get(p, 1 << 62))
            if best not in ranks:
                break
            first, second = best
            merged: list[str] = []
            i, n = 0, len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            return ids
        chars = [self.byte_encoder[b] for b in piece.encode("utf-8")]
        chars[-1] += EOW
        unk = self.vocab[self.unk_token]
        ids = [self.vocab.get(t, unk) for t in self.bpe(chars)]
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` without <|startoftext|> / <|endoftext|> around it."""
        out: list[int] = []
        for part in self._special_re.split(text):  # special-token strings are split off before normalising
            if part in self.specials:
                out.append(self.vocab[part])
            elif part:
                for piece in pre_tokenize(normalize(part)):
                    out.extend(self._piece_ids(piece))
        return out

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Ids with <|startoftext|> ... <|endoftext|>; `max_length` truncates the text's ids to fit (no padding)."""
        ids = self.encode_ordinary(text)
        if not add_special_tokens:
            return ids if max_length is None else ids[:max_length]
        if max_length is not None:
            ids = ids[: max(max_length - 2, 0)]
        return [self.bos_token_id, *ids, self.eos_token_id]

    def tokenize(self, text: str) -> list[str]:
        return [self.id_to_token[i] for i in self.encode_ordinary(text)]

    def __call__(self, prompts: str | Sequence[str], padding: bool | str = "max_length", max_length: int | None = None,
                 truncation: bool = True, return_tensors: str | None = "pt") -> dict:
        """transformers' call: {"input_ids", "attention_mask"}, each (B, L). `padding`: "max_length" (pad to
        `max_length`, default `model_max_length`), "longest" / True (to the longest row), False / "do_not_pad".
        `truncation`: cut the text so that a row with its two special tokens fits `max_length`."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if padding not in ("max_length", "longest", True, False, "do_not_pad"):
            raise ValueError(f"CLIPTokenizer: padding={padding!r} is not supported")
        limit = max_length if max_length is not None else self.model_max_length
        rows = [self.encode(p, max_length=limit if truncation else None) for p in prompts]
        width = {"max_length": limit, "longest": max(map(len, rows)), True: max(map(len, rows))}.get(padding, 0)
        masks = [[1] * len(r) + [0] * (width - len(r)) for r in rows]  # a row longer than width stays longer
        rows = [r + [self.pad_token_id] * (width - len(r)) for r in rows]
        if return_tensors == "pt":
            if len({len(r) for r in rows}) > 1:
                raise ValueError("CLIPTokenizer: rows of different lengths need padding for return_tensors='pt'")
            return {"input_ids": torch.tensor(rows, dtype=torch.long), "attention_mask": torch.tensor(masks)}
        if return_tensors is not None:
            raise ValueError(f"CLIPTokenizer: return_tensors={return_tensors!r} is not supported ('pt' or None)")
        if single:
            return {"input_ids": rows[0], "attention_mask": masks[0]}
        return {"input_ids": rows, "attention_mask": masks}

    # --- decoding ------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Token strings -> bytes -> text; each `</w>` becomes a space; stripped (as transformers decodes)."""
        ids = [int(i) for i in ids]
        specials = {self.vocab[t] for t in self.specials}
        text = "".join(self.id_to_token[i] for i in ids if not (skip_special_tokens and i in specials))
        table = unicode_to_bytes()
        raw = bytes(table[c] for c in text if c in table)
        return raw.decode("utf-8", errors="replace").replace(EOW, " ").strip()

    # --- folders -------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> CLIPTokenizer:
        """Read a tokenizer folder (vocab.json + merges.txt + tokenizer_config.json / special_tokens_map.json,
        or a tokenizer.json)."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json") or {}
        specials = _read_json(path / "special_tokens_map.json") or {}
        bad = sorted(k for k in config if k not in _CONFIG_KEYS | _CONFIG_METADATA)
        if bad:
            raise ValueError(f"{path / 'tokenizer_config.json'}: unsupported setting(s) {bad}")
        if config.get("tokenizer_class", "CLIPTokenizer") not in ("CLIPTokenizer", "CLIPTokenizerFast"):
            raise ValueError(f"{path}: tokenizer_class={config['tokenizer_class']!r} is not a CLIP tokenizer")
        if config.get("do_lower_case", True) is not True:
            raise ValueError(f"{path}: do_lower_case={config['do_lower_case']!r} is not supported (CLIP lower-cases)")
        if config.get("add_prefix_space", False):
            raise ValueError(f"{path}: add_prefix_space=true is not supported")
        if config.get("errors", "replace") != "replace":
            raise ValueError(f"{path}: errors={config['errors']!r} is not supported (decode replaces bad UTF-8)")
        vocab, merges, added = _read_vocab_merges(path)
        tokens = {"bos_token": SOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
        for name in tokens:
            value = specials.get(name, config.get(name))
            if value is not None:
                tokens[name] = value["content"] if isinstance(value, dict) else value
        added += [v["content"] for v in config.get("added_tokens_decoder", {}).values()]
        added += specials.get("additional_special_tokens", []) + config.get("additional_special_tokens", [])
        extra = sorted({t for t in added if t not in tokens.values() or t not in vocab})
        if extra:
            raise ValueError(f"{path}: added tokens {extra} are not supported (only the bos / eos / unk / pad tokens "
                             "of the vocabulary)")
        return cls(vocab, merges, model_max_length=int(config.get("model_max_length", 77)), **tokens)

    def save_pretrained(self, path: str | Path) -> None:
        """Write vocab.json, merges.txt, special_tokens_map.json, tokenizer_config.json (transformers reads it)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path / "vocab.json", json.dumps(self.vocab, ensure_ascii=False))
        atomic.write_text(path / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self.merges))
        tokens = dict(self._tokens)
        atomic.write_text(path / "special_tokens_map.json", json.dumps(tokens, indent=2))
        cfg = {"tokenizer_class": "CLIPTokenizer", "model_max_length": self.model_max_length, "do_lower_case": True,
               "errors": "replace", "add_prefix_space": False, **tokens}
        atomic.write_text(path / "tokenizer_config.json", json.dumps(cfg, indent=2))

    # --- training ------------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], num_merges: int, **kwargs) -> CLIPTokenizer:
        """Learn up to `num_merges` merges on `texts` (CLIP's normalizer and pre-tokenizer); `kwargs` go to the
        constructor (`pad_token`, `model_max_length`)."""
        return cls(*train(texts, num_merges), **kwargs)


def train(texts: Iterable[str], num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) in CLIP's layout, learned by `scratchlm.tokenizer.train.bpe_merges` on the pre-tokens of
    `texts`. Symbols are byte ids 0..255 and, for a pre-token's last byte, 256 + byte (that byte with `</w>`); a
    token's bytes carry a literal b"</w>" suffix when it ends a word (no pre-token contains "</w>" itself: "w" is a
    letter, "</" and ">" are not), which is how the merged pairs are read back."""
    from scratchlm.tokenizer.train import bpe_merges

    counts: Counter[str] = Counter()
    for text in texts:
        for part in _SPECIAL.split(text):
            if part not in (SOT, EOT):
                counts.update(pre_tokenize(normalize(part)))
    words: dict[tuple[int, ...], int] = {}
    for piece, c in counts.items():
        b = piece.encode("utf-8")
        words[(*b[:-1], 256 + b[-1])] = c
    byte_vocab = {i: bytes([i]) for i in range(256)} | {256 + i: bytes([i]) + EOW.encode() for i in range(256)}
    pairs = bpe_merges(words, byte_vocab, num_merges, progress=False)

    def to_str(token: bytes) -> str:
        end = token.endswith(EOW.encode())
        body = token[: -len(EOW)] if end else token
        return "".join(bytes_to_unicode()[b] for b in body) + (EOW if end else "")

    base = list(bytes_to_unicode().values())
    tokens = base + [c + EOW for c in base]
    merges = [(to_str(a), to_str(b)) for a, b in pairs]
    tokens += [a + b for a, b in merges] + [SOT, EOT]
    vocab: dict[str, int] = {}
    for t in tokens:  # a string reached by two merge paths keeps its first id
        vocab.setdefault(t, len(vocab))
    return vocab, merges


def _read_json(p: Path) -> dict | None:
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


def _read_vocab_merges(path: Path) -> tuple[dict[str, int], list[tuple[str, str]], list[str]]:
    """(vocab, merges, tokenizer.json's added tokens)."""
    vocab_p, merges_p, tj_p = path / "vocab.json", path / "merges.txt", path / "tokenizer.json"
    if vocab_p.is_file() and merges_p.is_file():
        vocab = _read_json(vocab_p)
        lines = merges_p.read_text(encoding="utf-8").split("\n")
        merges = [_merge_pair(ln, merges_p, i) for i, ln in enumerate(lines)
                  if ln and not (i == 0 and ln.startswith("#version"))]
        return vocab, merges, []
    if tj_p.is_file():
        data = _read_json(tj_p)
        model = data.get("model", {})
        if model.get("type") != "BPE" or model.get("end_of_word_suffix") != EOW:
            raise ValueError(f"{tj_p}: not a CLIP BPE model (type BPE with end_of_word_suffix '{EOW}')")
        for key in ("normalizer", "pre_tokenizer"):
            if data.get(key) != _HF_PIPELINE[key]:
                raise ValueError(f"{tj_p}: {key} {json.dumps(data.get(key))} is not CLIP's (the only one implemented)")
        merges = [tuple(m) if isinstance(m, list) else _merge_pair(m, tj_p, i) for i, m in enumerate(model["merges"])]
        return model["vocab"], merges, [t["content"] for t in data.get("added_tokens", [])]
    raise FileNotFoundError(f"{path}: no vocab.json + merges.txt (or tokenizer.json): not a CLIP tokenizer folder")


# tokenizer.json's normalizer and pre-tokenizer as transformers' CLIPTokenizer builds them (checked, not run).
_HF_PIPELINE = {
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, {"type": "Lowercase"}]},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"
                                               r"[\p{N}]|[^\s\p{L}\p{N}]+"},
         "behavior": "Removed", "invert": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}


def _merge_pair(line: str, where: Path, i: int) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 2:
        raise ValueError(f"{where}:{i + 1}: expected two space-separated tokens, got {line!r}")
    return parts[0], parts[1]
