"""The training bar counts against the budget that ends the run (issue 17, item 6)."""

from __future__ import annotations

import pytest

from scratchlm.training.progress import format_eta, run_progress


def test_time_budget_that_ends_first_drives_progress_and_eta():
    # 100 000 max steps at 10 steps/s, 600 s budget: after 60 s it is 10 % done with 9 minutes left, not 0.6 %
    p = run_progress(step=600, last_step=100_000, elapsed_s=60, max_time_s=600, steps_per_s=10)
    assert p.limit == "time" and p.fraction == pytest.approx(0.1) and p.eta_s == pytest.approx(540)
    end = run_progress(step=6000, last_step=100_000, elapsed_s=600.2, max_time_s=600, steps_per_s=10)
    assert end.fraction == 1.0 and end.eta_s == 0


def test_steps_that_end_first_drive_progress_and_eta():
    p = run_progress(step=50, last_step=100, elapsed_s=5, max_time_s=3600, steps_per_s=10)
    assert p.limit == "steps" and p.fraction == 0.5 and p.eta_s == pytest.approx(5)
    assert run_progress(50, 100, 5, None, 10) == p
    assert run_progress(1, 100, 0.1, None, None).eta_s is None  # no rate yet


def test_format_eta():
    assert format_eta(None) == "?" and format_eta(75) == "01:15" and format_eta(39 * 3600 + 61) == "39:01:01"


def test_time_budgeted_run_ends_at_100_percent(data_dir, tmp_path, capsys):
    from scratchlm.training import TrainConfig
    from scratchlm.training.trainer import Trainer

    from .corpus import byte_corpus

    train, _ = byte_corpus(data_dir, tmp_path / "data", train_bytes=8_000, val_bytes=2_000)
    cfg = TrainConfig(train_data=str(train), out_dir=str(tmp_path / "run"), batch_size=2, context_length=16,
                      max_steps=100_000, max_time_s=1.0, warmup_steps=0, progress=True, sample_tokens=0, threads=1)
    result = Trainer(cfg, {"d_model": 16, "n_layers": 1, "n_heads": 2}).train()
    assert 0 < result.final_step < 100_000
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in last and "time budget 1 s" in last and f"step {result.final_step}" in last, last
