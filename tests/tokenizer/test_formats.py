"""File formats: GGUF vocabulary (SmolLM2) and HF tokenizer.json against HF tokenizers, GPT-2/CS336 files,
checkpoint state."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings

from scratchlm.tokenizer import Tokenizer, tokenizer_from_state, tokenizer_to_state
from scratchlm.tokenizer.formats import (
    bytes_to_unicode,
    from_gguf,
    load_gpt2_files,
    load_hf_dir,
    save_cs336_files,
    save_gpt2_files,
    save_hf_tokenizer_json,
    token_to_str,
)
from scratchlm.tokenizer.gguf_meta import read_gguf_metadata
from scratchlm.tokenizer.pretokenize import LLAMA3_PATTERN, PreTokenizer
from tests.tokenizer.test_bpe import texts

tokenizers = pytest.importorskip("tokenizers")
_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

VARIED = [
    "Hello world! 1234 + 56.7 = 1290.7",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "a  1   22\n\n 333 x",
    "Ünïcödé, 日本語のテキスト, emoji 😀👍🏽, Ελληνικά, русский, العربية",
    "tabs\tand\r\nwindows  lines   \n\n\n",
    "I'll we've they're it's DON'T",
    "<|endoftext|><|endoftext|><|im_end|>x<repo_name>y",
]


# ---------------------------------------------------------------------------- GGUF (SmolLM2)
@pytest.fixture(scope="module")
def smollm_meta(default_model_path):
    return read_gguf_metadata(default_model_path)


@pytest.fixture(scope="module")
def smollm_tok(default_model_path):
    return from_gguf(default_model_path)


@pytest.fixture(scope="module")
def smollm_hf(smollm_meta):
    """HF tokenizers built from the GGUF's own tokens/merges with SmolLM2's tokenizer.json pre-tokenizer:
    Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    tokens, types = smollm_meta["tokenizer.ggml.tokens"], smollm_meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in smollm_meta["tokenizer.ggml.merges"]]
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    return hf


def test_gguf_metadata_reader_matches_gguf_package(default_model_path, smollm_meta):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(default_model_path)
    checked = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert smollm_meta[key] == pytest.approx(value) if isinstance(value, float) else smollm_meta[key] == value, key
        checked += 1
    assert checked == len(smollm_meta) and checked > 20


def test_gguf_attributes(smollm_tok, smollm_meta):
    assert smollm_tok.vocab_size == 49152 == len(smollm_meta["tokenizer.ggml.tokens"])
    assert (smollm_tok.bos_id, smollm_tok.eos_id, smollm_tok.add_bos) == (1, 2, False)
    assert smollm_tok.chat_template == smollm_meta["tokenizer.chat_template"] and "im_start" in smollm_tok.chat_template
    assert "<|im_start|>" in smollm_tok.special_tokens and len(smollm_tok.special_tokens) == 17
    assert smollm_tok.pretokenizer == PreTokenizer.named("smollm")


def test_gguf_matches_hf_on_varied_text(smollm_tok, smollm_hf):
    for text in VARIED:
        assert smollm_tok.encode(text) == smollm_hf.encode(text, add_special_tokens=False).ids, text
        assert smollm_tok.decode(smollm_tok.encode(text)) == text


def test_gguf_digit_split_matters(smollm_tok, smollm_hf):
    """With plain GPT-2 pre-tokenization ' 2' and '  1' would differ: this pins the Digits stage."""
    plain = Tokenizer(smollm_tok.vocab, smollm_tok.merges, smollm_tok.special_tokens)
    text = "x  1\n  22 a 333"
    assert smollm_tok.encode(text) == smollm_hf.encode(text, add_special_tokens=False).ids
    assert plain.encode(text) != smollm_tok.encode(text)


@_settings
@given(texts)
def test_gguf_matches_hf_on_arbitrary_text(smollm_tok, smollm_hf, text):
    assert smollm_tok.encode(text) == smollm_hf.encode(text, add_special_tokens=False).ids


def test_gguf_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        from_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 20)
    with pytest.raises(ValueError, match="not a GGUF file"):
        from_gguf(bad)


