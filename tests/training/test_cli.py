"""`scratchlm train` end to end: TOML config + flag overrides, a tokenizer stored in the checkpoint, and
the checkpoint read back by the model loader (`scratchlm.model.load`) with identical logits."""

import json

import pytest
import torch

from scratchlm.cli import main
from scratchlm.tokenizer import Tokenizer, formats

from .corpus import byte_corpus


@pytest.fixture()
def setup(data_dir, tmp_path):
    train, val = byte_corpus(data_dir, tmp_path / "data", train_bytes=30_000, val_bytes=3_000)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    formats.save_hf_tokenizer_json(Tokenizer({i: bytes([i]) for i in range(256)}, [], None), tok_dir / "tokenizer.json")
    config = tmp_path / "run.toml"
    config.write_text(
        f'train_data = "{train}"\nval_data = "{val}"\ntokenizer = "{tok_dir}"\nout_dir = "{tmp_path / "out"}"\n'
        "batch_size = 4\ncontext_length = 32\nmax_steps = 50\nwarmup_steps = 2\neval_every = 0\nlog_every = 1\n"
        'threads = 1\nprogress = false\nsample_prompts = ["once upon"]\nsample_tokens = 8\n'
        "[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\n"
    )
    return config, tmp_path


def test_config_file_plus_overrides_and_model_load(setup, capsys):
    config, tmp_path = setup
    rc = main(["train", "--config", str(config), "--max-steps", "6", "--model-n-layers", "2", "--lr", "0.002"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bits/byte" in out and "checkpoint:" in out
    records = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 6  # the flag overrode the file's max_steps = 50
    ckpt_path = tmp_path / "out/ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["train_config"]["lr"] == 0.002 and ckpt["model_config"]["n_layers"] == 2
    assert (tmp_path / "out/samples.txt").read_text().startswith("once upon")

    from scratchlm.model import ModelConfig, TransformerLM, load

    loaded = load(ckpt_path)
    assert loaded.config.n_layers == 2 and loaded.tokenizer.encode("hi") == [104, 105]
    reference = TransformerLM(ModelConfig.from_dict(ckpt["model_config"]))
    reference.load_state_dict(ckpt["model"])
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), reference(x))


def test_bad_inputs_exit_2_with_a_message(setup, capsys, tmp_path):
    config, _ = setup
    assert main(["train", "--config", str(config), "--train-data", str(tmp_path / "nope.bin")]) == 2
    assert "token file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = 4\nlearning_rate = 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown option(s) ['learning_rate']" in capsys.readouterr().err
    bad.write_text("[model]\nwidth = 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown model option(s) ['width']" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--model-vocab-size", "100"]) == 2
    assert "vocab_size is 100" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--resume", str(tmp_path / "missing.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_tokenizer_larger_than_model_vocab_is_an_error(setup, capsys, tmp_path):
    config, _ = setup
    big = Tokenizer({i: bytes([i]) for i in range(256)} | {256: b"th", 257: b"he"}, [(b"t", b"h"), (b"h", b"e")], None)
    tok_dir = tmp_path / "bigtok"
    tok_dir.mkdir()
    formats.save_hf_tokenizer_json(big, tok_dir / "tokenizer.json")
    assert main(["train", "--config", str(config), "--tokenizer", str(tok_dir), "--model-vocab-size", "256"]) == 2
    assert "the tokenizer has 258 ids but the model's vocab_size is 256" in capsys.readouterr().err


def test_every_validation_loss_is_printed_on_the_console(setup, capsys):
    """Not only in metrics.jsonl: each evaluation prints a line on stdout, the final one once (issue 30, item 14)."""
    config, tmp_path = setup
    assert main(["train", "--config", str(config), "--max-steps", "4", "--eval-every", "2",
                 "--sample-tokens", "0"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert out.count(f"step {r['step']}: val loss {r['val_loss']:.4f}") == 1, out
