"""Training: hand-written cross-entropy, AdamW, cosine schedule, clipping, memmap batches, atomic
checkpoints with bit-exact resume, data parallelism, and the `scratchlm train` loop.

The CS336 assignment-1 functions are re-exported here and in `scratchlm.training.functional`.
"""

from scratchlm.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from scratchlm.training.config import TrainConfig, load_run_config
from scratchlm.training.data import RandomWindowSampler, TokenFile, TokenFileError, get_batch
from scratchlm.training.loss import cross_entropy
from scratchlm.training.optim import AdamW, get_lr_cosine_schedule, gradient_clipping, weight_decay_groups

__all__ = [
    "AdamW",
    "CheckpointError",
    "RandomWindowSampler",
    "TokenFile",
    "TokenFileError",
    "TrainConfig",
    "cross_entropy",
    "get_batch",
    "get_lr_cosine_schedule",
    "gradient_clipping",
    "load_checkpoint",
    "load_run_config",
    "save_checkpoint",
    "weight_decay_groups",
]
