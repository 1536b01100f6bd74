"""The denoiser: a DiT with adaLN-single timestep conditioning and cross-attention to text tokens.

Same architecture and parameter names as diffusers' `PixArtTransformer2DModel` (norm_type
"ada_norm_single", no additional resolution conditions), so a diffusers checkpoint
(`config.json` + `diffusion_pytorch_model.safetensors`) loads with a strict state-dict match:

    x (B, C, H, W) -> patchify (conv p x p, stride p) + 2-D sin-cos positions -> tokens (B, N, d)
    t -> sinusoidal(256) -> MLP -> e (B, d);  adaLN-single: silu(e) -> Linear -> (B, 6d), shared by all blocks
    each block: shift/scale/gate = table (6, d) + (B, 6d) chunks
        x += gate_msa * SelfAttn(LN(x) * (1 + scale_msa) + shift_msa)
        x += CrossAttn(x, text)                      # PixArt: no norm before the cross-attention
        x += gate_mlp * FF(LN(x) * (1 + scale_mlp) + shift_mlp)
    final: LN(x) * (1 + scale) + shift (table (2, d) + e) -> Linear -> unpatchify -> (B, C_out, H, W)

Self-attention calls a pluggable `kv_hook(layer_idx, k, v) -> (k, v)`: patch parallelism swaps it for
an all-gather of the other ranks' K/V (exact) or for their one-step-stale K/V (DistriFusion).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.diffusion.layers import BiasLinear, attention, sincos_pos_embed_2d, timestep_embedding

KVHook = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class DiTConfig:
    """A PixArt-style DiT; field names follow diffusers' PixArtTransformer2DModel config."""

    sample_size: int = field(default=8, metadata={"help": "latent height = width the position table is built for"})
    in_channels: int = field(default=4, metadata={"help": "latent channels in"})
    out_channels: int = field(default=4, metadata={"help": "channels out (in_channels: no learned variance)"})
    patch_size: int = field(default=1, metadata={"help": "latent pixels per patch side"})
    num_layers: int = field(default=4, metadata={"help": "transformer blocks"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads"})
    attention_head_dim: int = field(default=32, metadata={"help": "width per head; d = heads * head_dim"})
    cross_attention_dim: int = field(default=128, metadata={"help": "width of the text tokens"})
    caption_channels: int | None = field(default=None, metadata={"help": "project text tokens from this width"})
    norm_eps: float = field(default=1e-6, metadata={"help": "LayerNorm epsilon"})
    interpolation_scale: float | None = field(default=None, metadata={"help": "position-table scale"})
    ff_mult: int = field(default=4, metadata={"help": "feed-forward width multiple (diffusers: 4)"})

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def diffusers_config(self) -> dict:
        """The kwargs of diffusers' PixArtTransformer2DModel for this architecture."""
        return dict(sample_size=self.sample_size, in_channels=self.in_channels, out_channels=self.out_channels,
                    patch_size=self.patch_size, num_layers=self.num_layers,
                    num_attention_heads=self.num_attention_heads, attention_head_dim=self.attention_head_dim,
                    cross_attention_dim=self.cross_attention_dim, caption_channels=self.caption_channels,
                    norm_eps=self.norm_eps, interpolation_scale=self.interpolation_scale,
                    use_additional_conditions=False, norm_type="ada_norm_single", norm_elementwise_affine=False,
                    attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                    dropout=0.0, upcast_attention=False, attention_type="default")

    @classmethod
    def from_diffusers(cls, cfg: dict) -> DiTConfig:
        """Validate a diffusers PixArt config.json and keep the fields this implementation supports."""
        for key, want in (("norm_type", "ada_norm_single"), ("norm_elementwise_affine", False),
                          ("activation_fn", "gelu-approximate"), ("attention_bias", True)):
            if cfg.get(key, want) != want:
                raise ValueError(f"DiT config: {key}={cfg[key]!r} is not supported (expected {want!r})")
        sample = cfg.get("sample_size", 128)
        if cfg.get("use_additional_conditions") or (cfg.get("use_additional_conditions") is None and sample == 128):
            raise ValueError("DiT config: use_additional_conditions (resolution/aspect-ratio embeddings) "
                             "is not supported; set it to false")
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in cfg.items() if k in names}
        if kw.get("out_channels") is None:
            kw["out_channels"] = cfg.get("in_channels", 4)
        return cls(**kw)


class SelfAttention(nn.Module):
    """diffusers `Attention` (to_q/to_k/to_v/to_out.0, biases); K/V may come from elsewhere (`kv_hook`)."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None = None):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = BiasLinear(dim, inner)
        self.to_k = BiasLinear(kv_dim or dim, inner)
        self.to_v = BiasLinear(kv_dim or dim, inner)
        self.to_out = nn.ModuleList([BiasLinear(inner, dim)])

    def forward(self, x: Tensor, context: Tensor | None = None, kv_hook: KVHook | None = None,
                layer_idx: int = 0) -> Tensor:
        b, t, _ = x.shape
        src = x if context is None else context
        q = self.to_q(x).view(b, t, self.heads, self.head_dim)  # (B, T, H, D)
        k = self.to_k(src).view(b, src.shape[1], self.heads, self.head_dim)  # (B, S, H, D)
        v = self.to_v(src).view(b, src.shape[1], self.heads, self.head_dim)
        if kv_hook is not None:
            k, v = kv_hook(layer_idx, k, v)  # patch parallel: (B, S_total, H, D)
        out = attention(q, k, v)  # (B, T, H, D)
        return self.to_out[0](out.reshape(b, t, self.heads * self.head_dim))


class GELUProj(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = BiasLinear(d_in, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """diffusers FeedForward("gelu-approximate"): net.0.proj -> tanh-GELU -> net.2."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, dim * mult), nn.Identity(), BiasLinear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class DiTBlock(nn.Module):
    """One PixArt block (see the module docstring)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.inner_dim
        self.eps = cfg.norm_eps
        self.attn1 = SelfAttention(d, cfg.num_attention_heads, cfg.attention_head_dim)
        self.attn2 = SelfAttention(d, cfg.num_attention_heads, cfg.attention_head_dim, kv_dim=d)
        self.ff = FeedForward(d, cfg.ff_mult)
        self.scale_shift_table = nn.Parameter(torch.randn(6, d) / d**0.5)

    def forward(self, x: Tensor, text: Tensor, t6: Tensor, kv_hook: KVHook | None = None, layer_idx: int = 0
                ) -> Tensor:
        b, _, d = x.shape
        mods = self.scale_shift_table[None] + t6.reshape(b, 6, d)  # (B, 6, d)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=1)  # each (B, 1, d)
        h = F.layer_norm(x, (d,), eps=self.eps) * (1 + scale_msa) + shift_msa
        x = x + gate_msa * self.attn1(h, kv_hook=kv_hook, layer_idx=layer_idx)
        x = x + self.attn2(x, context=text)
        h = F.layer_norm(x, (d,), eps=self.eps) * (1 + scale_mlp) + shift_mlp
        return x + gate_mlp * self.ff(h)


class _Timestep(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear_1 = BiasLinear(256, d)
        self.linear_2 = BiasLinear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class _Emb(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.timestep_embedder = _Timestep(d)


class AdaLNSingle(nn.Module):
    """t -> (silu(e) W + b (B, 6d), e (B, d)): the one modulation MLP all blocks share (PixArt-alpha 2.3)."""

    def __init__(self, d: int):
        super().__init__()
        self.emb = _Emb(d)
        self.linear = BiasLinear(d, 6 * d)

    def forward(self, t: Tensor) -> tuple[Tensor, Tensor]:
        e = self.emb.timestep_embedder(timestep_embedding(t, 256, flip_sin_to_cos=True, shift=0))  # (B, d)
        return self.linear(F.silu(e)), e


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_channels, cfg.inner_dim, cfg.patch_size, stride=cfg.patch_size)


class _CaptionProjection(nn.Module):
    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.linear_1 = BiasLinear(d_in, d)
        self.linear_2 = BiasLinear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class DiT(nn.Module):
    """PixArt-shaped DiT denoiser: forward(x (B, C, H, W), t (B,), text (B, L, d_text)) -> (B, C_out, H, W)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.config = cfg
        d = cfg.inner_dim
        if cfg.cross_attention_dim != d:
            raise ValueError(f"DiT: cross_attention_dim {cfg.cross_attention_dim} must equal heads*head_dim {d} "
                             "(PixArt's text tokens enter attn2 at the inner width; use caption_channels to "
                             "project a text encoder of another width)")
        self.pos_embed = _PatchEmbed(cfg)
        self.transformer_blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.num_layers)])
        self.scale_shift_table = nn.Parameter(torch.randn(2, d) / d**0.5)
        self.proj_out = BiasLinear(d, cfg.patch_size**2 * cfg.out_channels)
        self.adaln_single = AdaLNSingle(d)
        self.caption_projection = _CaptionProjection(cfg.caption_channels, d) if cfg.caption_channels else None

    def pos_table(self, gh: int, gw: int, device) -> Tensor:
        cfg = self.config
        base = cfg.sample_size // cfg.patch_size
        scale = cfg.interpolation_scale if cfg.interpolation_scale is not None else max(cfg.sample_size // 64, 1)
        return sincos_pos_embed_2d(cfg.inner_dim, gh, gw, base, scale, device=device)  # (gh*gw, d)

    def embed(self, x: Tensor, row0: int = 0, grid_h: int | None = None) -> Tensor:
        """Patchify x (B, C, h, W) -> tokens (B, gh_local*gw, d). `row0`/`grid_h`: x is a band of patch
        rows starting at patch row `row0` of a `grid_h`-row latent (patch parallelism)."""
        p = self.config.patch_size
        gh_local, gw = x.shape[-2] // p, x.shape[-1] // p
        tok = self.pos_embed.proj(x).flatten(2).transpose(1, 2)  # (B, gh_local*gw, d)
        pos = self.pos_table(grid_h or gh_local, gw, x.device)[row0 * gw:(row0 + gh_local) * gw]
        return tok + pos[None].to(tok.dtype)

    def text_tokens(self, text: Tensor) -> Tensor:
        return text if self.caption_projection is None else self.caption_projection(text)

    def head(self, x: Tensor, e: Tensor, gh: int, gw: int) -> Tensor:
        """Final modulation, projection and unpatchify: tokens (B, gh*gw, d) -> (B, C_out, gh*p, gw*p)."""
        cfg = self.config
        p, c = cfg.patch_size, cfg.out_channels
        shift, scale = (self.scale_shift_table[None] + e[:, None]).chunk(2, dim=1)  # (B, 1, d) each
        x = F.layer_norm(x, (cfg.inner_dim,), eps=1e-6) * (1 + scale) + shift
        x = self.proj_out(x).reshape(-1, gh, gw, p, p, c)  # (B, gh, gw, p, p, C)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(-1, c, gh * p, gw * p)

    def forward(self, x: Tensor, t: Tensor, text: Tensor, kv_hook: KVHook | None = None, row0: int = 0,
                grid_h: int | None = None) -> Tensor:
        p = self.config.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"DiT: latent {tuple(x.shape[-2:])} is not a multiple of patch size {p}")
        b = x.shape[0]
        gh, gw = x.shape[-2] // p, x.shape[-1] // p
        if t.ndim == 0:
            t = t.expand(b)
        h = self.embed(x, row0, grid_h)
        t6, e = self.adaln_single(t)
        ctx = self.text_tokens(text)
        for i, block in enumerate(self.transformer_blocks):
            h = block(h, ctx, t6, kv_hook=kv_hook, layer_idx=i)
        return self.head(h, e, gh, gw)

    # --- diffusers-format I/O ---------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> DiT:
        """Load a diffusers PixArtTransformer2DModel directory (config.json + diffusion_pytorch_model.safetensors)."""
        from scratchlm.diffusion.io import load_diffusers_dir

        cfg, sd = load_diffusers_dir(path)
        model = cls(DiTConfig.from_diffusers(cfg))
        _load_strict(model, sd, path)
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write diffusers format: PixArtTransformer2DModel's config.json + safetensors."""
        from scratchlm.diffusion.io import save_diffusers_dir

        save_diffusers_dir(path, "PixArtTransformer2DModel", self.config.diffusers_config(), self.state_dict())


def _load_strict(model: nn.Module, sd: dict[str, Tensor], path) -> None:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match {type(model).__name__}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")


def config_to_json(cfg) -> str:
    return json.dumps(asdict(cfg), indent=2)
