"""SentencePiece-style BPE (Llama 2, Mistral, Phi-3, Gemma pipelines) and GGUF ``llama`` vocabularies against
HF ``tokenizers``, on tiny tokenizers built here from a TinyStories sample; byte-level families with their
own pre-tokenizer shapes (Qwen2 NFC + regex); errors on unsupported pieces; speed."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchlm.tokenizer import SentencePieceBPE, Tokenizer, tokenizer_from_state, tokenizer_to_state
from scratchlm.tokenizer.formats import from_gguf, load_hf_dir, save_hf_tokenizer_json
from scratchlm.tokenizer.pretokenize import QWEN2_PATTERN
from tests.tokenizer.test_bpe import texts

tokenizers = pytest.importorskip("tokenizers")
_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# (content, options): Phi-3 style rstrip, a plain special, a non-special added token.
ADDED = [("<|end|>", {"special": True, "rstrip": True}), ("<|user|>", {"special": True}),
         ("<tool>", {"special": False})]
TRICKY = [
    "Hello world", "", " ", "  two  spaces  ", "   ", "line\nbreak\n\n  indented", "tabs\tand\r\nwindows",
    "Once upon a time, there was a little girl named Lily.", "café naïve über Ünïcödé", "日本語のテキスト 漢字",
    "emoji 😀👍🏽 and ZWJ 👩‍👩‍👧", "e\u0301 combining", "▁already▁escaped ▁", "<0x41> is not a byte token",
    "<s>Hello</s> there<unk>", "a<|end|>   next<|user|>  x <|end|>", "<tool>call<tool> <tool>", "<s><s>",
    "x" * 300, "the " * 50, "\u00a0nbsp\u3000ideographic", "\x00\x1f\x7f controls", "Ġ Ċ ▁▁▁ ▁x",
]
_extra = st.sampled_from(["▁", "▁▁", " ", "<s>", "</s>", "<unk>", "<|end|>", "<|user|>", "<tool>", "<0x41>", "é",
                          "🦙", "the", " the", "\n"])
sp_texts = st.lists(st.one_of(texts, _extra), max_size=8).map("".join)


# ---------------------------------------------------------------------------- building tiny tokenizers
@pytest.fixture(scope="module")
def trained(data_dir):
    """(model vocab pieces in id order, trained merges): an HF BPE trained on ~60 KB of TinyStories with
    words split as SentencePiece does (Metaspace), then laid out as Llama 2: <unk> <s> </s>, 256 byte
    tokens, the rest. Emoji and CJK are outside its vocabulary (byte fallback)."""
    from tokenizers import models, pre_tokenizers, trainers

    text = (data_dir / "corpora/tinystories/tinystories_v1_valid_head.txt").read_text(encoding="utf-8")[:60_000]
    text += "\nCafé naïve über Ünïcödé. " * 20
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=700, show_progress=False))
    state = json.loads(hf.to_str())["model"]
    pieces = SPECIALS + BYTES + [s for s, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    return pieces, [tuple(m) for m in state["merges"]]


NORMALIZE_LLAMA2 = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
NORMALIZE_GEMMA = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
DECODE_SPM = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
              {"type": "Fuse"}]
STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def _metaspace(scheme: str, split: bool) -> dict:
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}


# family -> (normalizer, pre_tokenizer, decoder, ignore_merges)
FAMILIES = {
    "llama2": (NORMALIZE_LLAMA2, None, {"type": "Sequence", "decoders": DECODE_SPM + [STRIP]}, False),
    "llama2-ignore-merges": (NORMALIZE_LLAMA2, None, {"type": "Sequence", "decoders": DECODE_SPM + [STRIP]}, True),
    "gemma": (NORMALIZE_GEMMA, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                                "invert": False}, {"type": "Sequence", "decoders": DECODE_SPM}, False),
    "metaspace-first": (None, _metaspace("first", False), {"type": "Sequence", "decoders": DECODE_SPM + [STRIP]},
                        False),
    "metaspace-always-split": (None, _metaspace("always", True), _metaspace("always", True), False),
    "metaspace-never": (None, _metaspace("never", False), _metaspace("never", False), False),
}


def _added_tokens(first_id: int, extra: list = ADDED) -> list[dict]:
    out = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True} for i, c in enumerate(SPECIALS)]
    for k, (content, options) in enumerate(extra):
        out.append({"id": first_id + k, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                    "normalized": False, "special": True} | options)
    return out


def _write_tokenizer_json(directory, pieces, merges, normalizer, pre, decoder, ignore_merges=False, added=None):
    directory.mkdir(parents=True, exist_ok=True)

    def bos(type_id: int) -> dict:
        return {"SpecialToken": {"id": "<s>", "type_id": type_id}}

    def seq(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(len(pieces)) if added is None else added,
        "normalizer": normalizer, "pre_tokenizer": pre,
        "post_processor": {"type": "TemplateProcessing", "single": [bos(0), seq("A", 0)],
                           "pair": [bos(0), seq("A", 0), bos(1), seq("B", 1)],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": ignore_merges,
                  "vocab": {p: i for i, p in enumerate(pieces)}, "merges": [list(m) for m in merges]},
    }
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))


def _check(tok, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids, text
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, trained, tmp_path_factory):
    """(our tokenizer, HF tokenizers) for one family-shaped pipeline over the same trained vocabulary."""
    pieces, merges = trained
    normalizer, pre, decoder, ignore_merges = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = _write_tokenizer_json(directory, pieces, merges, normalizer, pre, decoder, ignore_merges)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": "{{ x }}"}))
    return load_hf_dir(directory), hf


# ---------------------------------------------------------------------------- tokenizer.json families
def test_family_metadata(family):
    tok, hf = family
    assert isinstance(tok, SentencePieceBPE)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (1, 2, True, "{{ x }}")
    assert tok.vocab_size == hf.get_vocab_size() and tok.unk_id == 0
    assert tok.special_ids["<|end|>"] == hf.token_to_id("<|end|>")
    assert tok.id_to_token(hf.token_to_id("▁the")) == b" the"
    assert tok.id_to_token(3 + 0x0A) == (b"<0x0A>" if tok.decoder.spec["type"] == "Metaspace" else b"\n")


def test_family_matches_hf_on_tricky_strings(family):
    tok, hf = family
    for text in TRICKY:
        _check(tok, hf, text)


@_settings
@given(sp_texts)
def test_family_matches_hf_on_arbitrary_text(family, text):
    _check(*family, text)


@_settings
@given(st.lists(st.integers(0, 800), max_size=12))
def test_family_decode_matches_hf_on_arbitrary_ids(family, ids):
    """Any id sequence, byte tokens in broken runs, specials anywhere: decode equals HF's."""
    tok, hf = family
    ids = [i for i in ids if i < tok.vocab_size]
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_and_decode_bytes(family):
    tok, _ = family
    ids = tok.encode("🦙")
    assert ids[-4:] == [3 + b for b in "🦙".encode()]
    if tok.decoder.spec["type"] == "Metaspace":  # no ByteFallback decoder: byte tokens decode as their names
        assert tok.decode(ids[-4:]) == "".join(BYTES[b] for b in "🦙".encode())
        return
    assert tok.decode_bytes(ids[-4:-1]) == "🦙".encode()[:3]  # raw bytes, incomplete UTF-8 kept
    assert tok.decode(ids[-4:-1]).endswith("\ufffd")


