"""The transformer LM (`TransformerLM`, `ModelConfig`) and its checkpoint loaders (`load`, `export_hf`)."""

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading import CheckpointError, LoadedModel, export_hf, load, save_model
from scratchlm.model.transformer import TransformerBlock, TransformerLM

__all__ = ["CheckpointError", "LoadedModel", "ModelConfig", "TransformerBlock", "TransformerLM", "export_hf", "load",
           "save_model"]
