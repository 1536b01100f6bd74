"""The CS336 assignment-1 training interfaces as plain functions, in one place.

    from scratchlm.training.functional import (cross_entropy, get_batch, get_lr_cosine_schedule,
                                               gradient_clipping, save_checkpoint, load_checkpoint, AdamW)
"""

from scratchlm.training.checkpoint import load_checkpoint, save_checkpoint
from scratchlm.training.data import get_batch
from scratchlm.training.loss import cross_entropy
from scratchlm.training.optim import AdamW, get_lr_cosine_schedule, gradient_clipping

__all__ = [
    "AdamW",
    "cross_entropy",
    "get_batch",
    "get_lr_cosine_schedule",
    "gradient_clipping",
    "load_checkpoint",
    "save_checkpoint",
]
