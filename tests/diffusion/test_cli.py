"""`scratchlm diffusion sample` writes a PNG grid; bad arguments are refused with a message."""

from __future__ import annotations

from scratchlm.cli import main
from tests.diffusion.helpers import tiny_pipeline


def test_sample_writes_grid(tmp_path, capsys):
    from PIL import Image

    tiny_pipeline(tmp_path / "pipe")
    out = tmp_path / "grid.png"
    rc = main(["diffusion", "sample", "--model", str(tmp_path / "pipe"), "--prompt", "a handwritten seven",
               "--prompt", "the digit 1", "--n", "3", "--steps", "2", "--out", str(out)])
    assert rc == 0 and out.is_file()
    assert Image.open(out).size == (3 * 10, 2 * 10)  # 8x8 images with 2-px gaps, one row per prompt


def test_sample_missing_model(tmp_path, capsys):
    rc = main(["diffusion", "sample", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    assert rc == 2 and "model_index.json" in capsys.readouterr().err
