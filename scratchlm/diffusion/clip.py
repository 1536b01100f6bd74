"""The CLIP text encoder of Stable Diffusion, equal to transformers' `CLIPTextModel` / `CLIPTextModelWithProjection`.

    ids (B, T) -> token embedding + learned position embedding (B, T, d)
    each of `num_hidden_layers` pre-LN blocks:
        x += out_proj(causal_attention(q_proj, k_proj, v_proj of LN1(x)))     # (biases on all four)
        x += fc2(act(fc1(LN2(x))))                                            # act: quick_gelu (OpenAI) or gelu
    last_hidden_state = final_layer_norm(x)
    pooler_output = last_hidden_state at the end-of-text token of each row
    text_embeds = text_projection(pooler_output)                               # WithProjection only (SDXL's 2nd)

`hidden_states` (with `output_hidden_states=True`) is what transformers returns: the embeddings' output, then each
block's output, *before* the final layer norm (num_hidden_layers + 1 tensors). SD 1.x conditions on
`last_hidden_state`; SD 2.x folders ship the encoder with its last block already removed; `clip_skip` and SDXL take
`hidden_states[-2]` (SDXL without the final norm, diffusers' `clip_skip` with it: see `encode_prompt_hidden`).

The pooled token, as transformers picks it: a config with `eos_token_id == 2` (the folders written before
transformers' PR #24773, SD 1.x / 2.x / SDXL among them) takes the position of the *largest id* in each row (the
end-of-text token is the largest id of the original vocabulary); any other `eos_token_id` takes the *first*
position holding it.

Checkpoints: a transformers folder (`config.json` + `model.safetensors`, or a `model.<variant>.safetensors` such as
`model.fp16.safetensors`, or a sharded `model.safetensors.index.json`) loads with a strict match on transformers'
state-dict keys. Shipped folders (and transformers 4.x) prefix the text model's keys with `text_model.`;
transformers 5 writes a bare `CLIPTextModel` without it: both load. We write the prefixed form, which every version
reads. The non-persistent `position_ids` buffer older checkpoints carry is checked (it must be 0..n-1) and dropped.
`config.json` fields: the architecture fields are `CLIPTextConfig`'s (same names); transformers' bookkeeping keys
(`METADATA_KEYS`) are read past; any other key, or an unsupported value (an activation we do not have, nonzero
dropout, a list of eos ids), is an error naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import Tensor, nn

from scratchlm import atomic
from scratchlm.diffusion.layers import BiasLinear
from scratchlm.model.layers import Embedding, LayerNorm, Linear, causal_attention

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
PREFIX = "text_model."

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # OpenAI CLIP's x * sigmoid(1.702 x)
    "gelu": F.gelu,  # erf GELU (OpenCLIP ViT-H / bigG: SD 2.x, SDXL's second encoder)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# config.json keys that describe transformers' own machinery (serialisation, generation defaults, heads), not the
# text encoder's forward; read past. Anything else unknown is an error.
METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "tie_word_embeddings", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "finetuning_task", "id2label",
    "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "problem_type", "dropout", "initializer_range", "initializer_factor", "gradient_checkpointing",
})


@dataclass
class CLIPTextConfig:
    """transformers' CLIPTextConfig (same field names and defaults); `projection_dim` is read by WithProjection."""

    vocab_size: int = field(default=49408, metadata={"help": "token embedding rows (CLIP's BPE: 49408)"})
    hidden_size: int = field(default=512, metadata={"help": "model width d (SD 1.x: 768, SD 2.x: 1024, bigG: 1280)"})
    intermediate_size: int = field(default=2048, metadata={"help": "MLP hidden width (4 d in every CLIP)"})
    projection_dim: int = field(default=512, metadata={"help": "text_projection output width (WithProjection)"})
    num_hidden_layers: int = field(default=12, metadata={"help": "transformer blocks"})
    num_attention_heads: int = field(default=8, metadata={"help": "attention heads; head dim = hidden_size / heads"})
    max_position_embeddings: int = field(default=77, metadata={"help": "position table rows = longest prompt"})
    hidden_act: str = field(default="quick_gelu", metadata={"help": "MLP activation: " + ", ".join(ACTIVATIONS)})
    layer_norm_eps: float = field(default=1e-5, metadata={"help": "LayerNorm epsilon"})
    attention_dropout: float = field(default=0.0, metadata={"help": "must be 0: inference only, no dropout"})
    pad_token_id: int | None = field(default=1, metadata={"help": "pad id (informational; the tokenizer pads)"})
    bos_token_id: int | None = field(default=49406, metadata={"help": "start-of-text id (informational)"})
    eos_token_id: int = field(default=49407, metadata={
        "help": "end-of-text id the pooled output is taken at; 2 (pre-2023 folders) = argmax of the ids"})

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"CLIPTextConfig.hidden_act={self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if self.attention_dropout:
            raise ValueError(f"CLIPTextConfig.attention_dropout={self.attention_dropout} is not supported (only 0)")
        if not isinstance(self.eos_token_id, int):
            raise ValueError(f"CLIPTextConfig.eos_token_id={self.eos_token_id!r} is not supported (one int)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"CLIPTextConfig.hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> CLIPTextConfig:
        """From a transformers config.json dict; unknown keys are errors, METADATA_KEYS are read past."""
        if cfg.get("model_type", "clip_text_model") != "clip_text_model":
            raise ValueError(f"{where}: model_type={cfg['model_type']!r} is not supported (expected 'clip_text_model'; "
                             "a full CLIPModel folder has its text tower under text_config)")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in cfg if k not in names and k not in METADATA_KEYS)
        if unknown:
            raise ValueError(f"{where}: unsupported CLIPTextConfig field(s) {unknown}")
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def to_hf(self, architecture: str, dtype: torch.dtype) -> dict:
        """config.json for transformers (`architectures`, `model_type`, `torch_dtype` plus the fields)."""
        return {"architectures": [architecture], "model_type": "clip_text_model",
                "torch_dtype": str(dtype).removeprefix("torch."), **asdict(self)}


