"""`scratchlm tokenizer train|encode` end to end, and the parallel corpus encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scratchlm.cli import main
from scratchlm.tokenizer import Tokenizer, train_bpe
from scratchlm.tokenizer.encode_corpus import encode_corpus, read_token_file, token_dtype
from scratchlm.tokenizer.formats import load_tokenizer
from tests.tokenizer.test_bpe import EOT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, data_dir):
    """~200 KB: TinyStories with <|endoftext|> between stories, plus some Shakespeare."""
    stories = (data_dir / "corpora" / "tinystories" / "tinystories_v1_valid_head.txt").read_text(encoding="utf-8")
    shakespeare = (data_dir / "corpora" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    text = EOT.join(stories[:150_000].split("\n\n")) + shakespeare[:60_000] + " ünï 😀 日本"
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    rc = main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "700", "--special-token", EOT,
               "--out", str(out), "--chunk-mb", "0.05", "--workers", "2"])
    assert rc == 0
    return out


def test_train_cli_writes_all_formats(trained_dir, corpus):
    for name in ["tokenizer.json", "vocab.json", "merges.txt", "encoder.json", "vocab.bpe", "tokenizer_config.json"]:
        assert (trained_dir / name).is_file(), name
    vocab, merges = train_bpe(corpus, 700, [EOT], num_workers=1, progress=False)
    tok = load_tokenizer(trained_dir)
    assert tok.merges == merges and tok.vocab == vocab  # parallel chunked == single process
    assert tok.eos_id == tok.special_ids[EOT]
    cs336 = Tokenizer.from_files(trained_dir / "vocab.json", trained_dir / "merges.txt", [EOT])
    text = corpus.read_text(encoding="utf-8")
    assert cs336.encode(text) == tok.encode(text)


def test_hf_loads_trained_tokenizer_json_identically(trained_dir, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(trained_dir / "tokenizer.json"))
    tok = load_tokenizer(trained_dir)
    text = corpus.read_text(encoding="utf-8")
    assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)


@pytest.mark.parametrize("workers", [1, 2])
def test_encode_cli_equals_whole_file_encode(trained_dir, corpus, tmp_path, workers):
    out = tmp_path / "corpus.bin"
    rc = main(["tokenizer", "encode", "--tokenizer", str(trained_dir), "--input", str(corpus), str(corpus),
               "--out", str(out), "--workers", str(workers), "--block-mb", "0.02"])
    assert rc == 0
    meta = json.loads((tmp_path / "corpus.bin.json").read_text())
    tok = load_tokenizer(trained_dir)
    expected = tok.encode(corpus.read_text(encoding="utf-8")) * 2
    assert meta == {"dtype": "uint16", "count": len(expected), "vocab_size": 700, "tokenizer": str(trained_dir),
                    "source": [str(corpus), str(corpus)], "bytes": 2 * corpus.stat().st_size}
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    assert read_token_file(out).tolist() == expected
    assert not list(tmp_path.glob(".*tmp"))  # temp files renamed away


def test_uint32_when_vocab_is_large(tmp_path):
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    vocab = {i: bytes([i]) for i in range(256)} | {70_000: b"zz"}
    tok = Tokenizer(vocab, [(b"z", b"z")])
    (tmp_path / "t.txt").write_text("zzz zz")
    meta = encode_corpus(tok, [tmp_path / "t.txt"], tmp_path / "t.bin", num_workers=1, progress=False)
    assert meta["dtype"] == "uint32"
    assert read_token_file(tmp_path / "t.bin").tolist() == tok.encode("zzz zz") == [70_000, ord("z"), 32, 70_000]


def test_cli_errors(tmp_path, capsys, trained_dir):
    assert main(["tokenizer", "train", "--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path)]) == 2
    assert main(["tokenizer", "train", "--out", str(tmp_path)]) == 2
    assert main(["tokenizer", "encode", "--tokenizer", str(tmp_path), "--input", "x", "--out", "y"]) == 2
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_dir), "--input", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "o.bin")]) == 2
    assert not (tmp_path / "o.bin").exists()
    with pytest.raises(SystemExit):
        main(["tokenizer", "train", "--vocab-size", "many"])
