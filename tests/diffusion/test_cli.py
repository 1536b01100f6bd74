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


def test_sample_sd_folder_positional_prompt_negative_and_size(tmp_path, capsys):
    import numpy as np
    import pytest
    import torch
    from PIL import Image

    pytest.importorskip("diffusers")
    from scratchlm.diffusion.pipeline import DiffusionPipeline
    from tests.diffusion.helpers import sd_folder

    sd_folder(tmp_path / "sd", "PNDMScheduler")
    out = tmp_path / "fox.png"
    rc = main(["diffusion", "sample", "--model", str(tmp_path / "sd"), "a red fox in the snow", "--negative-prompt",
               "blurry", "--n", "2", "--size", "24x16", "--steps", "3", "--guidance", "5", "--seed", "4",
               "--threads", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and "note:" not in err  # PNDM runs as itself: nothing mapped, nothing to say
    img = np.array(Image.open(out))
    assert img.shape == (16 + 2, 2 * (24 + 2), 3)  # one row of two 24x16 RGB images with 2-px gaps
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "sd")
    want = pipe(["a red fox in the snow"] * 2, steps=3, guidance=5.0, seed=4, negative_prompts=["blurry"] * 2,
                size=(8, 12))
    want = ((want[0] + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.abs(img[:16, :24].astype(int) - want.astype(int)).max() <= 1

    assert main(["diffusion", "sample", "--model", str(tmp_path / "sd"), "x", "--size", "15x16"]) == 2
    assert "multiples of 2" in capsys.readouterr().err
    assert main(["diffusion", "sample", "--model", str(tmp_path / "sd")]) == 2
    assert "no prompt" in capsys.readouterr().err


def test_serve_takes_model_as_flag_or_positional_not_two(tmp_path, capsys):
    rc = main(["diffusion", "serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")])
    assert rc == 2 and "two models given" in capsys.readouterr().err


def test_sample_sdxl_folder(tmp_path, capsys):
    import pytest
    from PIL import Image

    pytest.importorskip("diffusers")
    from tests.diffusion.helpers import sdxl_folder

    sdxl_folder(tmp_path / "xl")
    out = tmp_path / "xl.png"
    rc = main(["diffusion", "sample", "--model", str(tmp_path / "xl"), "a dog", "--steps", "2", "--threads", "1",
               "--out", str(out)])
    assert rc == 0 and Image.open(out).size == (16 + 2, 16 + 2)  # --n defaults to 1 for SD folders
