"""diffusers model folders: sharded weights (`diffusion_pytorch_model.safetensors.index[.fp16].json`) as diffusers'
own `save_pretrained(max_shard_size=...)` writes them load into the same tensors; broken indexes are named."""

from __future__ import annotations

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion.io import index_name, load_diffusers_dir  # noqa: E402
from scratchlm.diffusion.pipeline import DiffusionPipeline  # noqa: E402
from scratchlm.diffusion.unet import UNet2DConditionModel  # noqa: E402
from scratchlm.diffusion.vae import AutoencoderKL  # noqa: E402
from tests.diffusion.helpers import sd_folder  # noqa: E402


def _tiny_vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=["DownEncoderBlock2D"] * 2,
                                   up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=4).eval()


@pytest.mark.parametrize("variant,dtype", [(None, torch.float32), ("fp16", torch.float16)])
def test_sharded_folder_loads_the_same_tensors(tmp_path, variant, dtype):
    ref = _tiny_vae().to(dtype)
    ref.save_pretrained(tmp_path, max_shard_size="20KB", variant=variant)
    assert (tmp_path / index_name(variant)).is_file() and len(list(tmp_path.glob("*-of-*.safetensors"))) > 2
    _, sd = load_diffusers_dir(tmp_path, variant)
    want = ref.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    ours = AutoencoderKL.from_pretrained(tmp_path, variant=variant)
    if variant is not None:  # the only variant there is read without naming it, as for single files
        assert torch.equal(ours.state_dict()["decoder.conv_in.weight"],
                           AutoencoderKL.from_pretrained(tmp_path).state_dict()["decoder.conv_in.weight"])


def test_sd_folder_with_a_sharded_unet_runs_the_same(tmp_path):
    src = sd_folder(tmp_path / "sd")
    pipe = DiffusionPipeline.from_pretrained(src)
    lat = pipe.initial_latents(1, seed=0)
    want = pipe(["a red fox"], steps=3, latents=lat)
    unet = diffusers.UNet2DConditionModel.from_pretrained(src / "unet")
    (src / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    unet.save_pretrained(src / "unet", max_shard_size="50KB")
    assert (src / "unet" / index_name()).is_file()
    again = DiffusionPipeline.from_pretrained(src)
    assert torch.equal(again(["a red fox"], steps=3, latents=lat), want)
    assert isinstance(again.unet, UNet2DConditionModel)


@pytest.mark.parametrize("breakage,match", [
    (lambda idx, wm: wm.update({"decoder.conv_in.bias": "../elsewhere.safetensors"}), "not a file name"),
    (lambda idx, wm: wm.update({"decoder.conv_in.bias": "missing-00009-of-00009.safetensors"}), "not found"),
    (lambda idx, wm: wm.update({"made.up.tensor": next(iter(wm.values()))}), "in no shard"),
    (lambda idx, wm: wm.pop("decoder.conv_in.bias"), "not mapped"),
])
def test_broken_index_is_named(tmp_path, breakage, match):
    _tiny_vae().save_pretrained(tmp_path, max_shard_size="20KB")
    idx = tmp_path / index_name()
    meta = json.loads(idx.read_text())
    breakage(idx, meta["weight_map"])
    idx.write_text(json.dumps(meta))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_diffusers_dir(tmp_path)