@dataclass
class CLIPTextOutput:
    """What transformers' output object carries, by the same names."""

    last_hidden_state: Tensor  # (B, T, d), after the final layer norm
    pooler_output: Tensor  # (B, d): last_hidden_state at each row's end-of-text token
    hidden_states: tuple[Tensor, ...] | None = None  # num_hidden_layers + 1 tensors (B, T, d), before the final norm
    text_embeds: Tensor | None = None  # (B, projection_dim), WithProjection only


class CLIPAttention(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        d = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (BiasLinear(d, d) for _ in range(4))

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        b, t, d = x.shape
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)  # (B, T, H, Dh)
        if pad_mask is None:
            o = causal_attention(q, k, v)  # (B, T, H, Dh)
        else:  # causal AND the key is not padding: (B, 1, T, T) boolean, True = attend
            allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() & pad_mask[:, None, None, :].bool()
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=allowed).transpose(1, 2)  # (B, T, H, Dh)
        return self.out_proj(o.reshape(b, t, d))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = BiasLinear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = BiasLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x), pad_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.token_embedding = Embedding(cfg.vocab_size, cfg.hidden_size, std=0.02)
        self.position_embedding = Embedding(cfg.max_position_embeddings, cfg.hidden_size, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        t, n = ids.shape[-1], self.position_embedding.num_embeddings
        if t > n:
            raise ValueError(f"CLIP text encoder: {t} tokens, more than max_position_embeddings={n}")
        return self.token_embedding(ids) + self.position_embedding.weight[:t]  # (B, T, d)


class _Encoder(nn.Module):
    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class CLIPTextTransformer(nn.Module):
    """The text tower; its parameter names are transformers' (under `text_model.` in a checkpoint)."""

    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = CLIPTextEmbeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                output_hidden_states: bool = False) -> CLIPTextOutput:
        """input_ids (B, T) long; attention_mask (B, T) 1 = token, 0 = padding (keys masked; SD pipelines pass none)."""
        x = self.embeddings(input_ids)
        pad_mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        hidden = [x] if output_hidden_states else None
        for layer in self.encoder.layers:
            x = layer(x, pad_mask)
            if hidden is not None:
                hidden.append(x)
        last = self.final_layer_norm(x)
        pooled = last[torch.arange(last.shape[0], device=last.device), self.eos_positions(input_ids)]  # (B, d)
        return CLIPTextOutput(last, pooled, tuple(hidden) if hidden is not None else None)

    def eos_positions(self, input_ids: Tensor) -> Tensor:
        """(B,) position of each row's end-of-text token, chosen as transformers chooses it (module docstring)."""
        ids = input_ids.to(torch.int)
        if self.config.eos_token_id == 2:
            return ids.argmax(dim=-1)
        return (ids == self.config.eos_token_id).int().argmax(dim=-1)