# ---------------------------------------------------------------------------- HF tokenizer.json
def test_hf_export_encodes_identically(gpt2_tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    save_hf_tokenizer_json(gpt2_tok, path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    for text in VARIED:
        assert hf.encode(text, add_special_tokens=False).ids == gpt2_tok.encode(text), text
        assert hf.decode(gpt2_tok.encode(text), skip_special_tokens=False) == text
    back = load_hf_dir(tmp_path)
    assert back.encode(VARIED[3]) == gpt2_tok.encode(VARIED[3]) and back.vocab == gpt2_tok.vocab


def test_hf_export_of_stages(smollm_tok, smollm_hf, tmp_path):
    """A multi-stage pre-tokenizer exports as Sequence[Digits, Split..., ByteLevel]."""
    save_hf_tokenizer_json(smollm_tok, tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in VARIED:
        assert hf.encode(text, add_special_tokens=False).ids == smollm_tok.encode(text), text


def _saved_hf_dir(tmp_path, pre_tokenizer, ignore_merges=False):
    """Train a small byte-level BPE with HF tokenizers, then save it with transformers.save_pretrained."""
    from tokenizers import decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|begin|>", "<|end|>", "<|eot|>"],
                                  initial_alphabet=[bytes_to_unicode()[b] for b in range(256)], show_progress=False)
    corpus = [t * 3 for t in VARIED] + ["the quick brown fox jumps over the lazy dog 12345 " * 5] * 20
    hf.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|begin|>", eos_token="<|end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("style", ["gpt2", "llama3", "qwen2-digits"])
def test_load_hf_dir_matches_hf(tmp_path, style):
    from tokenizers import Regex, pre_tokenizers

    if style == "gpt2":
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "llama3":
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)
        ])
    hf = _saved_hf_dir(tmp_path, pre, ignore_merges=style == "llama3")
    tok = load_hf_dir(tmp_path)
    assert tok.bos_id == hf.token_to_id("<|begin|>") and tok.eos_id == hf.token_to_id("<|end|>")
    assert tok.chat_template.startswith("{% for m in messages")
    assert tok.ignore_merges == (style == "llama3")
    for text in VARIED + ["<|begin|>hi<|eot|>  there<|end|>", "x" * 300, "DON'T 'S  'll\r\n\r\n 1234567"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def test_load_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(ValueError, match="WordPiece"):
        load_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_dir(tmp_path)


# ---------------------------------------------------------------------------- GPT-2 / CS336 files, state
def test_gpt2_and_cs336_files_round_trip(gpt2_tok, gpt2_dir, tmp_path):
    save_gpt2_files(gpt2_tok, tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "encoder.json").read_text()) == json.loads(
        (gpt2_dir / "encoder.json").read_text())
    original = [ln for ln in (gpt2_dir / "vocab.bpe").read_text().splitlines() if ln]
    assert [ln for ln in (tmp_path / "gpt2" / "vocab.bpe").read_text().splitlines() if ln][1:] == original[1:]
    save_cs336_files(gpt2_tok, tmp_path / "cs336")
    tok = Tokenizer.from_files(tmp_path / "cs336" / "vocab.json", tmp_path / "cs336" / "merges.txt", ["<|endoftext|>"])
    assert tok.encode(VARIED[3] + "<|endoftext|>") == gpt2_tok.encode(VARIED[3] + "<|endoftext|>")
    again = load_gpt2_files(tmp_path / "gpt2" / "encoder.json", tmp_path / "gpt2" / "vocab.bpe")
    assert again.vocab == gpt2_tok.vocab and again.merges == gpt2_tok.merges


def test_files_bad_input(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({token_to_str(bytes([b])): b for b in range(256)}))
    (tmp_path / "m.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="m.txt:2: expected 'left right'"):
        Tokenizer.from_files(tmp_path / "v.json", tmp_path / "m.txt")
    with pytest.raises(FileNotFoundError, match="merges file not found"):
        Tokenizer.from_files(tmp_path / "v.json", tmp_path / "none.txt")


def test_state_round_trip_through_torch_save(smollm_tok):
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"tokenizer": tokenizer_to_state(smollm_tok)}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["tokenizer"]
    assert state["kind"] == "bpe"
    tok = tokenizer_from_state(state)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.chat_template, tok.add_bos) == (
        smollm_tok.vocab_size, smollm_tok.bos_id, smollm_tok.eos_id, smollm_tok.chat_template, smollm_tok.add_bos)
    for text in VARIED:
        assert tok.encode(text) == smollm_tok.encode(text)
    with pytest.raises(ValueError, match="kind"):
        tokenizer_from_state({"vocab": {}})
