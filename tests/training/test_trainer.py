import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from scratchlm.training import CheckpointError, TrainConfig
from scratchlm.training.trainer import Trainer

from . import engine_fixture
from .corpus import byte_corpus, write_token_file

TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "rope_layout": "adjacent"}


@pytest.fixture(scope="module")
def corpus(data_dir, tmp_path_factory):
    return byte_corpus(data_dir, tmp_path_factory.mktemp("corpus"))


def tiny_config(corpus, out_dir, **kw) -> TrainConfig:
    train, val = corpus
    base = dict(train_data=train, val_data=val, out_dir=out_dir, batch_size=8, context_length=32, max_steps=12,
                warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=6, eval_tokens=1024, log_every=1,
                checkpoint_every=0, progress=False, sample_tokens=0, seed=7, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def test_training_learns_and_writes_everything(corpus, tmp_path):
    cfg = tiny_config(corpus, tmp_path / "run", max_steps=40, eval_every=20)
    result = Trainer(cfg, TINY_MODEL).train()
    assert len(result.losses) == 40 and result.final_step == 40
    # a uniform guess over 256 bytes costs ln(256) = 5.55 nats; 40 steps must do much better
    assert result.losses[0] > 5.0 and result.losses[-1] < 3.6
    step, final = result.evals[-1]
    assert step == 40 and final.loss < 3.6
    assert final.tokens == 8_000 - 1  # the whole validation file, every token after the first
    assert final.bits_per_byte == pytest.approx(final.loss / math.log(2))  # byte tokens: 1 byte per token
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert all(0 < r["mfu"] < 1 and r["tok_per_s"] > 0 for r in records if "mfu" in r)
    assert (tmp_path / "run/loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    ckpt = torch.load(result.checkpoint, weights_only=True)
    assert ckpt["format"] == "scratchlm" and ckpt["step"] == 40
    assert ckpt["model_config"]["vocab_size"] == 256 and ckpt["model_config"]["max_seq_len"] == 32


def test_resume_is_bit_exact(corpus, tmp_path):
    full = Trainer(tiny_config(corpus, tmp_path / "full"), TINY_MODEL).train()
    first = Trainer(tiny_config(corpus, tmp_path / "part", stop_at_step=5), TINY_MODEL).train()
    assert first.final_step == 5
    second = Trainer(tiny_config(corpus, tmp_path / "part2", resume=first.checkpoint), TINY_MODEL).train()
    assert first.losses + second.losses == full.losses  # exact float equality, step by step
    assert second.evals[-1][1].loss == full.evals[-1][1].loss


def test_gradient_accumulation_matches_one_big_batch(corpus, tmp_path):
    one = Trainer(tiny_config(corpus, tmp_path / "a", max_steps=6), TINY_MODEL).train()
    accum = Trainer(tiny_config(corpus, tmp_path / "b", max_steps=6, grad_accum_steps=4), TINY_MODEL).train()
    np.testing.assert_allclose(accum.losses, one.losses, rtol=2e-5, atol=2e-5)


def test_alternative_engine_by_module_path(corpus, tmp_path):
    engine_fixture.CALLS.clear()
    ref = Trainer(tiny_config(corpus, tmp_path / "a", max_steps=4, eval_every=0), TINY_MODEL).train()
    alt = Trainer(tiny_config(corpus, tmp_path / "b", max_steps=4, eval_every=0,
                              engine="tests.training.engine_fixture:loss_and_grads"), TINY_MODEL).train()
    assert len(engine_fixture.CALLS) == 4
    np.testing.assert_allclose(alt.losses, ref.losses, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown gradient engine 'nope'"):
        Trainer(tiny_config(corpus, tmp_path / "c", engine="nope"), TINY_MODEL)


def test_time_budget_stops_the_run(corpus, tmp_path):
    result = Trainer(tiny_config(corpus, tmp_path / "t", max_steps=10_000, max_time_s=1.0, eval_every=0),
                     TINY_MODEL).train()
    assert 1 <= result.final_step < 10_000
    assert result.elapsed_s >= 1.0
    assert result.checkpoint.is_file()


def test_resume_refuses_a_different_config(corpus, tmp_path):
    first = Trainer(tiny_config(corpus, tmp_path / "p", stop_at_step=2), TINY_MODEL).train()
    with pytest.raises(ValueError, match=r"config mismatch: .*model.d_model: checkpoint 32 != now 64"):
        Trainer(tiny_config(corpus, tmp_path / "q", resume=first.checkpoint), {**TINY_MODEL, "d_model": 64})
    with pytest.raises(ValueError, match="batch_size: checkpoint 8 != now 16"):
        Trainer(tiny_config(corpus, tmp_path / "q", resume=first.checkpoint, batch_size=16), TINY_MODEL)


def test_resume_from_corrupt_checkpoint_is_a_clear_error(corpus, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x02garbage")
    with pytest.raises(CheckpointError, match="bad.pt: not a readable checkpoint"):
        Trainer(tiny_config(corpus, tmp_path / "r", resume=bad), TINY_MODEL)
    torch.save({"model": {}}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="lacks"):
        Trainer(tiny_config(corpus, tmp_path / "r", resume=tmp_path / "partial.pt"), TINY_MODEL)


def test_bad_corpus_and_vocab_errors(corpus, tmp_path):
    empty = write_token_file(tmp_path / "empty.bin", np.array([], dtype=np.uint16))
    with pytest.raises(ValueError, match="empty"):
        Trainer(tiny_config(corpus, tmp_path / "e", train_data=empty), TINY_MODEL)
    with pytest.raises(ValueError, match="token file not found"):
        Trainer(tiny_config(corpus, tmp_path / "e", train_data=tmp_path / "missing.bin"), TINY_MODEL)
    with pytest.raises(ValueError, match="uses a vocabulary of 256 ids but the model's vocab_size is 100"):
        Trainer(tiny_config(corpus, tmp_path / "e"), {**TINY_MODEL, "vocab_size": 100})
    with pytest.raises(ValueError, match="not divisible by grad_accum_steps=3"):
        Trainer(tiny_config(corpus, tmp_path / "e", grad_accum_steps=3), TINY_MODEL)
    with pytest.raises(ValueError, match="train_data is not set"):
        Trainer(dataclasses.replace(tiny_config(corpus, tmp_path / "e"), train_data=None), TINY_MODEL)