def test_normalized_added_token_and_single_word(trained, tmp_path):
    """A ``normalized`` added token is matched in the normalized text (after Prepend/Replace), as HF does;
    ``single_word`` and ``lstrip`` follow HF too."""
    pieces, merges = trained
    added = _added_tokens(len(pieces), [("▁magic", {"normalized": True, "special": False}),
                                        ("word", {"single_word": True}), ("<L>", {"lstrip": True})])
    hf = _write_tokenizer_json(tmp_path, pieces, merges, NORMALIZE_LLAMA2, None,
                               {"type": "Sequence", "decoders": DECODE_SPM + [STRIP]}, added=added)
    tok = load_hf_dir(tmp_path)
    for text in ["a magic trick", "magic", "xmagic", "word words sword word.", "a   <L>b", "<L>", " magic<L>magic"]:
        _check(tok, hf, text)


# ---------------------------------------------------------------------------- GGUF llama vocabulary
def _sp_vocab(pieces, merges):
    """SentencePiece-like scores (a merged token scores by its merge's rank, characters below all merges)
    and token types, and the merges HF's converter derives from them: every split of a normal token into
    two tokens, by the token's score."""
    merged_rank = {a + b: r for r, (a, b) in enumerate(merges)}
    types, scores = [], []
    for i, p in enumerate(pieces):
        types.append(2 if p == "<unk>" else 3 if p in SPECIALS else 6 if p in BYTES else 1)
        scores.append(0.0 if types[-1] != 1 else -float(merged_rank.get(p, len(merges) + i)))
    lookup = {p: i for i, p in enumerate(pieces)}
    ranked = sorted((-scores[i], i, p[:k], p[k:]) for i, p in enumerate(pieces) if types[i] == 1
                    for k in range(1, len(p)) if p[:k] in lookup and p[k:] in lookup)
    return scores, types, [(a, b) for _, _, a, b in ranked]


