"""Weight-only quantization inside the engine: int8 / int4 schemes, GGUF-packed weights, fused CPU kernels.

    from scratchlm.inference.quantization import quantize_model, load_gguf_packed, load_model_quantized
    engine = LLMEngine(quantize_model(model, "int8"), tokenizer, config, EngineConfig())

See docs/quantization.md.
"""

from scratchlm.inference.quantization.gguf_packed import load_gguf_packed
from scratchlm.inference.quantization.loading import QUANTIZATION_HELP, load_model_quantized
from scratchlm.inference.quantization.modules import QuantEmbedding, QuantizedTransformerLM, QuantLinear
from scratchlm.inference.quantization.scheme import SCHEMES, LayerFormat, QuantScheme, parse_scheme
from scratchlm.inference.quantization.transform import (
    layout_for,
    load_quantized,
    quantize_model,
    quantize_state_dict,
    save_quantized,
)

__all__ = [
    "QUANTIZATION_HELP", "SCHEMES", "LayerFormat", "QuantEmbedding", "QuantLinear", "QuantScheme",
    "QuantizedTransformerLM", "layout_for", "load_gguf_packed", "load_model_quantized", "load_quantized",
    "parse_scheme", "quantize_model", "quantize_state_dict", "save_quantized",
]