class _CLIPTextBase(nn.Module):
    architecture = ""

    def __init__(self, cfg: CLIPTextConfig):
        super().__init__()
        self.config = cfg
        self.text_model = CLIPTextTransformer(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.final_layer_norm.weight.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, variant: str | None = None):
        """Load a transformers folder. `variant` ("fp16"): `model.fp16.safetensors`; without one, `model.safetensors`,
        else the only `model.*.safetensors` there. `dtype` None: float32 (fp16 files are widened; the modules compute
        in the parameters' dtype)."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: expected a transformers CLIP text encoder folder")
        hf = json.loads(cfg_path.read_text())
        arch = hf.get("architectures") or [cls.architecture]
        if cls is CLIPTextModelWithProjection and arch[0] != cls.architecture:
            raise ValueError(f"{cfg_path}: architectures={arch} has no text_projection; load it as CLIPTextModel")
        cfg = CLIPTextConfig.from_hf(hf, str(cfg_path))
        sd = _read_weights(path, variant)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(_match_keys(model, sd, path, dtype or torch.float32), strict=True, assign=True)
        return model.eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None, variant: str | None = None) -> None:
        """Write a transformers folder: config.json + model[.<variant>].safetensors, keys under `text_model.`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.dtype
        sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        name = WEIGHTS if variant is None else f"model.{variant}.safetensors"
        atomic.write_bytes(path / name, save(sd, metadata={"format": "pt"}))
        atomic.write_text(path / "config.json", json.dumps(self.config.to_hf(self.architecture, dtype), indent=2))


class CLIPTextModel(_CLIPTextBase):
    """transformers' CLIPTextModel: `forward(ids)` -> CLIPTextOutput (last_hidden_state, pooler_output, ...)."""

    architecture = "CLIPTextModel"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                output_hidden_states: bool = False) -> CLIPTextOutput:
        return self.text_model(input_ids, attention_mask, output_hidden_states)


class CLIPTextModelWithProjection(_CLIPTextBase):
    """transformers' CLIPTextModelWithProjection (SDXL's second encoder): adds `text_embeds`, the pooled output
    through `text_projection` (no bias)."""

    architecture = "CLIPTextModelWithProjection"

    def __init__(self, cfg: CLIPTextConfig):
        super().__init__(cfg)
        self.text_projection = Linear(cfg.hidden_size, cfg.projection_dim)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                output_hidden_states: bool = False) -> CLIPTextOutput:
        out = self.text_model(input_ids, attention_mask, output_hidden_states)
        out.text_embeds = self.text_projection(out.pooler_output)
        return out


def encode_prompt_hidden(out: CLIPTextOutput, final_norm: nn.Module, clip_skip: int | None,
                         normed: bool = True) -> Tensor:
    """The prompt embedding diffusers' pipelines take: `last_hidden_state` when `clip_skip` is None, else
    `hidden_states[-(clip_skip + 1)]`, through the final layer norm when `normed` (SD 1.x / 2.x's `clip_skip`),
    raw when not (SDXL, which always takes `hidden_states[-2]`). Needs `output_hidden_states=True` for a clip_skip."""
    if clip_skip is None:
        return out.last_hidden_state
    if out.hidden_states is None:
        raise ValueError("clip_skip needs the encoder run with output_hidden_states=True")
    h = out.hidden_states[-(clip_skip + 1)]
    return final_norm(h) if normed else h


def _read_weights(path: Path, variant: str | None) -> dict[str, Tensor]:
    """The state dict of a transformers folder (single file or sharded index); errors name what is missing."""
    stem = "model" if variant is None else f"model.{variant}"
    single, index = path / f"{stem}.safetensors", path / f"{stem}.safetensors.index.json"
    if not single.is_file() and not index.is_file() and variant is None:
        others = sorted(p for p in path.glob("model.*.safetensors") if p.name.count(".") == 2)
        if len(others) == 1:
            log.info("%s: no %s; loading %s", path, WEIGHTS, others[0].name)
            single = others[0]
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd: dict[str, Tensor] = {}
        for s in shards:
            sd.update(load_file(str(path / s)))
        return sd
    bins = [p.name for p in path.glob("*.bin")]
    hint = f" ({bins} are pickles: convert them to safetensors)" if bins else ""
    raise FileNotFoundError(f"{path}: no {single.name} or {index.name}{hint}")


def _match_keys(model: nn.Module, sd: dict[str, Tensor], path: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """The checkpoint's tensors under our names (adding the `text_model.` prefix transformers 5 leaves off), cast to
    `dtype`; missing or unexpected keys, or a wrong shape, are an error."""
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        key = k if k.startswith(PREFIX) or k == "text_projection.weight" else PREFIX + k
        if key == PREFIX + "embeddings.position_ids":  # old checkpoints' non-persistent buffer: check and drop
            if not torch.equal(v.reshape(-1).long(), torch.arange(v.numel())):
                raise ValueError(f"{path}: {k} is not 0..{v.numel() - 1}; custom position ids are not supported")
            continue
        out[key] = v.to(dtype)
    ours = model.state_dict()
    missing, unexpected = sorted(set(ours) - set(out)), sorted(set(out) - set(ours))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match {type(model).__name__}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, v in out.items():
        if v.shape != ours[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the config says {tuple(ours[k].shape)}")
    return out
