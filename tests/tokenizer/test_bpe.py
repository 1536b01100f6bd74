"""The BPE Tokenizer against tiktoken's gpt2 (same files), and round-trip properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchlm.tokenizer import Tokenizer
from tests.tokenizer.conftest import corpus_files, sample_text

EOT = "<|endoftext|>"
_settings = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Arbitrary unicode, with a bias towards the hard parts: whitespace runs, digits, contractions,
# emoji, CJK, combining marks, control characters.
_hard = st.sampled_from(
    [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "'s", "'ll", "'", "123", " 4", "😀", "👍🏽",
     "漢字", "한국어", "e\u0301", "\x00", "\x1f", "\x7f", "\u200b", "Ġ", "<|", "|>", EOT]
)
texts = st.lists(st.one_of(st.text(max_size=12), _hard), max_size=30).map("".join)


def test_corpora_sampled_match_tiktoken(gpt2_tok, tiktoken_gpt2, data_dir):
    files = corpus_files(data_dir)
    assert len(files) > 100, "expected the shared corpora (Gutenberg books included)"
    for path in files[::6] + [p for p in files if "gutenberg" not in p.parts]:
        text = sample_text(path, 8_000, 2)
        assert gpt2_tok.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all"), path.name


@pytest.mark.slow
def test_corpora_full_match_tiktoken(gpt2_tok, tiktoken_gpt2, data_dir):
    for path in corpus_files(data_dir):
        text = path.read_text(encoding="utf-8", errors="replace")
        assert gpt2_tok.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all"), path.name


@_settings
@given(texts)
def test_arbitrary_unicode_matches_tiktoken(gpt2_tok, tiktoken_gpt2, text):
    assert gpt2_tok.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")


@_settings
@given(texts)
def test_roundtrip(gpt2_tok, text):
    assert gpt2_tok.decode(gpt2_tok.encode(text)) == text


def test_special_tokens_match_tiktoken(gpt2_tok, tiktoken_gpt2):
    text = f"Hello{EOT}world {EOT}{EOT}\n{EOT} <|endoftext| <|endoftext|>>"
    ids = gpt2_tok.encode(text)
    assert ids == tiktoken_gpt2.encode(text, allowed_special="all")
    assert ids.count(50256) == 5


def test_overlapping_special_tokens_longest_first(gpt2_tok, overlapping_tok):
    double = EOT + EOT
    tok = overlapping_tok
    ids = tok.encode(f"a{double}b{EOT}c")
    double_id = tok.special_ids[double]
    assert double_id not in (50256,) and ids.count(double_id) == 1 and ids.count(50256) == 1
    assert tok.decode(ids) == f"a{double}b{EOT}c"
    # Without specials the marker is ordinary text.
    plain = Tokenizer(gpt2_tok.vocab, gpt2_tok.merges)
    assert 50256 not in plain.encode(EOT)


def test_long_pretokens_use_heap_path_identically(gpt2_tok, tiktoken_gpt2):
    for text in [" " * 5000, "a" * 3000, "ab" * 2000 + "!", "🙂" * 500, "x" + "\n" * 4000 + "y"]:
        assert gpt2_tok.encode(text) == tiktoken_gpt2.encode(text)


def test_decode_invalid_utf8_gives_replacement(gpt2_tok):
    ids = gpt2_tok.encode("😀")
    assert len(ids) > 1
    assert gpt2_tok.decode(ids[:1]) == "\ufffd"
    assert "\ufffd" in gpt2_tok.decode([ids[0], gpt2_tok.encode("a")[0]])


def test_decode_unknown_id_is_a_clear_error(gpt2_tok):
    with pytest.raises(ValueError, match="not in the vocabulary"):
        gpt2_tok.decode([1, 10**9])


@pytest.fixture(scope="module")
def overlapping_tok(gpt2_tok):
    return Tokenizer(gpt2_tok.vocab, gpt2_tok.merges, special_tokens=[EOT, EOT + EOT])


@_settings
@given(texts, st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_encode_iterable_equals_encode(overlapping_tok, text, sizes):
    tok = overlapping_tok
    chunks, pos, k = [], 0, 0
    while pos < len(text):
        chunks.append(text[pos : pos + sizes[k % len(sizes)]])
        pos += sizes[k % len(sizes)]
        k += 1
    assert list(tok.encode_iterable(chunks, min_chunk_chars=8)) == tok.encode(text)


def test_encode_iterable_on_a_file_is_lazy_and_exact(gpt2_tok, data_dir):
    path = data_dir / "corpora" / "tinyshakespeare" / "input.txt"
    text = path.read_text(encoding="utf-8")
    consumed = [0]

    def lines():
        with open(path, encoding="utf-8") as f:
            for line in f:
                consumed[0] += len(line)
                yield line

    stream = gpt2_tok.encode_iterable(lines(), min_chunk_chars=4096)
    first = next(stream)  # bounded: ids come out long before the file is read whole
    assert consumed[0] < 10_000 < len(text)
    assert [first, *stream] == gpt2_tok.encode(text)


def test_attributes(gpt2_tok):
    assert gpt2_tok.vocab_size == 50257
    assert gpt2_tok.bos_id == gpt2_tok.eos_id == 50256
    assert gpt2_tok.chat_template is None and gpt2_tok.add_bos is False


def test_bad_input_errors(gpt2_tok):
    with pytest.raises(TypeError, match="expects str"):
        gpt2_tok.encode(b"bytes")
    with pytest.raises(ValueError, match="not in the vocab"):
        Tokenizer({i: bytes([i]) for i in range(256)}, [(b"a", b"q")])


_simple_chars = st.text(alphabet=st.sampled_from(list("abcXYZ019 '\n\t\r.,!-") + list("’‘“”—–…«»£€§°\u200b\xad")),
                        max_size=60)


@_settings
@given(st.lists(st.one_of(_simple_chars, st.text(max_size=3)), max_size=12), st.integers(1, 400))
def test_fast_paths_split_like_regex(gpt2_tok, tiktoken_gpt2, parts, times):
    """The stdlib-`re` path for ASCII/punctuation text and the ~4 KB block cutting (long text) give
    exactly the `regex` pre-tokens and tiktoken's ids."""
    import regex

    from scratchlm.tokenizer.pretokenize import GPT2_PATTERN, PreTokenizer

    text = "".join(parts) * times
    assert PreTokenizer().split(text) == regex.findall(GPT2_PATTERN, text)
    assert gpt2_tok.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")
