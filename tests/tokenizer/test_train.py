"""The BPE trainer against a naive reference trainer (recounts every pair after each merge)."""

from __future__ import annotations

from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.tokenizer import Tokenizer, train_bpe
from scratchlm.tokenizer.pretokenize import PreTokenizer
from scratchlm.tokenizer.train import count_corpus, find_chunk_boundaries

# Written out here on purpose (not imported): the GPT-2 pattern.
PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def naive_train(text: str, vocab_size: int, specials: list[str]) -> list[tuple[bytes, bytes]]:
    """The textbook algorithm: recount all pairs after every merge; max count, ties to the greater pair."""
    parts = regex.split("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)), text) \
        if specials else [text]
    words: Counter = Counter()
    for part in parts:
        for piece in regex.findall(PAT, part):
            words[tuple(bytes([b]) for b in piece.encode("utf-8"))] += 1
    merges = []
    size = 256 + len(specials)
    while size < vocab_size:
        pairs: Counter = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        size += 1
        new_words: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return merges


CORPORA = {
    "ties": "ab ab cd cd ef ef gh gh ba ba dc dc",
    "overlap": "aaaa aaa aa a aaaaaaa bbbb abab baba",
    "low lower": "low low low low low lower lower newest newest newest newest newest newest widest widest widest",
    "specials": "hello<|endoftext|>hello world<|endoftext|><|endoftext|>wor<|pad|>ld hello",
    "unicode": "日本語 日本 日本語のテキスト 😀😀 😀 über über ü",
    "whitespace": "a  b\n\n c\t\td  \n e's it'll we've",
}


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_merges_equal_naive(tmp_path, name):
    text = CORPORA[name] * 3
    specials = ["<|endoftext|>", "<|pad|>"] if name == "specials" else []
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 256 + len(specials) + 60, specials, progress=False)
    assert merges == naive_train(text, 256 + len(specials) + 60, specials)
    # Specials appear exactly once, and no merge crosses them.
    for s in specials:
        assert list(vocab.values()).count(s.encode()) == 1
        assert not any(s.encode() in a + b for a, b in merges)
    assert len(set(vocab.values())) == len(vocab)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab c\n'é😀", max_size=80), st.integers(0, 40))
def test_merges_equal_naive_random(tmp_path_factory, text, n_merges):
    path = tmp_path_factory.mktemp("c") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    _, merges = train_bpe(path, 256 + 1 + n_merges, ["<|endoftext|>"], progress=False)
    assert merges == naive_train(text, 256 + 1 + n_merges, ["<|endoftext|>"])


def test_tinystories_sample_equals_naive(data_dir, tmp_path):
    text = (data_dir / "corpora" / "tinystories" / "tinystories_v2_sample_cs336.txt").read_text(encoding="utf-8")
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 400, ["<|endoftext|>"], progress=False)
    assert merges == naive_train(text, 400, ["<|endoftext|>"])
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    assert tok.decode(tok.encode(text)) == text


def test_parallel_chunked_counts_equal_whole_file(data_dir):
    """Chunk boundaries (letter|space letter, or before a special) never change the pre-tokens."""
    pre = PreTokenizer()
    for name, specials in [("tinyshakespeare/input.txt", []),
                           ("tinystories/tinystories_v2_sample_cs336.txt", ["<|endoftext|>"])]:
        path = data_dir / "corpora" / name
        chunk = max(path.stat().st_size // 7, 256)
        assert len(find_chunk_boundaries(path, chunk, specials)) > 4
        whole = count_corpus([path], specials, pre, 1, 1 << 40, progress=False)
        assert count_corpus([path], specials, pre, 2, chunk, progress=False) == whole


def test_bad_arguments(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("hello")
    with pytest.raises(FileNotFoundError, match="training input not found"):
        train_bpe(tmp_path / "nope.txt", 300)
    with pytest.raises(ValueError, match="vocab_size must be"):
        train_bpe(path, 256, ["<|endoftext|>"])
    vocab, merges = train_bpe(path, 1000, progress=False)  # stops when nothing is left to merge
    assert len(merges) == 4 and vocab[len(vocab) - 1] == b"hello"
