"""`POST /v1/images/generations` (OpenAI images API, `b64_json`) for a diffusion pipeline folder.

`scratchlm serve runs/diffusion_mnist/pipeline` builds this app instead of the LLM one (the hook is in
`server/cli.py`'s `build_app`). It reuses the LLM server's guard middleware (Host check, Bearer API
key, body limit) and its OpenAI-shaped errors. Generation runs in one worker thread (one request at a
time: the denoiser is compute-bound, batching several requests' images is left to `n`).

The folder is either scratchlm's DiT pipeline or a Stable Diffusion one (diffusers layout; see
`diffusion/pipeline.py`): the same route serves both.

Request: `prompt` (required), `n` (1..16), `size` ("WxH" in pixels: each side a multiple of the VAE's factor, 8
for SD, up to 4x the native side; default the native size, which maps to the model's latent size), `response_format`
("b64_json"; "url" is refused: this server stores no files), `model` (optional, must match), `user` (accepted,
changes nothing), and the scratchlm extensions `negative_prompt`, `steps` (1..1000, default 25), `guidance_scale`
(default 7.5 for SD folders, 3 otherwise), `guidance_rescale` (0..1), `sampler` (one of `SAMPLERS`; default the
folder's scheduler), `seed`. Unknown fields, and OpenAI's `quality` / `style` set to anything but null, are a 400
naming the field (nothing is silently ignored). Response: `{"created": ..., "data": [{"b64_json": PNG,
"revised_prompt": null}]}`.

Also served: `/` (static/images.html: a prompt box, with a negative prompt, that posts to
`/v1/images/generations` and shows the PNGs; its guidance field and prompt start at the model's default and
example, which `/v1/models` gives as the extensions `default_guidance_scale` and `example_prompt`),
`/favicon.svg`, `/health`, `/v1/models` and `/metrics`
(Prometheus text: requests, images, generation seconds), so the start-up line of `scratchlm serve` ("playground
at /, metrics at /metrics") holds for this app too.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import Field, field_validator

from scratchlm.server.app import STATIC_DIR, GuardMiddleware, error_response
from scratchlm.server.config import ServerConfig
from scratchlm.server.protocol import UNSUPPORTED, StrictModel, unsupported

log = logging.getLogger("scratchlm.server.images")


class ImageRequest(StrictModel):
    prompt: str = Field(min_length=1, max_length=1000)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=16)
    size: str | None = None
    response_format: str = "b64_json"
    quality: str | None = Field(None, description="not supported: 400 unless null")
    style: str | None = Field(None, description="not supported: 400 unless null")
    user: str | None = None
    negative_prompt: str | None = Field(default=None, max_length=1000)
    steps: int = Field(default=25, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=50.0)
    guidance_rescale: float = Field(default=0.0, ge=0.0, le=1.0)
    sampler: str | None = None
    seed: int | None = None

    @field_validator("quality", "style")
    @classmethod
    def _null_only(cls, value, info):
        if value is not None:
            raise unsupported(info.field_name)
        return value


@dataclass
class ImagesState:
    pipeline: object
    model_name: str
    config: ServerConfig
    pool: ThreadPoolExecutor
    lock: threading.Lock
    engine: object = None  # `scratchlm serve` looks for an engine's runner; there is none here
    requests: int = 0  # finished generation requests (counted under `lock`, read by /metrics)
    images: int = 0
    seconds: float = 0.0

    def metrics_text(self) -> str:
        """Prometheus text exposition of the counters."""
        rows = [("scratchlm_image_requests_total", "finished image generation requests", self.requests),
                ("scratchlm_images_generated_total", "images generated", self.images),
                ("scratchlm_image_generation_seconds_total", "seconds spent generating", round(self.seconds, 3))]
        return "".join(f"# HELP {n} {h}\n# TYPE {n} counter\n{n} {v}\n" for n, h, v in rows)


def _png_b64(img) -> str:
    from PIL import Image

    arr = ((img.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()  # (H, W, C)
    buf = io.BytesIO()
    Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _latent_size(pipe, size: str) -> tuple[int, int]:
    """The latent (h, w) for an OpenAI `size` "WxH": multiples of the VAE's factor, at most 4x the native side."""
    from scratchlm.diffusion.pipeline import parse_size

    if "x" not in size:
        raise ValueError(f"size {size!r} is not WxH")
    h, w = parse_size(size)
    nh, nw = pipe.image_hw
    if h > 4 * nh or w > 4 * nw:
        raise ValueError(f"size {size!r} is not supported: at most {4 * nw}x{4 * nh}")
    return pipe.latent_size_for((h, w))


