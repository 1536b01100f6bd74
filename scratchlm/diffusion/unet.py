"""Stable Diffusion's denoiser: the UNet of diffusers' `UNet2DConditionModel`, for SD 1.x / 2.x and SDXL configs.

Same architecture, config.json and parameter names as diffusers (0.42), so a diffusers `unet/` folder loads with a
strict state-dict match and a folder we write loads in diffusers:

    t -> sinusoidal(C0) -> time_embedding (Linear, SiLU, Linear) -> emb (B, E)      E = time_embedding_dim or 4 C0
         (+ SDXL "text_time": add_embedding(cat(text_embeds, sinusoidal(time_ids))))
    x -> conv_in -> down blocks -> mid block -> up blocks (skips concatenated) -> GroupNorm, SiLU, conv_out
    down level i (width C_i): layers_per_block x [ResNet (+ Transformer2D if CrossAttn)] (+ stride-2 conv)
    mid: ResNet, Transformer2D, ResNet
    up level i: (layers_per_block + 1) x [cat(x, skip) -> ResNet (+ Transformer2D)] (+ nearest x2, conv)
    ResNet: GroupNorm, SiLU, conv3x3, + Linear(SiLU(emb)) ("default"; "scale_shift": norm2 * (1 + s) + b),
            GroupNorm, SiLU, (dropout), conv3x3, + (1x1 conv) shortcut, / output_scale_factor
    Transformer2D: GroupNorm (eps 1e-6), proj_in (1x1 conv, or Linear with use_linear_projection), N x
            BasicTransformerBlock [LN, self-attn attn1; LN, cross-attn attn2 to the text; LN, GEGLU FF], proj_out, +x

diffusers' naming quirk is kept: for these configs `attention_head_dim` is the number of heads per level
(head width = C_i / heads); `num_attention_heads` (which diffusers' class refuses) is accepted as the same thing
and written back as `attention_head_dim`.

Spatial hooks (the contract with patch parallelism, `unet_parallel.py`): `forward(..., ops=SpatialOps())` threads
`ops` through every block; every convolution with a kernel > 1 runs as `ops.conv(name, conv, x)`, every GroupNorm as
`ops.group_norm(name, gn, x)`, every self-attention's K/V pass `ops.self_kv(name, k, v)`, `name` being the module's
dotted path in this model (the conv / GroupNorm / attention module; stable, unique). Nothing else looks beyond the
local rows of the image: 1x1 convs, Linear layers, LayerNorms, cross-attention (its K/V come from the text) and
nearest upsampling are local. The one exception is an input whose sides are not multiples of 2^(levels-1): the
upsamplers then take their output size from the skip tensors (as diffusers does), which is still local per rank.

Policy: every config.json key diffusers writes is a field of `UNetConfig`; a value this implementation does not
build (class embeddings, encoder_hid_proj, dual cross-attention, other block types, ...) is a ValueError naming the
field, and a key diffusers does not know is an error too. Some fields only act on block types we do not build
(`resnet_out_scale_factor`, `resnet_skip_time_act`, `cross_attention_norm`, `mid_block_only_cross_attention`,
`addition_embed_type_num_heads`): diffusers ignores them for these blocks as well, so they are accepted and kept.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.diffusion.layers import BiasLinear, attention, timestep_embedding

log = logging.getLogger(__name__)

DOWN_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_TYPES = ("UNetMidBlock2DCrossAttn", None)
SILU_NAMES = ("silu", "swish")


class SpatialOps:
    """The UNet's spatial operations, local (one process holds the whole image). Patch parallelism subclasses it.

    `name` is the dotted path of the module in the UNet (e.g. "down_blocks.0.resnets.1.conv2"), so an
    implementation can key per-layer state (stale halos, group statistics, K/V) by it.
    """

    def conv(self, name: str, conv: nn.Conv2d, x: Tensor) -> Tensor:
        """Every convolution with a kernel > 1 (3x3 convs, the stride-2 downsampling convs)."""
        return conv(x)

    def group_norm(self, name: str, gn: nn.GroupNorm, x: Tensor) -> Tensor:
        """Every GroupNorm (its statistics are over the whole image)."""
        return gn(x)

    def self_kv(self, name: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Self-attention's K/V: (B, N_local, H, D) -> (B, N_all, H, D). Cross-attention is not hooked."""
        return k, v


