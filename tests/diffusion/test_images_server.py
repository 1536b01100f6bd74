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


def test_diffusion_serve_page_and_its_fetch_targets(tmp_path):
    """`scratchlm diffusion serve PIPELINE` in a real process: the start-up line names the playground at / and
    metrics at /metrics; both answer, and the page's fetch targets answer the requests the page sends
    (GET /v1/models, POST /v1/images/generations -> PNGs)."""
    import re
    import socket
    import subprocess
    import sys
    import time

    import httpx
    from PIL import Image

    tiny_pipeline(tmp_path / "digits")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "scratchlm", "diffusion", "serve", str(tmp_path / "digits"),
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "scratchlm diffusion serve did not answer /health within 120 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        page = httpx.get(url + "/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        targets = set(re.findall(r'fetch\("([^"]+)"', page.text))
        assert targets == {"/v1/models", "/v1/images/generations"}, targets
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == "digits" and card["example_prompt"] == "a handwritten seven"
        assert "example_prompt" in page.text and 'value="a handwritten seven"' not in page.text  # from the model
        body = {"prompt": "a handwritten seven", "n": 2, "steps": 5, "guidance_scale": 3, "seed": 1,
                "response_format": "b64_json"}  # the fields the page sends
        res = httpx.post(url + "/v1/images/generations", json=body, timeout=60)
        assert res.status_code == 200, res.text
        imgs = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in res.json()["data"]]
        assert [im.size for im in imgs] == [(8, 8)] * 2
        assert httpx.get(url + "/favicon.svg", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10)
        assert metrics.status_code == 200 and "scratchlm_images_generated_total 2" in metrics.text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert re.search(rf"serving digits on {re.escape(url)} \(playground at /, .*metrics at /metrics", out), out


def test_openai_images_on_a_stable_diffusion_folder(tmp_path):
    """The same route serves an SD folder: size maps to the latent size, negative_prompt is honoured, the folder's
    own scheduler runs, and unsupported fields are refused by name."""
    import numpy as np
    from PIL import Image

    pytest.importorskip("diffusers")
    from scratchlm.diffusion.pipeline import DiffusionPipeline
    from tests.diffusion.helpers import sd_folder

    sd_folder(tmp_path / "sd", "EulerDiscreteScheduler")
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "sd")
    app = build_app(str(tmp_path / "sd"), ServerConfig(), engine_config=None)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        assert card.default_guidance_scale == 7.5 and card.size == "16x16"  # the page's defaults
        assert "seven" not in card.example_prompt and card.example_prompt == pipe.example_prompt  # not MNIST's
        res = client.images.generate(prompt="a red fox", size="24x16", response_format="b64_json",
                                     extra_body={"steps": 3, "seed": 7, "negative_prompt": "blurry"})
        img = np.array(Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))))
        assert img.shape == (16, 24, 3)
        want = pipe(["a red fox"], steps=3, seed=7, negative_prompts=["blurry"], size=(8, 12))[0]  # guidance 7.5
        got = torch.from_numpy(img).permute(2, 0, 1).float() / 127.5 - 1
        assert (got - want).abs().max().item() <= 1 / 127.5 + 1e-6
        assert Image.open(io.BytesIO(base64.b64decode(client.images.generate(
            prompt="a dog", extra_body={"steps": 1}).data[0].b64_json))).size == (16, 16)  # native: 8x8 latents
        for kw, field in [({"size": "15x16"}, "size"), ({"size": "256x256"}, "size"), ({"quality": "hd"}, "quality"),
                          ({"extra_body": {"made_up": 1}}, "made_up"),
                          ({"extra_body": {"sampler": "no_such_sampler"}}, "sampler")]:
            with pytest.raises(openai.BadRequestError, match=field):
                client.images.generate(prompt="a dog", **kw)
