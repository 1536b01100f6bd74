"""Quantize a float model ("transform the state dict, then swap the modules") and save / load the result.

    from scratchlm.inference.quantization import quantize_model
    qmodel = quantize_model(model, "int4-g32-asym")       # a QuantizedTransformerLM
    save_quantized("smollm2-int4.pt", qmodel, tokenizer)   # scheme + per-module formats inside
    model, tokenizer, config = load_quantized("smollm2-int4.pt")
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from scratchlm import atomic
from scratchlm.inference.quantization import calibrate, gptq, kernels
from scratchlm.inference.quantization.modules import (
    EMBEDDING,
    HEAD,
    QuantizedTransformerLM,
    linear_shapes,
    quantize_weight,
)
from scratchlm.inference.quantization.scheme import LayerFormat, QuantScheme, parse_scheme
from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.checkpoint import load_torch_file
from scratchlm.model.loading.common import CheckpointError, LoadedModel

log = logging.getLogger(__name__)

FORMAT = "scratchlm-quantized"
FORMAT_VERSION = 1


def layout_for(config: ModelConfig, scheme: QuantScheme) -> dict[str, LayerFormat]:
    """Module path -> LayerFormat for every module `scheme` quantizes; checks every shape first."""
    shapes = linear_shapes(config)
    layout = {name: scheme.linear for name in shapes}
    if scheme.quantize_head:
        layout[HEAD] = scheme.head or scheme.linear
    if scheme.quantize_embedding:
        layout[EMBEDDING] = scheme.linear
    problems = []
    for name, fmt in layout.items():
        d_in = shapes[name][0] if name in shapes else config.d_model  # the head and embedding: d_model
        try:
            fmt.check(d_in, name)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError(f"scheme {scheme.name!r} does not fit this model: " + "; ".join(problems[:3]) +
                         (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))
    return layout


def _quantize(w: Tensor, fmt: LayerFormat, search: str, stats: Tensor | None) -> dict[str, Tensor]:
    """One weight -> its buffers; int4 with search="mse" goes through the error-minimizing search."""
    if fmt.bits != 4 or search == "rtn":
        return quantize_weight(w, fmt)
    if search == "gptq" and stats is not None and stats.dim() == 2:
        q, d, m = gptq.gptq_int4(w, stats, fmt.group_size, fmt.symmetric)
    else:
        if stats is not None and stats.dim() == 2:
            stats = torch.diagonal(stats)  # E[x x^T] -> E[x^2]
        q, d, m = calibrate.quantize_int4_searched(
            w, fmt.group_size, fmt.symmetric, None if stats is None else calibrate.channel_weights(stats, w.shape[1]))
    return {"qweight": q, "scales": d} if m is None else {"qweight": q, "scales": d, "mins": m}


@torch.no_grad()
def quantize_state_dict(state: dict[str, Tensor], config: ModelConfig, layout: dict[str, LayerFormat],
                        search: str = "rtn", act_stats: dict[str, Tensor] | None = None,
                        done: dict[str, dict[str, Tensor]] | None = None) -> dict[str, Tensor]:
    """A float `TransformerLM` state dict -> the state dict of `QuantizedTransformerLM(config, layout)`.

    search: "rtn" (round-to-nearest), "mse" (int4 parameters by `calibrate.search_int4_params`,
    weighted by `act_stats[module path]` = E[x^2] per input channel (or the diagonal of E[x x^T])
    where given) or "gptq" (`gptq.gptq_int4` with `act_stats[module path]` = E[x x^T], one-shot
    from the float model; modules without a Hessian get "mse"). `done`: module path -> buffers
    already quantized (`gptq.quantize_sequential`), used as they are.
    """
    if search not in calibrate.SEARCHES:
        raise ValueError(f"search={search!r} must be one of {calibrate.SEARCHES}")
    stats = act_stats or {}
    done = done or {}
    out = dict(state)
    for name in tqdm([n for n in layout if n not in (HEAD, EMBEDDING)], desc="quantizing", unit="layer",
                     leave=False, disable=None):
        w = out.pop(f"{name}.weight")
        buffers = done.get(name) or _quantize(w, layout[name], search, stats.get(name))
        for key, t in buffers.items():
            out[f"{name}.{key}"] = t
    emb = state["tok_embeddings.weight"]
    if HEAD in layout:
        head_w = out.pop("lm_head.weight", None)
        source = emb if head_w is None else head_w
        # With no activation statistics the unweighted search raises the head's error where it matters
        # (int4-g32 on SmolLM2: +6.8 % ΔPPL against +2.4 % for round-to-nearest, results 2026-12-01), so an
        # uncalibrated head keeps round-to-nearest; the other layers gain from the weight-only search.
        head_search = "rtn" if search == "mse" and stats.get(HEAD) is None else search
        head = done.get(HEAD) or _quantize(source, layout[HEAD], head_search, stats.get(HEAD))
        for key, t in head.items():
            out[f"{HEAD}.{key}"] = t
    if EMBEDDING in layout:
        out.pop("tok_embeddings.weight")
        tied_and_same = HEAD in layout and "lm_head.weight" not in state and layout[HEAD] == layout[EMBEDDING]
        emb_q = head if tied_and_same else _quantize(emb, layout[EMBEDDING], search, None)  # lookup rows: plain MSE
        for key, t in emb_q.items():
            out[f"{EMBEDDING}.{key}"] = t  # tied: the same tensors as the head's (stored once)
    return out


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def quantize_model(model: nn.Module, scheme: str | QuantScheme, calibration: Tensor | None = None
                   ) -> QuantizedTransformerLM:
    """Quantize a `TransformerLM` (weight-only) into a new `QuantizedTransformerLM` on the same device.

    `scheme`: a name (`parse_scheme`: int8, int4-g32-asym, ...) or a QuantScheme. `calibration`:
    optional (batch, seq) token ids (`calibrate.calibration_tokens`). With them the default int4
    search (``auto``) is sequential GPTQ (`gptq.quantize_sequential`: one forward, each layer
    calibrated on the already-quantized prefix's activations); ``+mse`` weights the search by their
    E[x^2]. Without them the search is weight-only. Raises ValueError when a layer's shape does not
    fit the scheme (e.g. int4 with d_in not a multiple of 32).
    """
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    config = model.config
    layout = layout_for(config, scheme)
    search = scheme.resolved_search(calibration is not None)
    if search == "gptq" and calibration is None:
        raise ValueError(f"scheme {scheme.name!r}: +gptq needs calibration tokens (e.g. --quantization-calibration "
                         f"TEXT_FILE); without them use the default search")
    stats, done = None, None
    if calibration is not None and search == "mse":
        stats = calibrate.activation_stats(model, calibration)
    elif search == "gptq":
        int4 = {n: f for n, f in layout.items() if n not in (HEAD, EMBEDDING) and f.bits == 4}
        head = layout.get(HEAD) if layout.get(HEAD) is not None and layout[HEAD].bits == 4 else None
        done = gptq.quantize_sequential(model, calibration, int4, head=head)
    if calibration is not None and search != "rtn":
        log.info("int4 %s calibrated on %d tokens", search, calibration.numel())
    coarse = [f.group_size for f in layout.values() if f is not None and f.bits == 4 and (f.group_size or 0) > 32]
    if calibration is None and coarse:  # measured on SmolLM2-135M, WikiText-2: docs/quantization.md "int4 quality"
        log.warning("int4 with %d-wide groups and no calibration text: expect a large perplexity cost (+48 %% on "
                    "SmolLM2-135M at g128, against +4.5 %% calibrated); pass --quantization-calibration TEXT_FILE "
                    "(a few pages of text like the model's) for GPTQ", max(coarse))
    state = quantize_state_dict(model.state_dict(), config, layout, search=search, act_stats=stats, done=done)
    dtype = _float_dtype(model)
    with torch.device("meta"):
        qmodel = QuantizedTransformerLM(config, layout, scheme_name=scheme.name, dtype=dtype)
    qmodel.load_state_dict(state, strict=True, assign=True)
    qmodel.requires_grad_(False)  # inference only (and keeps the model layer's training-only fused paths off)
    log.info("quantized model with %s: %d modules, %.1f MiB of weights", scheme.name, len(layout),
             qmodel.weight_bytes() / 2**20)
    return qmodel.eval()


def save_quantized(path: str | Path, model: QuantizedTransformerLM, tokenizer: Any = None) -> Path:
    """Write a quantized checkpoint atomically (temp file + os.replace), scheme and layout inside."""
    if not isinstance(model, QuantizedTransformerLM):
        raise TypeError(f"save_quantized needs a QuantizedTransformerLM, got {type(model).__name__}")
    path = Path(path)
    tok_state = None
    if tokenizer is not None:
        from scratchlm.tokenizer import tokenizer_to_state

        tok_state = tokenizer_to_state(tokenizer)
    ckpt = {
        "format": FORMAT, "version": FORMAT_VERSION, "scheme": model.scheme_name,
        "layout": {name: fmt.to_dict() for name, fmt in model.layout.items()},
        "model_config": model.config.to_dict(), "model": model.state_dict(), "tokenizer": tok_state,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    atomic.replace(tmp, path)
    return path


def load_quantized(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                   ) -> LoadedModel:
    """Load a checkpoint written by `save_quantized` -> LoadedModel(QuantizedTransformerLM, tokenizer, config)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"quantized checkpoint not found: {path}")
    ckpt = load_torch_file(path, "torch checkpoint")  # weights-only: a file that would run code is refused
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: not a quantized scratchlm checkpoint (expected format {FORMAT!r}, "
                              f"found {found!r})")
    try:
        config = ModelConfig.from_dict(dict(ckpt["model_config"]))
        layout = {name: LayerFormat.from_dict(d) for name, d in ckpt["layout"].items()}
        kernels.check_gguf_kernels({n: f.gguf_type for n, f in layout.items() if f.raw}, torch.device(device).type)
        with torch.device("meta"):
            model = QuantizedTransformerLM(config, layout, scheme_name=str(ckpt.get("scheme", "custom")),
                                           dtype=dtype)
        model.load_state_dict(ckpt["model"], strict=True, assign=True)
        model.requires_grad_(False)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: quantized checkpoint does not fit its recorded layout ({e})") from None
    tokenizer = None
    if ckpt.get("tokenizer") is not None:
        from scratchlm.tokenizer import tokenizer_from_state

        tokenizer = tokenizer_from_state(ckpt["tokenizer"])
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model, tokenizer, config)