LOCAL_OPS = SpatialOps()


def _levels(value, n: int, name: str) -> tuple:
    """A per-level config value: an int/bool/str repeated n times, or a list of n values."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"UNet config: {name}={list(value)} must have one entry per level ({n})")
        return tuple(value)
    return (value,) * n


@dataclass
class UNetConfig:
    """UNet2DConditionModel's config.json; field names and defaults are diffusers'."""

    sample_size: int | tuple[int, int] | None = field(default=None, metadata={
        "help": "latent side the model was trained at (metadata: any latent size runs)"})
    in_channels: int = field(default=4, metadata={"help": "latent channels in"})
    out_channels: int = field(default=4, metadata={"help": "channels predicted (noise / v / x0)"})
    center_input_sample: bool = field(default=False, metadata={"help": "map the input x -> 2x - 1 first"})
    flip_sin_to_cos: bool = field(default=True, metadata={"help": "timestep embedding as [cos, sin] (else [sin, cos])"})
    freq_shift: int = field(default=0, metadata={"help": "timestep embedding frequency shift (SD: 0)"})
    down_block_types: tuple[str, ...] = field(default=(
        "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"), metadata={
        "help": "per level: CrossAttnDownBlock2D (ResNets + transformers) or DownBlock2D (ResNets only)"})
    mid_block_type: str | None = field(default="UNetMidBlock2DCrossAttn", metadata={
        "help": "UNetMidBlock2DCrossAttn (ResNet, transformer, ResNet) or None (no mid block)"})
    up_block_types: tuple[str, ...] = field(default=(
        "UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), metadata={
        "help": "per level, deepest first: CrossAttnUpBlock2D or UpBlock2D"})
    only_cross_attention: bool | tuple[bool, ...] = field(default=False, metadata={
        "help": "per level: attn1 attends to the text too (no self-attention)"})
    block_out_channels: tuple[int, ...] = field(default=(320, 640, 1280, 1280), metadata={
        "help": "width C_i per level; levels-1 stride-2 downsamples"})
    layers_per_block: int | tuple[int, ...] = field(default=2, metadata={
        "help": "ResNets per down level (up levels: +1)"})
    downsample_padding: int = field(default=1, metadata={"help": "padding of the stride-2 convs (only 1)"})
    mid_block_scale_factor: float = field(default=1.0, metadata={"help": "mid-block ResNet outputs are divided by it"})
    dropout: float = field(default=0.0, metadata={"help": "dropout in ResNets, attention outputs and feed-forwards"})
    act_fn: str = field(default="silu", metadata={"help": "activation (only silu / swish)"})
    norm_num_groups: int | None = field(default=32, metadata={"help": "GroupNorm groups"})
    norm_eps: float = field(default=1e-5, metadata={"help": "ResNet / output GroupNorm epsilon"})
    cross_attention_dim: int | tuple[int, ...] = field(default=1280, metadata={
        "help": "width of the text tokens (per level if a list)"})
    transformer_layers_per_block: int | tuple[int, ...] = field(default=1, metadata={
        "help": "BasicTransformerBlocks per Transformer2D, per level if a list (SDXL: [1, 2, 10])"})
    reverse_transformer_layers_per_block: tuple | None = field(default=None, metadata={
        "help": "asymmetric up-path transformer depths (not supported: None)"})
    encoder_hid_dim: int | None = field(default=None, metadata={"help": "text projection input (not supported)"})
    encoder_hid_dim_type: str | None = field(default=None, metadata={"help": "text projection type (not supported)"})
    attention_head_dim: int | tuple[int, ...] = field(default=8, metadata={
        "help": "diffusers' quirk: the number of attention HEADS per level (head width = C_i / this)"})
    num_attention_heads: int | tuple[int, ...] | None = field(default=None, metadata={
        "help": "heads per level, overriding attention_head_dim (written back as attention_head_dim)"})
    dual_cross_attention: bool = field(default=False, metadata={"help": "two text streams (not supported)"})
    use_linear_projection: bool = field(default=False, metadata={
        "help": "Transformer2D proj_in/proj_out as Linear (SD 2 / SDXL) instead of 1x1 convs (SD 1)"})
    class_embed_type: str | None = field(default=None, metadata={"help": "class embedding (not supported)"})
    addition_embed_type: str | None = field(default=None, metadata={
        "help": "None, or 'text_time' (SDXL: pooled text + size/crop ids added to the time embedding)"})
    addition_time_embed_dim: int | None = field(default=None, metadata={
        "help": "text_time: sinusoidal width per time id (SDXL: 256)"})
    num_class_embeds: int | None = field(default=None, metadata={"help": "class labels (not supported)"})
    upcast_attention: bool = field(default=False, metadata={
        "help": "compute attention in float32 when the model runs in fp16/bf16 (SD 2.1)"})
    resnet_time_scale_shift: str = field(default="default", metadata={
        "help": "'default': time embedding added before norm2; 'scale_shift': norm2(x) * (1 + s) + b"})
    resnet_skip_time_act: bool = field(default=False, metadata={"help": "only acts on Simple/Resnet blocks"})
    resnet_out_scale_factor: float = field(default=1.0, metadata={"help": "only acts on Simple/Resnet blocks"})
    time_embedding_type: str = field(default="positional", metadata={"help": "only 'positional' (sinusoidal)"})
    time_embedding_dim: int | None = field(default=None, metadata={"help": "E (default 4 C0)"})
    time_embedding_act_fn: str | None = field(default=None, metadata={
        "help": "activation applied once to the summed embedding (None or silu)"})
    timestep_post_act: str | None = field(default=None, metadata={
        "help": "activation after time_embedding.linear_2 (None or silu)"})
    time_cond_proj_dim: int | None = field(default=None, metadata={"help": "LCM timestep condition (not supported)"})
    conv_in_kernel: int = field(default=3, metadata={"help": "conv_in kernel (odd)"})
    conv_out_kernel: int = field(default=3, metadata={"help": "conv_out kernel (odd)"})
    projection_class_embeddings_input_dim: int | None = field(default=None, metadata={
        "help": "text_time: input width of add_embedding (pooled text width + 6 * addition_time_embed_dim)"})
    attention_type: str = field(default="default", metadata={"help": "only 'default' (no GLIGEN)"})
    class_embeddings_concat: bool = field(default=False, metadata={"help": "class embeddings (not supported)"})
    mid_block_only_cross_attention: bool | None = field(default=None, metadata={
        "help": "only acts on UNetMidBlock2DSimpleCrossAttn"})
    cross_attention_norm: str | None = field(default=None, metadata={"help": "only acts on Simple blocks"})
    addition_embed_type_num_heads: int = field(default=64, metadata={"help": "only acts on addition_embed_type='text'"})

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            setattr(self, name, tuple(getattr(self, name)))
        for name in ("only_cross_attention", "layers_per_block", "cross_attention_dim",
                     "transformer_layers_per_block", "attention_head_dim", "num_attention_heads"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        if isinstance(self.sample_size, list):
            self.sample_size = tuple(self.sample_size)
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"UNet config: {name}={getattr(self, name)!r} is not supported ({why})")

        allowed = {"time_embedding_type": ("positional",), "attention_type": ("default",),
                   "resnet_time_scale_shift": ("default", "scale_shift"), "act_fn": SILU_NAMES,
                   "mid_block_type": MID_TYPES, "addition_embed_type": (None, "text_time"),
                   "class_embed_type": (None,), "encoder_hid_dim_type": (None,), "encoder_hid_dim": (None,),
                   "num_class_embeds": (None,), "time_cond_proj_dim": (None,),
                   "reverse_transformer_layers_per_block": (None,), "time_embedding_act_fn": (None, *SILU_NAMES),
                   "timestep_post_act": (None, *SILU_NAMES), "dual_cross_attention": (False,),
                   "class_embeddings_concat": (False,), "downsample_padding": (1,)}
        for name, ok in allowed.items():
            if getattr(self, name) not in ok:
                bad(name, f"this implementation builds {' / '.join(map(repr, ok))}")
        if self.norm_num_groups is None:
            bad("norm_num_groups", "GroupNorms are required")
        n = len(self.down_block_types)
        for name, ok in (("down_block_types", DOWN_TYPES), ("up_block_types", UP_TYPES)):
            if any(t not in ok for t in getattr(self, name)):
                bad(name, f"block types: {' / '.join(ok)}")
        if len(self.up_block_types) != n or len(self.block_out_channels) != n:
            raise ValueError(f"UNet config: down_block_types, up_block_types and block_out_channels need one entry "
                             f"per level: {n}, {len(self.up_block_types)}, {len(self.block_out_channels)}")
        for name in ("only_cross_attention", "layers_per_block", "cross_attention_dim",
                     "transformer_layers_per_block", "attention_head_dim", "num_attention_heads"):
            _levels(getattr(self, name), n, name)
        if any(isinstance(v, (list, tuple)) for v in _levels(self.transformer_layers_per_block, n, "")):
            bad("transformer_layers_per_block", "per-layer lists need reverse_transformer_layers_per_block")
        for name in ("conv_in_kernel", "conv_out_kernel"):
            if getattr(self, name) % 2 != 1:
                bad(name, "kernel sides must be odd")
        if self.addition_embed_type == "text_time":
            for name in ("addition_time_embed_dim", "projection_class_embeddings_input_dim"):
                if getattr(self, name) is None:
                    bad(name, "addition_embed_type='text_time' needs it")
        for i, (c, h) in enumerate(zip(self.block_out_channels, self.heads)):
            if c % self.norm_num_groups:
                bad("norm_num_groups", f"must divide block_out_channels[{i}]={c}")
            if c < h:
                bad("attention_head_dim", f"level {i}: {h} heads for width {c}")

    # per-level views (tuples of len(levels)), diffusers' expansion of the int-or-list fields
    @property
    def levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def heads(self) -> tuple[int, ...]:
        return _levels(self.num_attention_heads if self.num_attention_heads is not None else self.attention_head_dim,
                       self.levels, "attention_head_dim")

    def per_level(self, name: str) -> tuple:
        return _levels(getattr(self, name), self.levels, name)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    def diffusers_config(self) -> dict:
        """config.json for diffusers' UNet2DConditionModel (heads written as attention_head_dim)."""
        cfg = asdict(self)
        if self.num_attention_heads is not None:
            cfg["attention_head_dim"], cfg["num_attention_heads"] = self.num_attention_heads, None
        return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}

    @classmethod
    def from_diffusers(cls, cfg: dict) -> UNetConfig:
        """Validate a diffusers config.json: a key we do not know, or a value we do not build, is an error."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in names)
        if unknown:
            raise ValueError(f"UNet config: unknown field(s) {unknown} (not UNet2DConditionModel config keys)")
        return cls(**{k: v for k, v in cfg.items() if k in names})


def _named(module: nn.Module, prefix: str) -> None:
    """Record in each hooked module the dotted names of its convs / GroupNorms / attention (for `SpatialOps`)."""
    for name, m in module.named_modules(prefix=prefix):
        if hasattr(m, "set_names"):
            m.set_names(name)


class ResnetBlock2D(nn.Module):
    """diffusers' ResnetBlock2D with the time-embedding projection (input: SiLU(emb), computed once per forward)."""

    def __init__(self, c_in: int, c_out: int, temb: int, groups: int, eps: float, scale_shift: bool,
                 out_scale: float, dropout: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in, eps=eps)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time_emb_proj = BiasLinear(temb, 2 * c_out if scale_shift else c_out)
        self.norm2 = nn.GroupNorm(groups, c_out, eps=eps)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None
        self.scale_shift, self.out_scale, self.dropout = scale_shift, out_scale, dropout

    def set_names(self, name: str) -> None:
        self.n_norm1, self.n_conv1, self.n_norm2, self.n_conv2 = (f"{name}.{m}" for m in ("norm1", "conv1", "norm2",
                                                                                          "conv2"))

    def forward(self, x: Tensor, temb_act: Tensor, ops: SpatialOps) -> Tensor:
        h = ops.conv(self.n_conv1, self.conv1, F.silu(ops.group_norm(self.n_norm1, self.norm1, x)))
        t = self.time_emb_proj(temb_act)[:, :, None, None]  # (B, C_out or 2 C_out, 1, 1)
        if self.scale_shift:
            scale, shift = t.chunk(2, dim=1)
            h = ops.group_norm(self.n_norm2, self.norm2, h) * (1 + scale) + shift
        else:
            h = ops.group_norm(self.n_norm2, self.norm2, h + t)
        h = F.silu(h)
        if self.dropout:
            h = F.dropout(h, self.dropout, self.training)
        h = ops.conv(self.n_conv2, self.conv2, h)
        out = (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h
        return out if self.out_scale == 1 else out / self.out_scale


class Attention(nn.Module):
    """diffusers' Attention as the UNet builds it: to_q/to_k/to_v without bias, to_out.0 with bias."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None, upcast: bool, dropout: float):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim, self.upcast, self.dropout = heads, head_dim, upcast, dropout
        self.to_q = BiasLinear(dim, inner, bias=False)
        self.to_k = BiasLinear(kv_dim or dim, inner, bias=False)
        self.to_v = BiasLinear(kv_dim or dim, inner, bias=False)
        self.to_out = nn.ModuleList([BiasLinear(inner, dim)])
        self.name = ""

    def set_names(self, name: str) -> None:
        self.name = name

    def forward(self, x: Tensor, context: Tensor | None, ops: SpatialOps) -> Tensor:
        """x (B, T, dim); context (B, S, kv_dim) for cross-attention, None for self-attention (hooked)."""
        b, t, _ = x.shape
        q = self.to_q(x).view(b, t, self.heads, self.head_dim)  # (B, T, H, D)
        if context is None:
            k = self.to_k(x).view(b, t, self.heads, self.head_dim)
            v = self.to_v(x).view(b, t, self.heads, self.head_dim)
            k, v = ops.self_kv(self.name, k, v)  # (B, N_all, H, D)
        else:
            s = context.shape[1]
            k = self.to_k(context).view(b, s, self.heads, self.head_dim)  # (B, S, H, D)
            v = self.to_v(context).view(b, s, self.heads, self.head_dim)
        if self.upcast and q.dtype in (torch.float16, torch.bfloat16):
            out = attention(q.float(), k.float(), v.float()).to(q.dtype)
        else:
            out = attention(q, k, v)  # (B, T, H, D)
        out = self.to_out[0](out.reshape(b, t, self.heads * self.head_dim))
        return F.dropout(out, self.dropout, self.training) if self.dropout else out


class GEGLU(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = BiasLinear(d_in, 2 * d_out)

    def forward(self, x: Tensor) -> Tensor:
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)


class FeedForward(nn.Module):
    """diffusers' FeedForward("geglu"): net.0 = GEGLU(dim, 4 dim), net.1 = dropout, net.2 = Linear(4 dim, dim)."""

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, 4 * dim), nn.Dropout(dropout), BiasLinear(4 * dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[1](self.net[0](x)))


