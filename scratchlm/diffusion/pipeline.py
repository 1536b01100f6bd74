"""The text-to-image pipeline: prompt -> text tokens -> denoising loop (with CFG) -> VAE decode.

One `DiffusionPipeline` runs two families of folders, both laid out as diffusers lays them out:

- **scratchlm's DiT pipelines** (`model_index.json` `_class_name` "scratchlm.DiffusionPipeline"): `vae/` and
  `transformer/` *are* diffusers checkpoints (AutoencoderKL, PixArtTransformer2DModel), the text encoder
  (scratchlm's `TextEncoder`) and its BPE `PromptTokenizer` sit beside them. A trained MNIST one ships inside the
  package (`SHIPPED_MNIST`, fp16 storage): `scratchlm diffusion sample|serve` use it when no `--model` is given.
- **Stable Diffusion folders** as diffusers ships them (`_class_name` "StableDiffusionPipeline"): `unet/`
  (`unet.UNet2DConditionModel`), `vae/`, `text_encoder/` (`clip.CLIPTextModel`), `tokenizer/`
  (`clip_tokenizer.CLIPTokenizer`), `scheduler/scheduler_config.json` (`schedulers.schedule_from_diffusers`:
  DDIM / Euler / DDPM / PNDM / DPM-Solver++ run as configured). Weights fp32 or fp16 (`variant="fp16"` picks the
  `*.fp16.safetensors` files); the modules compute in fp32 whatever the stored dtype. `safety_checker`,
  `feature_extractor` and `image_encoder` entries are accepted, present or null, and are **not run**: a load
  note says so (`pipe.notes`, also logged). As diffusers' StableDiffusionPipeline does on load, an SD 1.x / 2.x
  folder's scheduler gets `steps_offset` 1 and `clip_sample` off, and a pre-0.9 UNet config's `sample_size` < 64
  becomes 64 (each a note). `save_pretrained` writes a folder diffusers' `StableDiffusionPipeline.from_pretrained`
  loads (without those three).
- **SDXL base folders** ("StableDiffusionXLPipeline"): also `text_encoder_2/` (`clip.CLIPTextModelWithProjection`)
  and `tokenizer_2/`; the text features are both encoders' penultimate hidden states concatenated, the UNet's added
  conditions the second encoder's projected pooled output and the six time ids (original size, crop (0, 0),
  target size); `force_zeros_for_empty_prompt` makes the absent negative prompt all zeros.

The loop is diffusers' StableDiffusionPipeline's (and the XL one's): prompts and negative prompts (default "")
padded to the tokenizer's length, CFG on a batch of [negative; prompt] (`guidance_rescale` too), latents scaled
by the sampler's `init_noise_sigma`, `scale_model_input` before each denoiser call, decode of latents /
`scaling_factor`. One difference: CFG runs for any guidance != 1 (diffusers switches it off for guidance <= 1).

The API the parallel and benchmark code build on stays plain: `encode_prompts(prompts) -> (B, L, d)`,
`initial_latents`, `denoise(latents, text, uncond, ...)`, `decode(latents)`; `denoiser` is the DiT or the UNet
(`pipe.transformer` / `pipe.unet` name it when it is that kind, else None).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from scratchlm import atomic
from scratchlm.diffusion.dit import DiT
from scratchlm.diffusion.schedulers import (
    SAMPLERS,
    SCHEDULER_CLASSES,
    ScheduleConfig,
    cfg_combine,
    make_sampler,
    rescale_cfg,
    schedule_from_diffusers,
    scheduler_class_for,
)
from scratchlm.diffusion.text import PromptTokenizer, TextEncoder
from scratchlm.diffusion.vae import AutoencoderKL

log = logging.getLogger(__name__)

# the trained MNIST pipeline shipped with the package (docs/diffusion.md: how it was trained, its accuracy)
SHIPPED_MNIST = Path(__file__).resolve().parent / "pretrained" / "mnist"

# denoiser(x (B, C, h, w), t (B,), text (B, L, d)) -> model output
Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]

SD_CLASS = "StableDiffusionPipeline"
SDXL_CLASS = "StableDiffusionXLPipeline"
SCRATCH_CLASS = "scratchlm.DiffusionPipeline"
# model_index.json entries of an SD folder: component -> the [library, class] pairs we load
SD_COMPONENTS = {
    "unet": {("diffusers", "UNet2DConditionModel")},
    "vae": {("diffusers", "AutoencoderKL")},
    "text_encoder": {("transformers", "CLIPTextModel")},
    "tokenizer": {("transformers", "CLIPTokenizer"), ("transformers", "CLIPTokenizerFast")},
    "scheduler": {("diffusers", c) for c in SCHEDULER_CLASSES},
}
# SDXL adds a second tokenizer and a second text encoder, whose projected pooled output conditions the UNet
SDXL_COMPONENTS = {**SD_COMPONENTS, "tokenizer_2": SD_COMPONENTS["tokenizer"],
                   "text_encoder_2": {("transformers", "CLIPTextModelWithProjection")}}
# entries accepted, present or null, and not run (a note says so when present)
SD_NOT_RUN = {"safety_checker": "the NSFW safety checker is not run: images are returned unfiltered",
              "feature_extractor": "the feature extractor (the safety checker's image preprocessing) is not run",
              "image_encoder": "the IP-Adapter image encoder is not run: image prompts are not supported"}
SD_META = {"_class_name", "_diffusers_version", "_name_or_path", "requires_safety_checker",
           "force_zeros_for_empty_prompt"}


class DiffusionPipeline:
    """Tokenizer + text encoder + denoiser (DiT or SD UNet) + VAE + noise schedule; `__call__(prompts)` -> images
    in [-1, 1]. `sampler` is the one the folder's scheduler config names (ddim for scratchlm's folders)."""

    def __init__(self, tokenizer, text_encoder: nn.Module, denoiser: nn.Module, vae: AutoencoderKL,
                 schedule: ScheduleConfig, latent_size: int | tuple[int, int], sampler: str = "ddim",
                 scheduler_config: dict | None = None, clip_skip: int | None = None, notes: list[str] | None = None,
                 tokenizer_2=None, text_encoder_2: nn.Module | None = None, force_zeros_for_empty_prompt: bool = False):
        self.tokenizer, self.text_encoder, self.denoiser, self.vae = tokenizer, text_encoder, denoiser, vae
        # SDXL: the second CLIP (with projection) and whether an absent negative prompt is all-zero embeddings
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self.schedule = schedule
        self.latent_size = latent_size
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}: expected one of {sorted(SAMPLERS)}")
        self.sampler = sampler
        self.scheduler_config = scheduler_config  # the folder's own, written back verbatim by save_pretrained
        self.clip_skip = clip_skip
        self.notes = list(notes or [])  # what loading mapped or left out (also logged)
        for m in (text_encoder, denoiser, vae, text_encoder_2):
            if m is not None:
                m.eval()

    @property
    def transformer(self) -> DiT | None:
        return self.denoiser if isinstance(self.denoiser, DiT) else None

    @property
    def unet(self):
        return None if isinstance(self.denoiser, DiT) else self.denoiser

    @property
    def is_sd(self) -> bool:
        """A Stable Diffusion pipeline (UNet + CLIP) rather than a scratchlm DiT one."""
        return not isinstance(self.text_encoder, TextEncoder)

    @property
    def is_sdxl(self) -> bool:
        return self.text_encoder_2 is not None

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    @property
    def latent_hw(self) -> tuple[int, int]:
        s = self.latent_size
        return (s, s) if isinstance(s, int) else tuple(s)

    @property
    def image_hw(self) -> tuple[int, int]:
        """The native image size (height, width): the latent size times the VAE's downsampling."""
        f = self.vae.config.downsample
        return self.latent_hw[0] * f, self.latent_hw[1] * f

    @property
    def default_guidance(self) -> float:
        """The guidance scale when none is given: diffusers' (7.5 for SD, 5 for SDXL), 3 for scratchlm's (its
        recipe)."""
        return 5.0 if self.is_sdxl else 7.5 if self.is_sd else 3.0

    @property
    def example_prompt(self) -> str:
        """A prompt the model is made for (the images page starts with it): a digit caption for scratchlm's MNIST
        pipelines, diffusers' own example prompt for Stable Diffusion folders."""
        return "a photo of an astronaut riding a horse on mars" if self.is_sd else "a handwritten seven"

    def latent_size_for(self, image_hw: tuple[int, int]) -> tuple[int, int]:
        """The latent (h, w) of an image (height, width) in pixels; each must be a multiple of the VAE's
        downsampling factor (times the DiT's patch), else a ValueError saying which multiples work."""
        f = self.vae.config.downsample
        step = f * (self.transformer.config.patch_size if self.transformer is not None else 1)
        h, w = image_hw
        if h % step or w % step:
            raise ValueError(f"size {w}x{h} is not supported: width and height must be multiples of {step}")
        return h // f, w // f

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Tensor:
        """(B, L, d) text features the denoiser cross-attends to; for CLIP, L = the tokenizer's 77 and the
        features are `last_hidden_state` (or, with `clip_skip`, an earlier layer through the final norm)."""
        return self.encode_prompts_pooled(prompts)[0]

    @torch.no_grad()
    def encode_prompts_pooled(self, prompts: list[str]) -> tuple[Tensor, Tensor | None]:
        """(text features (B, L, d), pooled (B, p) or None). SDXL: both encoders' penultimate hidden states
        (no final norm) concatenated along d, and the second encoder's projected pooled output; others: None."""
        if isinstance(self.text_encoder, TextEncoder):
            return self.text_encoder(self.tokenizer(prompts)), None  # (B, L, d)
        from scratchlm.diffusion.clip import encode_prompt_hidden

        def run(tok, enc, want_hidden: bool):
            # padded and truncated to 77 as diffusers asks the tokenizer to; no attention mask
            ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True)["input_ids"]
            for p in prompts:  # what the cut drops is said, as diffusers does
                if (n := len(tok.encode(p))) > tok.model_max_length:
                    log.warning("prompt %r... is %d tokens: the text encoder reads the first %d (with start/end)",
                                p[:40], n, tok.model_max_length)
            return enc(ids, output_hidden_states=want_hidden)

        if not self.is_sdxl:
            out = run(self.tokenizer, self.text_encoder, self.clip_skip is not None)
            return encode_prompt_hidden(out, self.text_encoder.text_model.final_layer_norm, self.clip_skip), None
        if self.clip_skip is not None:
            raise ValueError("clip_skip is not supported for SDXL pipelines (they always take hidden_states[-2])")
        out1 = run(self.tokenizer, self.text_encoder, True)
        out2 = run(self.tokenizer_2, self.text_encoder_2, True)
        text = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)  # (B, 77, d1 + d2)
        return text, out2.text_embeds  # (B, projection_dim)

    def sdxl_time_ids(self, n: int, image_hw: tuple[int, int]) -> Tensor:
        """SDXL's micro-conditioning (B, 6): original size, crop top-left (0, 0), target size, all = the image's
        (diffusers' defaults)."""
        h, w = image_hw
        return torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.float32).expand(n, 6)

    def initial_latents(self, n: int, seed: int = 0, size: int | tuple[int, int] | None = None) -> Tensor:
        s = size or self.latent_hw
        h, w = (s, s) if isinstance(s, int) else s
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, self.latent_channels, h, w, generator=g)  # (B, c, h, w), unit variance

    def _denoiser_fn(self) -> Callable[..., Tensor]:
        if isinstance(self.denoiser, DiT):
            return self.denoiser
        unet = self.denoiser
        return lambda x, t, text, added_cond_kwargs=None: unet(x, t, text, added_cond_kwargs=added_cond_kwargs)

    @torch.no_grad()
    def denoise(self, latents: Tensor, text: Tensor, uncond: Tensor | None, steps: int = 25, guidance: float = 3.0,
                sampler: str | None = None, denoiser: Denoiser | None = None, seed: int = 0,
                progress: Callable[[int], None] | None = None, guidance_rescale: float = 0.0,
                added: dict[str, Tensor] | None = None, added_uncond: dict[str, Tensor] | None = None) -> Tensor:
        """Run the sampler (default: the folder's, `self.sampler`) from unit-variance `latents`; with `uncond` and
        guidance != 1, CFG on a batch of [uncond; cond]. `denoiser` replaces the DiT / UNet call (the parallel
        variants plug in here). SDXL: `added` / `added_uncond` are the UNet's added conditions ({"text_embeds":
        pooled, "time_ids": ...}) of the prompts / of the unconditional input; a `denoiser` then also receives
        `added_cond_kwargs=`."""
        den = denoiser or self._denoiser_fn()
        sch = make_sampler(sampler or self.sampler, self.schedule)
        sch.set_timesteps(steps)
        x = latents * sch.init_noise_sigma
        g = torch.Generator().manual_seed(seed + 1)
        use_cfg = uncond is not None and guidance != 1.0
        kw = {} if added is None else {"added_cond_kwargs": added}
        if use_cfg:
            ctx = torch.cat([uncond, text])  # (2B, L, d), built once: the same tensor every step
            if added is not None:
                if added_uncond is None:
                    raise ValueError("added conditions for the prompts but none for the unconditional input")
                kw = {"added_cond_kwargs": {k: torch.cat([added_uncond[k], added[k]]) for k in added}}  # [u; c]
        for i, t in enumerate(sch.timesteps):
            xin = sch.scale_model_input(x, t)
            tt = torch.full((x.shape[0],), float(t))
            if use_cfg:
                out = den(torch.cat([xin, xin]), torch.cat([tt, tt]), ctx, **kw)
                out_u, out_c = out.chunk(2)
                out = rescale_cfg(cfg_combine(out_u, out_c, guidance), out_c, guidance_rescale)
            else:
                out = den(xin, tt, text, **kw)
            x = sch.step(out, t, x, generator=g)
            if progress is not None:
                progress(i)
        return x

    @torch.no_grad()
    def decode(self, latents: Tensor, tile: int | None = None) -> Tensor:
        return self.vae.decode(latents / self.vae.config.scaling_factor, tile=tile).clamp(-1, 1)

    @torch.no_grad()
    def __call__(self, prompts: list[str], steps: int = 25, guidance: float | None = None, sampler: str | None = None,
                 seed: int = 0, latents: Tensor | None = None, progress=None,
                 negative_prompts: list[str] | None = None, guidance_rescale: float = 0.0,
                 size: int | tuple[int, int] | None = None) -> Tensor:
        """Images (B, C, H, W) in [-1, 1]. `negative_prompts` (one per prompt) replace the empty prompt as CFG's
        unconditional input; `size` is the latent size (h, w) (default: the model's native one); `guidance`
        defaults to `default_guidance`."""
        guidance = self.default_guidance if guidance is None else guidance
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts")
        text, pooled = self.encode_prompts_pooled(prompts)
        if self.is_sdxl and negative_prompts is None and self.force_zeros_for_empty_prompt:
            uncond, pooled_u = torch.zeros_like(text), torch.zeros_like(pooled)  # SDXL's no-negative-prompt rule
        else:
            uncond, pooled_u = self.encode_prompts_pooled(negative_prompts or [""] * len(prompts))
        lat = latents if latents is not None else self.initial_latents(len(prompts), seed, size)
        added = added_u = None
        if self.is_sdxl:
            f = self.vae.config.downsample
            ids = self.sdxl_time_ids(len(prompts), (lat.shape[-2] * f, lat.shape[-1] * f))
            added, added_u = {"text_embeds": pooled, "time_ids": ids}, {"text_embeds": pooled_u, "time_ids": ids}
        z = self.denoise(lat, text, uncond, steps, guidance, sampler, seed=seed, progress=progress,
                         guidance_rescale=guidance_rescale, added=added, added_uncond=added_u)
        return self.decode(z)

    # --- folders ------------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None, variant: str | None = None) -> None:
        """Write the pipeline folder; `dtype` (e.g. torch.float16) stores the weights in that precision
        (loading casts them back into the fp32 modules); `variant` names the weight files
        (`*.<variant>.safetensors`, SD folders only). An SD pipeline writes what diffusers'
        StableDiffusionPipeline.from_pretrained loads (no safety checker / feature extractor)."""
        if self.is_sd:
            return self._save_sd(Path(path), dtype, variant)
        if variant is not None:
            raise ValueError("variant= is for Stable Diffusion folders; a scratchlm DiT folder has one weight file "
                             "per component")
        if dtype is not None:
            stored = copy.deepcopy(self)
            for m in (stored.vae, stored.denoiser, stored.text_encoder):
                m.to(dtype)
            stored.save_pretrained(path)
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.vae.save_pretrained(path / "vae")
        self.denoiser.save_pretrained(path / "transformer")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save(path / "tokenizer")
        self._save_scheduler(path)
        (path / "model_index.json").write_text(json.dumps({
            "_class_name": SCRATCH_CLASS, "latent_size": self.latent_size,
            "schedule": asdict(self.schedule), "vae": ["diffusers", "AutoencoderKL"],
            "transformer": ["diffusers", "PixArtTransformer2DModel"], "scheduler": ["diffusers", "DDIMScheduler"],
            "text_encoder": ["scratchlm", "TextEncoder"], "tokenizer": ["scratchlm", "PromptTokenizer"]}, indent=2))

    def _scheduler_json(self) -> dict:
        if self.scheduler_config is not None:
            return self.scheduler_config
        return {"_class_name": scheduler_class_for(self.sampler), **self.schedule.diffusers_config(self.sampler)}

    def _save_scheduler(self, path: Path) -> None:
        (path / "scheduler").mkdir(parents=True, exist_ok=True)
        atomic.write_text(path / "scheduler" / "scheduler_config.json", json.dumps(self._scheduler_json(), indent=2))

    def _save_sd(self, path: Path, dtype: torch.dtype | None, variant: str | None) -> None:
        from scratchlm.diffusion.io import _diffusers_version

        path.mkdir(parents=True, exist_ok=True)
        vae = self.vae if dtype is None else copy.deepcopy(self.vae).to(dtype)
        vae.save_pretrained(path / "vae", variant=variant)
        self.denoiser.save_pretrained(path / "unet", dtype=dtype, variant=variant)
        self.text_encoder.save_pretrained(path / "text_encoder", dtype=dtype, variant=variant)
        self.tokenizer.save_pretrained(path / "tokenizer")
        self._save_scheduler(path)
        index = {"_class_name": SD_CLASS, "_diffusers_version": _diffusers_version(),
                 "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False,
                 "safety_checker": [None, None], "scheduler": ["diffusers", self._scheduler_json()["_class_name"]],
                 "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                 "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
        if self.is_sdxl:
            self.text_encoder_2.save_pretrained(path / "text_encoder_2", dtype=dtype, variant=variant)
            self.tokenizer_2.save_pretrained(path / "tokenizer_2")
            for key in ("safety_checker", "requires_safety_checker"):
                del index[key]
            index.update(_class_name=SDXL_CLASS, force_zeros_for_empty_prompt=self.force_zeros_for_empty_prompt,
                         text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
                         tokenizer_2=["transformers", "CLIPTokenizer"])
        atomic.write_text(path / "model_index.json", json.dumps(dict(sorted(index.items())), indent=2))

    @classmethod
    def from_pretrained(cls, path: str | Path, variant: str | None = None) -> DiffusionPipeline:
        """Load a scratchlm DiT pipeline folder or a Stable Diffusion folder (see the module docstring);
        `variant` ("fp16") picks the `*.<variant>.safetensors` weight files of an SD folder."""
        path = Path(path)
        idx = path / "model_index.json"
        if not idx.is_file():
            raise FileNotFoundError(f"{idx} not found: expected a diffusion pipeline folder (scratchlm's: "
                                    "model_index.json, vae/, transformer/, text_encoder/, tokenizer/, scheduler/; "
                                    "or Stable Diffusion's: model_index.json, unet/, vae/, text_encoder/, "
                                    "tokenizer/, scheduler/)")
        meta = json.loads(idx.read_text())
        kind = meta.get("_class_name")
        if kind in (SD_CLASS, SDXL_CLASS):
            return cls._load_sd(path, meta, variant)
        if kind not in (SCRATCH_CLASS, None):
            raise ValueError(f"{idx}: _class_name {kind!r} is not supported: this loads {SD_CLASS!r}, "
                             f"{SDXL_CLASS!r} and {SCRATCH_CLASS!r} folders")
        if variant is not None:
            raise ValueError(f"{path}: variant= is for Stable Diffusion folders, this is a scratchlm DiT folder")
        for sub in ("tokenizer", "text_encoder", "transformer", "vae"):
            if not (path / sub).is_dir():
                raise FileNotFoundError(f"{path / sub} not found: the pipeline folder lacks its {sub}/")
        return cls(PromptTokenizer.load(path / "tokenizer"), TextEncoder.from_pretrained(path / "text_encoder"),
                   DiT.from_pretrained(path / "transformer"), AutoencoderKL.from_pretrained(path / "vae"),
                   ScheduleConfig(**meta["schedule"]), meta["latent_size"])

    @classmethod
    def _load_sd(cls, path: Path, meta: dict, variant: str | None) -> DiffusionPipeline:
        from scratchlm.diffusion.clip import CLIPTextModel, CLIPTextModelWithProjection
        from scratchlm.diffusion.clip_tokenizer import CLIPTokenizer
        from scratchlm.diffusion.unet import UNet2DConditionModel

        idx = path / "model_index.json"
        xl = meta["_class_name"] == SDXL_CLASS
        components = SDXL_COMPONENTS if xl else SD_COMPONENTS
        notes = []
        for key, entry in meta.items():
            if key in SD_META or key in components:
                continue
            if key not in SD_NOT_RUN:
                raise ValueError(f"{idx}: unknown entry {key!r}: {entry}")
            if entry is not None and list(entry) != [None, None]:
                notes.append(f"{path}: {key} {entry}: {SD_NOT_RUN[key]}")
        for key, allowed in components.items():
            entry = meta.get(key)
            if entry is None or list(entry) == [None, None]:
                raise ValueError(f"{idx}: the {key!r} component is missing (a {meta['_class_name']} needs "
                                 f"{sorted(components)}; SDXL refiners without text_encoder are not supported)")
            if tuple(entry) not in allowed:
                raise ValueError(f"{idx}: {key} is {entry}; supported: {sorted(map(list, allowed))}")
            if not (path / key).is_dir():
                raise FileNotFoundError(f"{path / key} not found: model_index.json lists {key} {entry}")
        sch_path = path / "scheduler" / "scheduler_config.json"
        if not sch_path.is_file():
            raise FileNotFoundError(f"{sch_path} not found")
        sch_cfg = json.loads(sch_path.read_text())
        if sch_cfg.get("_class_name") != meta["scheduler"][1]:
            raise ValueError(f"{sch_path}: _class_name {sch_cfg.get('_class_name')!r} differs from model_index.json's "
                             f"scheduler {meta['scheduler']}")
        schedule, sampler, note = schedule_from_diffusers(sch_cfg, str(sch_path))
        if note:
            notes.append(note)
        if not xl:  # StableDiffusionPipeline rewrites "outdated" scheduler configs on load; so do we, and say so
            for key, value in (("steps_offset", 1), ("clip_sample", False)):
                if getattr(schedule, key) != value:
                    notes.append(f"{sch_path}: {key} {getattr(schedule, key)} -> {value}, as diffusers' "
                                 f"StableDiffusionPipeline sets it for SD 1.x / 2.x folders")
                    schedule = replace(schedule, **{key: value})
        unet = UNet2DConditionModel.from_pretrained(path / "unet", variant=variant)
        vae = AutoencoderKL.from_pretrained(path / "vae", variant=variant)
        text_encoder = CLIPTextModel.from_pretrained(path / "text_encoder", variant=variant)
        tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
        extra = {}
        width = text_encoder.config.hidden_size
        if xl:
            te2 = CLIPTextModelWithProjection.from_pretrained(path / "text_encoder_2", variant=variant)
            extra = dict(tokenizer_2=CLIPTokenizer.from_pretrained(path / "tokenizer_2"), text_encoder_2=te2,
                         force_zeros_for_empty_prompt=bool(meta.get("force_zeros_for_empty_prompt", True)))
            width += te2.config.hidden_size
            uc = unet.config
            if uc.addition_embed_type != "text_time":
                raise ValueError(f"{path / 'unet'}: an SDXL unet needs addition_embed_type 'text_time', "
                                 f"got {uc.addition_embed_type!r}")
            added = 6 * uc.addition_time_embed_dim + te2.config.projection_dim
            if added != uc.projection_class_embeddings_input_dim:
                raise ValueError(f"{path}: 6 time ids x addition_time_embed_dim {uc.addition_time_embed_dim} + "
                                 f"text_encoder_2 projection_dim {te2.config.projection_dim} = {added} != unet "
                                 f"projection_class_embeddings_input_dim {uc.projection_class_embeddings_input_dim}")
        elif "force_zeros_for_empty_prompt" in meta:
            raise ValueError(f"{idx}: force_zeros_for_empty_prompt is an SDXL setting, not {SD_CLASS}'s")
        if width != unet.config.cross_attention_dim:
            raise ValueError(f"{path}: text encoder width {width} != unet cross_attention_dim "
                             f"{unet.config.cross_attention_dim}")
        size = unet.config.sample_size
        made_by = json.loads((path / "unet" / "config.json").read_text()).get("_diffusers_version", "1")
        # (0, 0, 0): what scratchlm's io writes when diffusers is not installed, not an old diffusers
        if not xl and isinstance(size, int) and size < 64 and (0, 0, 0) < _version(made_by) < (0, 9):
            notes.append(f"{path / 'unet' / 'config.json'}: sample_size {size} from diffusers {made_by} -> 64 (the "
                         "default image size), as diffusers' StableDiffusionPipeline sets it for such old configs")
            size = 64
        for n in notes:
            log.warning(n)
        return cls(tokenizer, text_encoder, unet, vae, schedule, size if isinstance(size, int) else tuple(size),
                   sampler=sampler, scheduler_config=sch_cfg, notes=notes, **extra)


def _version(text: str) -> tuple[int, ...]:
    """"0.8.0.dev0" -> (0, 8, 0): the numeric release parts."""
    parts = []
    for p in text.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def is_pipeline_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "model_index.json").is_file() and ((p / "transformer").is_dir() or (p / "unet").is_dir())


def parse_size(text: str) -> tuple[int, int]:
    """"WxH" or "N" (pixels) -> (height, width)."""
    parts = text.lower().split("x")
    try:
        w, h = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"size {text!r} is not WxH or N (pixels)") from None
    if len(parts) > 2 or w < 1 or h < 1:
        raise ValueError(f"size {text!r} is not WxH or N (pixels)")
    return h, w


def image_grid(images: Tensor, nrow: int) -> Tensor:
    """(N, C, H, W) in [-1, 1] -> uint8 (rows*H, nrow*W, C) grid with 2-px gaps."""
    n, c, h, w = images.shape
    rows = (n + nrow - 1) // nrow
    grid = torch.zeros(c, rows * (h + 2), nrow * (w + 2))
    for i in range(n):
        r, k = divmod(i, nrow)
        grid[:, r * (h + 2):r * (h + 2) + h, k * (w + 2):k * (w + 2) + w] = (images[i] + 1) / 2
    return (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)


def save_png(images: Tensor, path: str | Path, nrow: int = 10) -> None:
    from PIL import Image

    g = image_grid(images, nrow).numpy()
    Image.fromarray(g[..., 0] if g.shape[-1] == 1 else g).save(path)
