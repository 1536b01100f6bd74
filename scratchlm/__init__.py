"""scratchlm: a complete LLM stack written from scratch on PyTorch tensors."""

__version__ = "0.1.0"
