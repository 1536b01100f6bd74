"""A newcomer's loop from any folder: `tokenizer encode` stores the tokenizer's absolute path, training from
another folder finds it, the run folder and the checkpoint carry the tokenizer, the checkpoint generates,
and the files follow the umask (issue 17, items 3 and 10)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from scratchlm.cli import main
from scratchlm.tokenizer import Tokenizer, formats


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_encode_in_one_folder_train_in_another_then_generate(data_dir, tmp_path, monkeypatch, umask_022):
    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    text = (data_dir / "corpora" / "tinystories" / "tinystories_v1_valid_head.txt").read_text(encoding="utf-8")
    (work / "train.txt").write_text(text[:40_000], encoding="utf-8")
    (work / "val.txt").write_text(text[40_000:44_000], encoding="utf-8")
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], None)
    formats.save_hf_tokenizer_json(tok, work / "tok" / "tokenizer.json")
    assert mode(work / "tok" / "tokenizer.json") == umask_022  # not mkstemp's 0600

    monkeypatch.chdir(work)  # relative paths, as a newcomer types them
    for name in ("train", "val"):
        assert main(["tokenizer", "encode", "--tokenizer", "tok", "--input", f"{name}.txt", "--out",
                     f"{name}.bin", "--workers", "1"]) == 0
    meta = json.loads((work / "train.bin.json").read_text())
    assert meta["tokenizer"] == str(work / "tok")  # absolute: valid from any folder
    assert mode(work / "train.bin") == umask_022 and mode(work / "train.bin.json") == umask_022

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc = main(["train", "--train-data", str(work / "train.bin"), "--val-data", str(work / "val.bin"),
               "--out-dir", "run", "--batch-size", "4", "--context-length", "32", "--max-steps", "3",
               "--warmup-steps", "1", "--eval-every", "0", "--threads", "1", "--no-progress",
               "--sample-tokens", "0", "--model-d-model", "32", "--model-n-layers", "1", "--model-n-heads", "2"])
    assert rc == 0
    run = elsewhere / "run"
    assert formats.load_tokenizer(run).encode("hi") == [104, 105]  # the run folder holds the tokenizer
    from scratchlm.inference import LLM, SamplingParams

    [out] = LLM(str(run / "ckpt.pt"), threads=1).generate(["Once"], SamplingParams(temperature=0, max_tokens=4),
                                                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and isinstance(out.outputs[0].text, str)


def test_old_relative_sidecar_is_found_next_to_the_token_file(data_dir, tmp_path, monkeypatch):
    from scratchlm.training import TrainConfig
    from scratchlm.training.trainer import Trainer

    from .corpus import byte_corpus

    train, val = byte_corpus(data_dir, tmp_path / "data", train_bytes=8_000, val_bytes=2_000)
    formats.save_hf_tokenizer_json(Tokenizer({i: bytes([i]) for i in range(256)}, [], None),
                                   tmp_path / "data" / "tok" / "tokenizer.json")
    side = json.loads((tmp_path / "data" / f"{train.name}.json").read_text())
    side["tokenizer"] = "tok"  # what older `tokenizer encode` runs wrote: relative to where it ran
    (tmp_path / "data" / f"{train.name}.json").write_text(json.dumps(side))
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(train_data=str(train), out_dir=str(tmp_path / "run"), batch_size=2, context_length=16,
                      max_steps=1, warmup_steps=0, progress=False, sample_tokens=0, threads=1)
    trainer = Trainer(cfg, {"d_model": 16, "n_layers": 1, "n_heads": 2})
    assert trainer.tokenizer is not None and trainer.tokenizer.encode("a") == [97]


def test_config_by_recipe_name_from_any_folder(tmp_path, monkeypatch, capsys):
    from scratchlm.cli import build_parser
    from scratchlm.training.cli import configs_from_args

    monkeypatch.chdir(tmp_path)
    args = build_parser("train").parse_args(["train", "--config", "tinystories", "--max-steps", "7"])
    cfg, model = configs_from_args(args)
    assert cfg.batch_size == 16 and cfg.max_steps == 7 and model["d_model"] == 128
    assert main(["train", "--config", "tinystoriez"]) == 2
    assert "neither a file nor a shipped recipe (recipes: " in capsys.readouterr().err