class BasicTransformerBlock(nn.Module):
    """LN -> attn1 (self; cross with only_cross_attention) -> LN -> attn2 (cross) -> LN -> GEGLU FF, residuals."""

    def __init__(self, dim: int, heads: int, head_dim: int, cross_dim: int, only_cross: bool, upcast: bool,
                 dropout: float):
        super().__init__()
        self.only_cross = only_cross
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim, cross_dim if only_cross else None, upcast, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, head_dim, cross_dim, upcast, dropout)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout)

    def forward(self, x: Tensor, context: Tensor, ops: SpatialOps) -> Tensor:
        x = x + self.attn1(self.norm1(x), context if self.only_cross else None, ops)
        x = x + self.attn2(self.norm2(x), context, ops)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nn.Module):
    """diffusers' Transformer2DModel on continuous input: GroupNorm, proj_in, blocks, proj_out, + residual."""

    def __init__(self, heads: int, c: int, layers: int, cross_dim: int, groups: int, linear: bool,
                 only_cross: bool, upcast: bool, dropout: float):
        super().__init__()
        head_dim = c // heads
        self.inner, self.linear = heads * head_dim, linear
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.proj_in = BiasLinear(c, self.inner) if linear else nn.Conv2d(c, self.inner, 1)
        self.transformer_blocks = nn.ModuleList([
            BasicTransformerBlock(self.inner, heads, head_dim, cross_dim, only_cross, upcast, dropout)
            for _ in range(layers)])
        self.proj_out = BiasLinear(self.inner, c) if linear else nn.Conv2d(self.inner, c, 1)

    def set_names(self, name: str) -> None:
        self.n_norm = f"{name}.norm"

    def forward(self, x: Tensor, context: Tensor, ops: SpatialOps) -> Tensor:
        b, c, h, w = x.shape
        t = ops.group_norm(self.n_norm, self.norm, x)
        t = t.permute(0, 2, 3, 1).reshape(b, h * w, c)  # (B, HW, C): a view when x is channels_last
        # the 1x1-conv projections (SD 1) as the matmuls they are, on the token rows: no NCHW <-> NHWC copies
        t = self.proj_in(t) if self.linear else F.linear(t, self.proj_in.weight.view(self.inner, c),
                                                         self.proj_in.bias)  # (B, HW, inner)
        for blk in self.transformer_blocks:
            t = blk(t, context, ops)
        t = self.proj_out(t) if self.linear else F.linear(t, self.proj_out.weight.view(c, self.inner),
                                                          self.proj_out.bias)  # (B, HW, C)
        t = t.view(b, h, w, c).permute(0, 3, 1, 2)  # (B, C, H, W), channels_last strides
        return x + t if x.is_contiguous(memory_format=torch.channels_last) else x + t.contiguous()