def _write_gguf(path, pieces, scores, types, space_prefix: bool, extra_control=()):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(list(pieces) + list(extra_control))
    w.add_token_scores(list(scores) + [0.0] * len(extra_control))
    w.add_token_types(list(types) + [3] * len(extra_control))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(space_prefix)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def gguf_pair(request, trained, tmp_path_factory):
    """(from_gguf, HF tokenizers on the converter-style tokenizer.json of the same vocabulary)."""
    pieces, merges = trained
    scores, types, sp_merges = _sp_vocab(pieces, merges)
    directory = tmp_path_factory.mktemp("gguf")
    controls = ["<|end|>", "<|user|>"]
    _write_gguf(directory / "vocab.gguf", pieces, scores, types, request.param, controls)
    normalizer = NORMALIZE_LLAMA2 if request.param else NORMALIZE_GEMMA
    decoder = {"type": "Sequence", "decoders": DECODE_SPM + ([STRIP] if request.param else [])}
    added = _added_tokens(len(pieces), [(c, {}) for c in controls])
    hf = _write_tokenizer_json(directory, pieces, sp_merges, normalizer, None, decoder, added=added)
    return from_gguf(directory / "vocab.gguf"), hf


def test_gguf_llama_metadata(gguf_pair):
    tok, _ = gguf_pair
    assert isinstance(tok, SentencePieceBPE) and tok.merges is None
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos, tok.chat_template) == (1, 2, 0, True, "{{ messages }}")
    assert "<|end|>" in tok.special_tokens and "<unk>" in tok.special_tokens


def test_gguf_llama_matches_hf_on_tricky_strings(gguf_pair):
    tok, hf = gguf_pair
    for text in TRICKY:
        _check(tok, hf, text)


@_settings
@given(sp_texts)
def test_gguf_llama_matches_hf_on_arbitrary_text(gguf_pair, text):
    _check(*gguf_pair, text)


def test_gguf_score_order_is_not_the_trained_merge_order(trained, gguf_pair, tmp_path):
    """Score-ordered merging may merge pairs a trained merges list never lists: this pins that the GGUF path
    does not just replay the trained merges."""
    pieces, merges = trained
    tok, _ = gguf_pair
    hf = _write_tokenizer_json(tmp_path, pieces, merges, NORMALIZE_LLAMA2, None, None)
    corpus = " ".join(TRICKY) * 3
    assert any(tok.encode(w) != hf.encode(w, add_special_tokens=False).ids for w in corpus.split())


