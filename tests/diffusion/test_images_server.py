"""`POST /v1/images/generations` through the official openai client, on a tiny pipeline folder."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from scratchlm.server import BackgroundServer, ServerConfig
from scratchlm.server.cli import build_app
from tests.diffusion.helpers import tiny_pipeline

openai = pytest.importorskip("openai")


def test_openai_images_generate(tmp_path):
    from PIL import Image

    pipe = tiny_pipeline(tmp_path / "pipeline")
    app = build_app(str(tmp_path / "pipeline"), ServerConfig(api_key="k"), engine_config=None)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=60)
        res = client.images.generate(prompt="a handwritten seven", n=2, size="8x8", response_format="b64_json",
                                     extra_body={"steps": 3, "guidance_scale": 2.0, "seed": 7})
        assert len(res.data) == 2
        img = Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json)))
        assert img.size == (8, 8)
        # the same image as the pipeline itself (PNG: 8-bit rounding)
        want = pipe(["a handwritten seven"] * 2, steps=3, guidance=2.0, seed=7)[0, 0]
        got = torch.from_numpy(__import__("numpy").array(img)).float() / 127.5 - 1
        assert (got - want).abs().max().item() <= 1 / 127.5 + 1e-6
        with pytest.raises(openai.BadRequestError, match="size"):
            client.images.generate(prompt="a seven", size="1024x1024")
        with pytest.raises(openai.BadRequestError, match="b64_json"):
            client.images.generate(prompt="a seven", response_format="url")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).images.generate(prompt="a 7")