class _Resample(nn.Module):
    """Downsample2D (3x3 conv, stride 2, padding 1) or Upsample2D (nearest x2, 3x3 conv): `conv` is the key."""

    def __init__(self, c: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=stride, padding=1)
        self.up = stride == 1
        self.name = ""

    def set_names(self, name: str) -> None:
        self.name = f"{name}.conv"

    def forward(self, x: Tensor, ops: SpatialOps, size: torch.Size | None = None) -> Tensor:
        if self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest") if size is None else \
                F.interpolate(x, size=size, mode="nearest")
        return ops.conv(self.name, self.conv, x)


class _Level(nn.Module):
    """One down / up level (diffusers' CrossAttn{Down,Up}Block2D, {Down,Up}Block2D) or the mid block."""

    def _transformer(self, cfg: UNetConfig, c: int, level: int, up: bool) -> Transformer2DModel:
        pick = (lambda v: v[::-1][level]) if up else (lambda v: v[level])
        return Transformer2DModel(pick(cfg.heads), c, pick(cfg.per_level("transformer_layers_per_block")),
                                  pick(cfg.per_level("cross_attention_dim")), cfg.norm_num_groups,
                                  cfg.use_linear_projection, pick(cfg.per_level("only_cross_attention")),
                                  cfg.upcast_attention, cfg.dropout)