def test_gguf_export_to_tokenizer_json(gguf_pair, tmp_path):
    """A GGUF vocabulary written as tokenizer.json (converter-style merges) encodes identically in HF."""
    tok, _ = gguf_pair
    save_hf_tokenizer_json(tok, tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TRICKY:
        _check(tok, hf, text)
    assert hf.encode("hi").ids[0] == 1  # the template adds BOS


def test_spm_state_round_trip(family, gguf_pair):
    for tok, _ in (family, gguf_pair):
        back = tokenizer_from_state(json.loads(json.dumps(tokenizer_to_state(tok))))
        assert isinstance(back, SentencePieceBPE)
        for text in TRICKY:
            ids = tok.encode(text)
            assert back.encode(text) == ids and back.decode(ids) == tok.decode(ids)


# ---------------------------------------------------------------------------- byte-level families
@pytest.mark.parametrize("style", ["qwen2-nfc", "gpt2", "olmo2"])
def test_byte_level_families(tmp_path, style):
    """Qwen2 (NFC normalizer + its Split regex + ByteLevel without regex), GPT-2 (ByteLevel regex), OLMo-2
    (cl100k-style Split + ByteLevel) load as byte-level Tokenizers and encode as HF."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    from scratchlm.tokenizer.formats import bytes_to_unicode
    from scratchlm.tokenizer.pretokenize import LLAMA3_PATTERN

    hf = tokenizers.Tokenizer(models.BPE())
    if style == "gpt2":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern = QWEN2_PATTERN if style == "qwen2-nfc" else LLAMA3_PATTERN
        hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2-nfc":
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=[bytes_to_unicode()[b] for b in range(256)], show_progress=False)
    hf.train_from_iterator(TRICKY * 5 + ["café résumé naïve e\u0301te\u0301 12345"] * 20, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_hf_dir(tmp_path)
    assert isinstance(tok, Tokenizer) and (tok.normalizer is not None) == (style == "qwen2-nfc")
    for text in TRICKY + ["cafe\u0301 re\u0301sume\u0301<|im_start|>e\u0301", "Å Å ﬁ"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
    if style == "qwen2-nfc":
        text = "cafe\u0301 " * 5000
        assert list(tok.encode_iterable([text[i:i + 97] for i in range(0, len(text), 97)], 512)) == tok.encode(text)
        save_hf_tokenizer_json(tok, tmp_path / "again.json")
        again = tokenizers.Tokenizer.from_file(str(tmp_path / "again.json"))
        assert again.encode("cafe\u0301", add_special_tokens=False).ids == tok.encode("cafe\u0301")
        assert tokenizer_from_state(tokenizer_to_state(tok)).encode("cafe\u0301") == tok.encode("cafe\u0301")


# ---------------------------------------------------------------------------- errors and speed
def _tokenizer_json_with(trained, tmp_path, **overrides):
    pieces, merges = trained
    normalizer, pre, decoder, _ = FAMILIES["llama2"]
    _write_tokenizer_json(tmp_path, pieces, merges, normalizer, pre, decoder)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    for key, value in overrides.items():
        if key == "model":
            data["model"].update(value)
        else:
            data[key] = value
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize("override, match", [
    ({"model": {"type": "Unigram"}}, "Unigram"),
    ({"model": {"type": "WordPiece"}}, "WordPiece"),
    ({"normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}}, "Precompiled"),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "BertNormalizer"}]}}, "BertNormalizer"),
    ({"pre_tokenizer": {"type": "Whitespace"}}, "Whitespace"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Punctuation"}]}}, "Punctuation"),
    ({"decoder": {"type": "WordPiece"}}, "decoder 'WordPiece'"),
    ({"model": {"dropout": 0.1}}, "dropout"),
])
def test_unsupported_pieces_raise(trained, tmp_path, override, match):
    _tokenizer_json_with(trained, tmp_path, **override)
    with pytest.raises(ValueError, match=match):
        load_hf_dir(tmp_path)


def test_gguf_unsupported_model_raises(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'t5'"):
        from_gguf(tmp_path / "t5.gguf")


def test_encode_is_fast_and_not_quadratic(family, data_dir):
    tok, hf = family
    text = (data_dir / "corpora/tinyshakespeare/input.txt").read_text(encoding="utf-8")[:6000]
    fresh = tokenizer_from_state(tokenizer_to_state(tok))  # cold cache
    t0 = time.perf_counter()
    ids = fresh.encode(text)
    cold = time.perf_counter() - t0
    assert ids == hf.encode(text, add_special_tokens=False).ids
    long_word = "".join(chr(0x61 + (i * 7) % 26) for i in range(20_000))  # no spaces: one 20K-character word
    t0 = time.perf_counter()
    ids = fresh.encode(long_word)
    long = time.perf_counter() - t0
    assert ids == hf.encode(long_word, add_special_tokens=False).ids
    assert cold < 0.5 and long < 1.0, (cold, long)


# ---------------------------------------------------------------------------- against SentencePiece itself
@pytest.fixture(scope="module")
def sentencepiece_pair(data_dir):
    """(from_gguf on a real SentencePiece BPE model's pieces/scores/types, that model) — what llama.cpp's
    SPM tokenizer mirrors. Trained here in ~30 ms, Llama-style (byte fallback, identity normalization)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    text = (data_dir / "corpora/tinystories/tinystories_v1_valid_head.txt").read_text(encoding="utf-8")[:60_000]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([ln for ln in text.splitlines() if ln.strip()]), model_writer=model, vocab_size=600,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
             else 1 for i in range(n)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types}
    return from_gguf("in-memory.gguf", meta), sp


def test_gguf_llama_matches_sentencepiece(sentencepiece_pair, data_dir):
    tok, sp = sentencepiece_pair
    lines = (data_dir / "corpora/tinyshakespeare/input.txt").read_text(encoding="utf-8").splitlines()[:400]
    for text in [t for t in TRICKY if "<" not in t] + lines:
        assert tok.encode(text) == sp.encode(text), text


@_settings
@given(texts)
def test_gguf_llama_matches_sentencepiece_on_arbitrary_text(sentencepiece_pair, text):
    tok, sp = sentencepiece_pair
    assert tok.encode(text) == sp.encode(text)
