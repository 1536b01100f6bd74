"""Component pipelining on real processes (gloo): the pipelined images equal the serial run's, request for request,
in queue order with their ids, on both layouts; a dead stage fails the job fast, naming it."""

from __future__ import annotations

import time

import pytest
import torch

from scratchlm.diffusion import components as cp
from scratchlm.diffusion.pipeline import DiffusionPipeline
from tests.diffusion.helpers import sd_folder, sdxl_folder, tiny_pipeline

FOLDERS = {"dit": tiny_pipeline, "sd": sd_folder, "sdxl": sdxl_folder}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one thread (the spawned ranks take theirs from `launch`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _queue(n: int = 5) -> list[cp.ImageRequest]:
    """Mixed requests: batch sizes, steps, guidance (1.0: no unconditional branch; None: the pipeline's default),
    samplers (None: the folder's), negative prompts (None: the pipeline's rule)."""
    prompts = ["a handwritten one", "the digit 4", "seven", "a dog", "the number two", "a photo of a cat"]
    return [cp.ImageRequest(id=f"req-{k}", prompts=tuple(prompts[k % 6:k % 6 + 1 + k % 2]), seed=10 + k,
                            steps=2 + k % 3, guidance=(3.0, 1.0, None)[k % 3], sampler=("ddim", None, "euler")[k % 3],
                            negative_prompt=None if k % 4 else "blurry")
            for k in range(n)]


def _check_equal(got: dict, want: dict, reqs: list[cp.ImageRequest]) -> None:
    assert [r["id"] for r in got["results"]] == [q.id for q in reqs]  # ids, in queue order
    assert [r["index"] for r in got["results"]] == list(range(len(reqs)))
    for a, b, q in zip(got["results"], want["results"], reqs):
        assert a["images"].shape == b["images"].shape and a["images"].shape[0] == len(q.prompts)
        assert (a["images"] - b["images"]).abs().max().item() <= 1e-5
        assert a["latency_s"] > 0 and a["stages"]["text"][0] <= a["stages"]["vae"][1]


def test_layout_rules():
    assert cp.rank_names("text|denoise|vae") == ["text", "denoise", "vae"]
    assert cp.rank_names("vae+text|denoise|denoise") == ["text+vae", "denoise", "denoise"]
    for bad, why in [("text|vae", "no denoiser"), ("text|denoise+vae", "mixes the denoiser"),
                     ("text|denoise|vae|vae", "exactly one rank"), ("text|unet|vae", "unknown roles")]:
        with pytest.raises(ValueError, match=why):
            cp.parse_layout(bad)
    with pytest.raises(ValueError, match="no prompts"):
        cp.ImageRequest(id="x", prompts=())


@pytest.mark.parametrize("kind", ["dit", "sd", "sdxl"])
def test_serial_service_is_the_pipeline(tmp_path, kind):
    """The three stages one after another are the pipeline's own text-to-image call, request for request (DiT,
    SD and SDXL pipelines: SDXL's pooled text and zeroed empty negative prompt travel with the text stage)."""
    FOLDERS[kind](tmp_path)
    stages = cp.Stages(DiffusionPipeline.from_pretrained(tmp_path))
    reqs = _queue(3)
    out = cp.serial_service(stages, reqs)
    for r, q in zip(out["results"], reqs):
        assert torch.equal(r["images"], stages.reference(q))
    s = cp.summarize([out])
    assert s["n"] == 3 and set(s["stages"]) == {"text", "denoise", "vae"}
    assert all(0 < st["utilisation"] <= 1 for st in s["stages"].values())
    assert sum(st["busy_s"] for st in s["stages"].values()) <= s["makespan_s"]


def test_percentiles():
    assert cp._percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert cp._percentile([float(x) for x in range(1, 101)], 0.95) == pytest.approx(95.05)


@pytest.mark.distributed
@pytest.mark.parametrize("kind,layout", [("sd", "text|denoise|vae"), ("sd", "text+vae|denoise|denoise"),
                                         ("dit", "text+vae|denoise|denoise"), ("sdxl", "text|denoise|vae")])
def test_pipelined_equals_serial(tmp_path, kind, layout):
    FOLDERS[kind](tmp_path)
    reqs = _queue(5)
    want = cp.serial_service(cp.Stages(DiffusionPipeline.from_pretrained(tmp_path)), reqs)
    got = cp.run_service(str(tmp_path), reqs, layout, timeout_s=60)
    _check_equal(got, want, reqs)
    den = [r["denoise_rank"] for r in got["results"]]
    assert den == ([1] * 5 if layout.startswith("text|") else [1, 2, 1, 2, 1])  # round robin by queue position
    for st in got["stages"].values():
        assert 0 < st["utilisation"] <= 1 and st["bubbles_s"] >= -1e-9


@pytest.mark.distributed
def test_arrivals_and_latency(tmp_path):
    """Requests arriving later wait for their arrival; latency is counted from it."""
    tiny_pipeline(tmp_path)
    reqs = [cp.ImageRequest(id=f"r{k}", prompts=("seven",), seed=k, steps=2, arrival_s=0.4 * k) for k in range(3)]
    got = cp.run_service(str(tmp_path), reqs, "text+vae|denoise|denoise")
    for r, q in zip(got["results"], reqs):
        assert r["stages"]["text"][0] >= q.arrival_s
        assert r["latency_s"] == pytest.approx(r["stages"]["vae"][1] - q.arrival_s)


@pytest.mark.distributed
@pytest.mark.parametrize("layout,stage,rank", [("text|denoise|vae", "denoise", 1),
                                               ("text+vae|denoise|denoise", "denoise", 2),
                                               ("text|denoise|vae", "vae", 2),
                                               ("text|denoise|vae", "text", 0)])
def test_dead_stage_fails_fast(tmp_path, layout, stage, rank):
    """The stage's process exits abruptly as it starts request number 1 (on the shared layout, the second denoiser
    rank's first request): the job fails at once, naming the rank and its stage."""
    tiny_pipeline(tmp_path)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank {rank} \({stage}[+a-z]*\) died"):
        cp.run_service(str(tmp_path), _queue(4), layout, die=(stage, 1), timeout_s=20, idle_s=20)
    assert time.monotonic() - t < 60