def _resnet(cfg: UNetConfig, c_in: int, c_out: int, out_scale: float = 1.0) -> ResnetBlock2D:
    return ResnetBlock2D(c_in, c_out, cfg.time_embed_dim, cfg.norm_num_groups, cfg.norm_eps,
                         cfg.resnet_time_scale_shift == "scale_shift", out_scale, cfg.dropout)


class DownBlock(_Level):
    def __init__(self, cfg: UNetConfig, level: int, c_in: int, c_out: int):
        super().__init__()
        layers = cfg.per_level("layers_per_block")[level]
        self.resnets = nn.ModuleList([_resnet(cfg, c_in if i == 0 else c_out, c_out) for i in range(layers)])
        if cfg.down_block_types[level] == "CrossAttnDownBlock2D":
            self.attentions = nn.ModuleList([self._transformer(cfg, c_out, level, False) for _ in range(layers)])
        else:
            self.attentions = None
        last = level == cfg.levels - 1
        self.downsamplers = None if last else nn.ModuleList([_Resample(c_out, stride=2)])

    def forward(self, x: Tensor, temb_act: Tensor, context: Tensor, ops: SpatialOps, skips: list[Tensor]) -> Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb_act, ops)
            if self.attentions is not None:
                x = self.attentions[i](x, context, ops)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x, ops)
            skips.append(x)
        return x


