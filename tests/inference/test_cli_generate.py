"""`scratchlm generate` and the model loader when given the wrong kind of path: a run folder, a token file,
a tokenizer folder (issue 17, item 5); its help names the checkpoint that training writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scratchlm.cli import main
from scratchlm.model.loading import CheckpointError, detect_format


def test_run_folder_points_at_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"PK\x03\x04")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointError, match=rf"training run folder.*pass its checkpoint, {run / 'ckpt.pt'}"):
        detect_format(run)


def test_token_file_is_named_as_training_data(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    (tmp_path / "train.bin.json").write_text(json.dumps({"dtype": "uint16", "count": 100}))
    with pytest.raises(CheckpointError, match=r"token file written by `scratchlm tokenizer encode`.*--train-data"):
        detect_format(path)
    (tmp_path / "train.bin.json").unlink()  # no sidecar: the llama2.c reader's refusal still says what it is
    from scratchlm.model.loading import load

    with pytest.raises(CheckpointError, match=r"implausible header.*token files .* --train-data"):
        load(path)


def test_tokenizer_folder_is_not_a_model(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds a tokenizer but no model.*--tokenizer"):
        detect_format(tmp_path)


def test_generate_cli_reports_a_run_folder_cleanly(tmp_path, capsys):
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04")
    assert main(["generate", "--model", str(tmp_path), "--threads", "1", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scratchlm generate: ") and str(tmp_path / "ckpt.pt") in err


def test_generate_help_names_ckpt_pt(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "runs/tiny/ckpt.pt" in out and "checkpoint.pt" not in out


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scratchlm", "generate", "--threads", "1", "--max-tokens", "6",
                           *args], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[2])


def test_generate_trace_quantization_and_the_missing_chat_template(data_dir, tmp_path):
    """docs/inspector.md's `generate --trace FILE` writes strict JSON; `--quantization` as serve's; `--chat` on a
    model without a chat template says so once (issue 30, item 14)."""
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    trace = tmp_path / "gen.json"
    res = _generate("--model", str(model), "--trace", str(trace), "--quantization", "int8", "-v", "--chat", "Once")
    assert res.returncode == 0, res.stderr
    events = json.loads(trace.read_text())
    assert sum(str(e.get("name")).startswith("step ") for e in events) >= 6
    assert "quantized model with int8" in res.stderr
    assert res.stderr.count("has no chat template") == 1, res.stderr
    res = _generate("--model", str(model), "--quantization", "int3", "Once")
    assert res.returncode == 2 and "quantization='int3'" in res.stderr and "Traceback" not in res.stderr, res.stderr
