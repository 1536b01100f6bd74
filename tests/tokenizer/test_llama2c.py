"""llama2.c's tok512.bin against the stories260K golden greedy output."""

from __future__ import annotations

import io
import json

import pytest

from scratchlm.tokenizer import Llama2cTokenizer, tokenizer_from_state, tokenizer_to_state


@pytest.fixture(scope="module")
def stories(data_dir):
    d = data_dir / "models" / "stories260K"
    return Llama2cTokenizer.from_file(d / "tok512.bin"), json.loads((d / "golden_greedy.json").read_text())


def test_decode_golden_ids_gives_golden_text(stories):
    tok, golden = stories
    assert tok.decode(golden["ids"]) == golden["text"]


def test_encode_golden_text_gives_golden_ids_exactly(stories):
    """encode(text, bos=True), with llama2.c's dummy-prefix space, reproduces the golden ids exactly."""
    tok, golden = stories
    assert golden["ids"][0] == 1
    assert tok.encode(golden["text"], bos=True) == golden["ids"]


def test_attributes_and_roundtrips(stories):
    tok, _ = stories
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (512, 1, 2, True, None)
    for text in ["Hello, Lily!", "x", "日本 😀 ünï", "a\n\nb  c"]:
        ids = tok.encode(text, bos=True)
        assert tok.decode(ids) == text  # bytes outside the vocabulary go through <0xNN>
    assert tok.encode("") == [] and tok.encode("", bos=True, eos=True) == [1, 2]
    assert tok.decode([1, 2, 0]) == ""
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.decode([600])


def test_state_round_trip(stories):
    torch = pytest.importorskip("torch")
    tok, golden = stories
    buf = io.BytesIO()
    torch.save(tokenizer_to_state(tok), buf)
    buf.seek(0)
    back = tokenizer_from_state(torch.load(buf, weights_only=True))
    assert back.encode(golden["text"], bos=True) == golden["ids"]


def test_bad_file(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00\xff\xff\x00\x00")
    with pytest.raises(ValueError, match="bad piece length|truncated"):
        Llama2cTokenizer.from_file(tmp_path / "t.bin")