class UpBlock(_Level):
    def __init__(self, cfg: UNetConfig, level: int):
        super().__init__()
        rev = cfg.block_out_channels[::-1]
        prev, c_out, c_skip_in = rev[max(level - 1, 0)], rev[level], rev[min(level + 1, cfg.levels - 1)]
        layers = cfg.per_level("layers_per_block")[::-1][level] + 1
        self.resnets = nn.ModuleList([
            _resnet(cfg, (prev if i == 0 else c_out) + (c_skip_in if i == layers - 1 else c_out), c_out)
            for i in range(layers)])
        if cfg.up_block_types[level] == "CrossAttnUpBlock2D":
            self.attentions = nn.ModuleList([self._transformer(cfg, c_out, level, True) for _ in range(layers)])
        else:
            self.attentions = None
        last = level == cfg.levels - 1
        self.upsamplers = None if last else nn.ModuleList([_Resample(c_out, stride=1)])

    def forward(self, x: Tensor, skips: list[Tensor], temb_act: Tensor, context: Tensor, ops: SpatialOps,
                size: torch.Size | None) -> Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips.pop()], dim=1), temb_act, ops)  # (B, C + C_skip, H, W)
            if self.attentions is not None:
                x = self.attentions[i](x, context, ops)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, ops, size)
        return x


