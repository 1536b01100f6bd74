"""One entry point for the engine: load any model path with a `--quantization` choice applied.

    loaded = load_model_quantized(path, "int8")     # LoadedModel(model, tokenizer, config)
    engine = LLMEngine(*loaded, config)

`quantization`: None (float, as `scratchlm.model.load`), ``"gguf"`` (a .gguf file with every quantized
tensor kept packed in its own type: Q4_0/Q4_1/Q8_0 as int planes, K-quants, Q5_x and IQ4 as the file's blocks;
`gguf_packed.py`) or a scheme name (`parse_scheme`). A checkpoint written by
`save_quantized` is recognised by its format and loaded as stored (then `quantization` must be
None or equal to the recorded scheme).
"""

from __future__ import annotations

from pathlib import Path

import torch

from scratchlm.inference.quantization.calibrate import CALIBRATION_TOKENS, calibration_tokens_from_file
from scratchlm.inference.quantization.gguf_packed import load_gguf_packed
from scratchlm.inference.quantization.scheme import SCHEME_HELP, parse_scheme
from scratchlm.inference.quantization.transform import FORMAT, load_quantized, quantize_model
from scratchlm.model.loading.common import LoadedModel

QUANTIZATION_HELP = "weight quantization: none (default) | gguf (keep a .gguf file's blocks packed) | " + SCHEME_HELP


def _is_quantized_checkpoint(path: Path) -> bool:
    if path.suffix != ".pt" or not path.is_file():
        return False
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False
    return isinstance(ckpt, dict) and ckpt.get("format") == FORMAT


def load_model_quantized(path: str | Path, quantization: str | None = None, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", calibration: str | Path | None = None,
                         calibration_tokens: int = CALIBRATION_TOKENS) -> LoadedModel:
    """Load `path` (anything `scratchlm.model.load` reads, or a quantized checkpoint) and apply `quantization`.

    `calibration`: a UTF-8 text file whose first `calibration_tokens` tokens calibrate the int4
    scale search (`calibrate.py`); only meaningful with an int4 scheme that is not +rtn.
    """
    from scratchlm.model import load

    path = Path(path)
    scheme = None
    if quantization is not None and quantization != "gguf":
        scheme = parse_scheme(quantization)  # fail on a bad name before the (slow) load
    if calibration is not None:
        if scheme is None or scheme.search == "rtn":
            raise ValueError(f"calibration text {str(calibration)!r} is only used by an int4 scheme with a search "
                             f"(e.g. int4-g32-asym or int4-g128-asym+gptq), got quantization={quantization!r}")
        if not Path(calibration).is_file():
            raise FileNotFoundError(f"calibration text not found: {calibration} (expected a UTF-8 text file)")
    if _is_quantized_checkpoint(path):
        loaded = load_quantized(path, device=device, dtype=dtype)
        if quantization not in (None, loaded.model.scheme_name):
            raise ValueError(f"{path} is already quantized with {loaded.model.scheme_name!r}; "
                             f"got quantization={quantization!r} (leave it unset)")
        return loaded
    if quantization == "gguf":
        if path.suffix != ".gguf":
            raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks packed; {path} is not a .gguf file")
        return load_gguf_packed(path, device=device, dtype=dtype)
    loaded = load(path, dtype=dtype, device=device)
    if quantization is None:
        return loaded
    tokens = None
    if calibration is not None:
        if loaded.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer to read the calibration text with; pass one (--tokenizer)")
        tokens = calibration_tokens_from_file(loaded.tokenizer, calibration, calibration_tokens)
    return loaded._replace(model=quantize_model(loaded.model, quantization, calibration=tokens))
