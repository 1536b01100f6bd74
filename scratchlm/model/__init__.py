"""The transformer LM (`TransformerLM`, `ModelConfig`) and its checkpoint loaders (`load`, `export_hf`)."""

from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerBlock, TransformerLM

__all__ = ["ModelConfig", "TransformerBlock", "TransformerLM"]