class MidBlock(_Level):
    """UNetMidBlock2DCrossAttn: ResNet, Transformer2D, ResNet (ResNet outputs / mid_block_scale_factor)."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        c, s = cfg.block_out_channels[-1], cfg.mid_block_scale_factor
        self.resnets = nn.ModuleList([_resnet(cfg, c, c, s), _resnet(cfg, c, c, s)])
        # diffusers' mid block: the deepest level's heads / depth / text width; only_cross_attention never applies
        heads, layers = cfg.heads[-1], cfg.per_level("transformer_layers_per_block")[-1]
        self.attentions = nn.ModuleList([Transformer2DModel(
            heads, c, layers, cfg.per_level("cross_attention_dim")[-1], cfg.norm_num_groups,
            cfg.use_linear_projection, False, cfg.upcast_attention, cfg.dropout)])

    def forward(self, x: Tensor, temb_act: Tensor, context: Tensor, ops: SpatialOps) -> Tensor:
        x = self.resnets[0](x, temb_act, ops)
        return self.resnets[1](self.attentions[0](x, context, ops), temb_act, ops)


class TimestepEmbedding(nn.Module):
    """linear_1, SiLU, linear_2 (+ optional SiLU after): diffusers' TimestepEmbedding."""

    def __init__(self, d_in: int, d_out: int, post_act: bool = False):
        super().__init__()
        self.linear_1, self.linear_2, self.post_act = BiasLinear(d_in, d_out), BiasLinear(d_out, d_out), post_act

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear_2(F.silu(self.linear_1(x)))
        return F.silu(x) if self.post_act else x