def create_images_app(path: str | Path, config: ServerConfig | None = None, model_name: str | None = None) -> FastAPI:
    """The images-only app around the pipeline folder at `path`."""
    from scratchlm.diffusion.pipeline import DiffusionPipeline
    from scratchlm.diffusion.schedulers import SAMPLERS, make_sampler

    config = config or ServerConfig()
    path = Path(path)
    pipe = DiffusionPipeline.from_pretrained(path)
    name = config.served_model_name or model_name or (path.name if path.name != "pipeline" else path.parent.name)
    state = ImagesState(pipe, name, config, ThreadPoolExecutor(1, thread_name_prefix="scratchlm-images"),
                        threading.Lock())
    for note in pipe.notes:
        log.warning(note)
    native_h, native_w = pipe.image_hw
    native = f"{native_w}x{native_h}"
    app = FastAPI(title="scratchlm images server", version="0.1.0")
    app.state.server = state

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        code = UNSUPPORTED if err.get("type") in ("extra_forbidden", UNSUPPORTED) else None
        return error_response(400, f"Invalid request: {where}: {err.get('msg', 'invalid value')}", param=where,
                              code=code)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "images.html").read_text(encoding="utf-8"))

    @app.get("/favicon.ico", include_in_schema=False)
    @app.get("/favicon.svg", include_in_schema=False)
    async def favicon() -> Response:
        return Response((STATIC_DIR / "favicon.svg").read_bytes(), media_type="image/svg+xml",
                        headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        # default_guidance_scale, size, example_prompt: scratchlm extensions (the page at / starts from them)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "scratchlm",
                                            "default_guidance_scale": pipe.default_guidance, "size": native,
                                            "example_prompt": pipe.example_prompt}]}

    @app.post("/v1/images/generations")
    async def generations(req: ImageRequest):
        if req.model not in (None, name):
            return error_response(404, f"The model {req.model!r} does not exist; this server serves {name!r}.",
                                  param="model", code="model_not_found")
        if req.response_format != "b64_json":
            return error_response(400, f"response_format {req.response_format!r} is not supported: only "
                                       "'b64_json' (this server stores no files to link to)", param="response_format")
        try:
            latent = None if req.size in (None, native) else _latent_size(pipe, req.size)
        except ValueError as e:
            return error_response(400, f"{e} (this model's native size is {native})", param="size")
        if req.sampler is not None and req.sampler not in SAMPLERS:
            return error_response(400, f"sampler {req.sampler!r} is not one of {sorted(SAMPLERS)}", param="sampler")
        if req.sampler is not None:
            try:  # e.g. ddim on a folder whose schedule has Karras sigmas
                make_sampler(req.sampler, pipe.schedule)
            except ValueError as e:
                return error_response(400, f"sampler {req.sampler!r}: {e}", param="sampler")
        seed = req.seed if req.seed is not None else int(time.time_ns() % (2**31))

        def work():
            with state.lock:
                t = time.perf_counter()
                neg = None if req.negative_prompt is None else [req.negative_prompt] * req.n
                out = pipe([req.prompt] * req.n, steps=req.steps, guidance=req.guidance_scale,
                           sampler=req.sampler, seed=seed, negative_prompts=neg, size=latent,
                           guidance_rescale=req.guidance_rescale)
                state.requests, state.images = state.requests + 1, state.images + req.n
                state.seconds += time.perf_counter() - t
                return out

        t0 = time.perf_counter()
        images = await asyncio.get_running_loop().run_in_executor(state.pool, work)
        log.info("generated %d image(s) for %r in %.2f s", req.n, req.prompt[:60], time.perf_counter() - t0)
        return {"created": int(time.time()), "data": [{"b64_json": _png_b64(img), "revised_prompt": None}
                                                      for img in images]}

    app.add_middleware(GuardMiddleware, config=config)
    return app
