"""The CLIP tokenizer against transformers' CLIPTokenizer (= CLIPTokenizerFast in transformers 5) on a CLIP-format
vocabulary trained here (no real CLIP vocabulary is available offline)."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from scratchlm.diffusion.clip_tokenizer import EOT, SOT, CLIPTokenizer, normalize, pre_tokenize  # noqa: E402
from scratchlm.tokenizer.formats import bytes_to_unicode  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory, data_dir):
    """Two tokenizer folders from one vocabulary: SD 1.x style (pad <|endoftext|>) and SD 2.x style (pad "!")."""
    texts = []
    for rel, n in (("tinystories/tinystories_v1_valid_head.txt", 150_000), ("wikitext2/valid.txt", 150_000)):
        texts += (data_dir / "corpora" / rel).read_text(encoding="utf-8")[:n].split("\n")
    vocab_merges = CLIPTokenizer.train(texts, 3000)
    root = tmp_path_factory.mktemp("cliptok")
    vocab_merges.save_pretrained(root / "sd1")
    CLIPTokenizer(vocab_merges.vocab, vocab_merges.merges, pad_token="!").save_pretrained(root / "sd2")
    return root


@pytest.fixture(scope="module")
def pairs(folders):
    return {name: (CLIPTokenizer.from_pretrained(folders / name), transformers.CLIPTokenizer.from_pretrained(
        folders / name)) for name in ("sd1", "sd2")}


def test_trained_vocab_layout(pairs):
    ours, hf = pairs["sd1"]
    base = list(bytes_to_unicode().values())
    assert [ours.id_to_token[i] for i in range(512)] == base + [c + "</w>" for c in base]
    assert ours.vocab[SOT] == len(ours) - 2 and ours.vocab[EOT] == len(ours) - 1
    assert len(ours.merges) == 3000 and len(hf) == len(ours)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    assert pairs["sd2"][0].pad_token_id == pairs["sd2"][1].pad_token_id == ours.vocab["!"]


HARD = [
    "a photo of an astronaut riding a horse on mars", "", " ", "\t\n", "A   CAT,\tsitting!!", "it's THE cat's toy",
    "they'RE 'll've'd", "don''t", "''s", "'", "1234567890", "3.14 x 2.5e-3", "½ ² ٣ 五", "café naïve Ǆ", "e\u0301",
    "ΑΣ ΟΔΟΣ σς", "İstanbul ß ﬁ", "漢字テスト 한국어", "😀👍🏽🇫🇷 ❤️", "a\x0bb\x0cc\x85d\u2028e\u2029f\u3000g",
    "a\x1cb\x1dc\x1ed\x1ff", "\u00a0x\u200by\ufeffz", "\x00\ufffd\x7f", "<|startoftext|>x<|endoftext|>y",
    "<|ENDOFTEXT|> <|endoftext", "</w>hi</w>", "!?!", "wow!!!", "a!b", "x" * 300, "word " * 100, "Ǳ ǲ ǳ",
]


@pytest.mark.parametrize("name", ["sd1", "sd2"])
@pytest.mark.parametrize("text", HARD)
def test_hard_cases(pairs, name, text):
    _check(*pairs[name], text)


FRAGMENTS = st.sampled_from([
    " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\x0b", "\x85", "\u2028", "\u200b", "'s", "'S", "'ll", "'RE",
    "'", "’", "\"", "!", "!!", "?!", "...", "-", "<|endoftext|>", "<|startoftext|>", "<|EndOfText|>", "</w>", "0",
    "42", "٣", "½", "😀", "👍🏽", "🇫🇷", "❤️", "Σ", "ΑΣ", "İ", "ß", "ﬁ", "漢字", "e\u0301", "Ǆ", "the", "The", "cat",
    "HOUSE", "Once", "upon", "a", "time", "little", "girl", "named", "Lily",
])
# Characters Unicode 14 (Python 3.11's tables) assigns; Cn (unassigned) and Cs (surrogates) are left out: there the
# `regex` module's newer tables and tokenizers' Oniguruma disagree about what a letter is (docstring of the module).
CHARS = st.characters(exclude_categories=("Cs", "Cn"))
TEXT = st.lists(st.one_of(FRAGMENTS, st.text(CHARS, max_size=4), FRAGMENTS.map(str.upper)), max_size=40).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, name=st.sampled_from(["sd1", "sd2"]))
def test_hypothesis_ids_equal(pairs, text, name):
    _check(*pairs[name], text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(TEXT, min_size=1, max_size=4))
def test_hypothesis_batches_longest_padding(pairs, batch):
    ours, hf = pairs["sd1"]
    want = hf(batch, padding="longest", max_length=16, truncation=True)
    got = ours(batch, padding="longest", max_length=16, return_tensors=None)
    assert got["input_ids"] == want["input_ids"] and got["attention_mask"] == want["attention_mask"]


def _check(ours, hf, text):
    want = hf(text, padding="max_length", max_length=77, truncation=True)
    got = ours(text, return_tensors=None)
    assert got["input_ids"] == want["input_ids"], (text, hf.convert_ids_to_tokens(want["input_ids"]),
                                                   ours.tokenize(text))
    assert got["attention_mask"] == want["attention_mask"]
    full = hf(text)["input_ids"]  # no truncation: every token
    assert ours.encode(text) == full
    assert ours.decode(full, skip_special_tokens=True) == hf.decode(full, skip_special_tokens=True)
    assert ours.decode(full) == hf.decode(full)


def test_tensors_and_diffusers_call(pairs):
    ours, hf = pairs["sd1"]
    prompts = ["a red cube", "x " * 120]
    want = hf(prompts, padding="max_length", max_length=hf.model_max_length, truncation=True, return_tensors="pt")
    got = ours(prompts)  # the defaults are diffusers' call
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert got["attention_mask"].tolist() == want["attention_mask"].tolist()
    assert got["input_ids"].shape == (2, 77)


def test_folder_round_trips(pairs, folders, tmp_path):
    ours, hf = pairs["sd2"]
    cfg = json.loads((folders / "sd2" / "tokenizer_config.json").read_text())
    assert cfg["pad_token"] == "!" and cfg["model_max_length"] == 77 and cfg["tokenizer_class"] == "CLIPTokenizer"
    hf.save_pretrained(tmp_path / "hf")  # transformers 5 writes tokenizer.json + tokenizer_config.json
    back = CLIPTokenizer.from_pretrained(tmp_path / "hf")
    text = "Hello, World! it's 2024 😀"
    assert back(text)["input_ids"].tolist() == ours(text)["input_ids"].tolist()
    assert back.vocab == ours.vocab and back.merges == ours.merges and back.pad_token == "!"


def test_unsupported_settings_error_by_name(folders, tmp_path):
    import shutil

    shutil.copytree(folders / "sd1", tmp_path / "t")
    cfg_path = tmp_path / "t" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "do_lower_case": False}))
    with pytest.raises(ValueError, match="do_lower_case"):
        CLIPTokenizer.from_pretrained(tmp_path / "t")
    cfg_path.write_text(json.dumps({**cfg, "strip_accents": True}))
    with pytest.raises(ValueError, match="strip_accents"):
        CLIPTokenizer.from_pretrained(tmp_path / "t")
    added = {"1": {"content": "<cat-toy>", "special": False}}
    cfg_path.write_text(json.dumps({**cfg, "added_tokens_decoder": added}))
    with pytest.raises(ValueError, match="cat-toy"):
        CLIPTokenizer.from_pretrained(tmp_path / "t")


@pytest.mark.slow
def test_every_code_point_pre_tokenizes_as_transformers(pairs):
    """All 1.1M code points in a letter / digit context: normalizer + pre-tokenizer equal to tokenizers' on every one
    Unicode 14 assigns (~70 s)."""
    _, hf = pairs["sd1"]
    norm, pre = hf.backend_tokenizer.normalizer, hf.backend_tokenizer.pre_tokenizer
    table = bytes_to_unicode()
    bad = []
    for cp in range(0x110000):
        c = chr(cp)
        if unicodedata.category(c) in ("Cs", "Cn"):
            continue
        s = f"a{c}b{c}{c}1{c}Z"
        want = [p for p, _ in pre.pre_tokenize_str(norm.normalize_str(s))]
        if want != ["".join(table[b] for b in p.encode()) for p in pre_tokenize(normalize(s))]:
            bad.append(hex(cp))
    assert not bad, bad[:20]


def test_padding_without_truncation(pairs):
    ours, hf = pairs["sd1"]
    batch = ["a short one", "word " * 90]
    for padding in ("max_length", "longest", False):
        want = hf(batch, padding=padding, max_length=20, truncation=False)
        got = ours(batch, padding=padding, max_length=20, truncation=False, return_tensors=None)
        assert got["input_ids"] == want["input_ids"] and got["attention_mask"] == want["attention_mask"]
    with pytest.raises(ValueError, match="padding"):
        ours(batch, max_length=20, truncation=False)  # ragged rows cannot make one tensor