class UNet2DConditionModel(nn.Module):
    """forward(sample (B, C, h, w), timestep (B,) / scalar, text (B, L, D)) -> (B, C_out, h, w)."""

    def __init__(self, config: UNetConfig):
        super().__init__()
        cfg = self.config = config
        ch, e = cfg.block_out_channels, cfg.time_embed_dim
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], cfg.conv_in_kernel, padding=cfg.conv_in_kernel // 2)
        self.time_embedding = TimestepEmbedding(ch[0], e, post_act=cfg.timestep_post_act is not None)
        if cfg.addition_embed_type == "text_time":
            self.add_embedding = TimestepEmbedding(cfg.projection_class_embeddings_input_dim, e)
        self.down_blocks = nn.ModuleList([
            DownBlock(cfg, i, ch[max(i - 1, 0)], ch[i]) for i in range(cfg.levels)])
        self.mid_block = MidBlock(cfg) if cfg.mid_block_type is not None else None
        self.up_blocks = nn.ModuleList([UpBlock(cfg, i) for i in range(cfg.levels)])
        self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, ch[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(ch[0], cfg.out_channels, cfg.conv_out_kernel, padding=cfg.conv_out_kernel // 2)
        _named(self, "")
        self.to(memory_format=torch.channels_last)  # conv weights NHWC as the local forward runs: no per-call reorder

    def time_embed(self, timestep: Tensor | float | int, batch: int, dtype: torch.dtype, device,
                   added_cond_kwargs: dict | None = None) -> Tensor:
        """emb (B, E): the time embedding (+ SDXL's text_time embedding), before the blocks' SiLU."""
        cfg = self.config
        t = timestep if torch.is_tensor(timestep) else torch.tensor([timestep], device=device)
        t = t.to(device).reshape(-1).expand(batch)  # (B,)
        emb = self.time_embedding(
            timestep_embedding(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift).to(dtype))
        if cfg.addition_embed_type == "text_time":
            for key in ("text_embeds", "time_ids"):
                if not added_cond_kwargs or key not in added_cond_kwargs:
                    raise ValueError(f"UNet with addition_embed_type='text_time' needs added_cond_kwargs[{key!r}]")
            text, ids = added_cond_kwargs["text_embeds"], added_cond_kwargs["time_ids"]
            ids = timestep_embedding(ids.flatten(), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos,
                                     cfg.freq_shift).reshape(text.shape[0], -1)  # (B, n_ids * addition_dim)
            emb = emb + self.add_embedding(torch.cat([text, ids], dim=-1).to(emb.dtype))
        if cfg.time_embedding_act_fn is not None:
            emb = F.silu(emb)
        return emb

    def forward(self, sample: Tensor, timestep: Tensor | float | int, encoder_hidden_states: Tensor,
                added_cond_kwargs: dict[str, Tensor] | None = None, ops: SpatialOps | None = None) -> Tensor:
        ops = LOCAL_OPS if ops is None else ops
        cfg = self.config
        if cfg.center_input_sample:
            sample = 2 * sample - 1.0
        # the local ops run channels_last (NHWC): oneDNN's convs without layout reorders, GroupNorm's NHWC kernel, and
        # the transformers' token rows as views; a SpatialOps subclass (patch parallelism) gets the sample as given
        nhwc = type(ops) is SpatialOps and sample.device.type == "cpu"
        if nhwc:
            sample = sample.contiguous(memory_format=torch.channels_last)
        emb = self.time_embed(timestep, sample.shape[0], sample.dtype, sample.device, added_cond_kwargs)
        temb_act = F.silu(emb)  # every ResNet's time_emb_proj input
        # sides not divisible by the total downsampling: upsample to the skip tensors' sizes (diffusers' rule)
        factor = 2 ** (cfg.levels - 1)
        odd = sample.shape[-2] % factor != 0 or sample.shape[-1] % factor != 0
        x = self._conv("conv_in", self.conv_in, sample, ops)
        skips = [x]
        for blk in self.down_blocks:
            x = blk(x, temb_act, encoder_hidden_states, ops, skips)
        if self.mid_block is not None:
            x = self.mid_block(x, temb_act, encoder_hidden_states, ops)
        for i, blk in enumerate(self.up_blocks):
            n = len(blk.resnets)
            size = skips[-n - 1].shape[2:] if odd and i < cfg.levels - 1 else None
            x = blk(x, skips, temb_act, encoder_hidden_states, ops, size)
        x = F.silu(ops.group_norm("conv_norm_out", self.conv_norm_out, x))
        out = self._conv("conv_out", self.conv_out, x, ops)
        return out.contiguous() if nhwc else out

    @staticmethod
    def _conv(name: str, conv: nn.Conv2d, x: Tensor, ops: SpatialOps) -> Tensor:
        return ops.conv(name, conv, x) if conv.kernel_size != (1, 1) else conv(x)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        variant: str | None = None) -> UNet2DConditionModel:
        """Load a diffusers `unet/` folder (config.json + diffusion_pytorch_model[.variant].safetensors).

        The weights are computed in `dtype` (default float32, whatever the file stores: fp16 files are upcast)."""
        from scratchlm.diffusion.io import load_diffusers_dir

        cfg, sd = load_diffusers_dir(path, variant)
        with torch.device("meta"):  # no random init of weights about to be replaced
            model = cls(UNetConfig.from_diffusers(cfg))
        want = set(model.state_dict())
        missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
        if missing or unexpected:
            raise ValueError(f"{path}: checkpoint does not match UNet2DConditionModel: "
                             f"missing {missing[:8]}, unexpected {unexpected[:8]}")
        dtype = dtype or torch.float32
        model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
        model.to(memory_format=torch.channels_last)  # the loaded conv weights NHWC too (see forward)
        return model.eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None, variant: str | None = None) -> None:
        """Write diffusers format; `dtype` casts the stored weights (e.g. float16 with variant="fp16")."""
        from scratchlm.diffusion.io import save_diffusers_dir

        sd = {k: v if dtype is None else v.to(dtype) for k, v in self.state_dict().items()}
        save_diffusers_dir(path, "UNet2DConditionModel", self.config.diffusers_config(), sd, variant)
