"""The AlphaFold3-style case study: a Pairformer trunk, chunking, Dynamic Axial Parallelism, a diffusion head.

See docs/hybrid_parallelism.md. `pairformer` holds the single-rank model (checked against Boltz-2),
`dap` the row-sharded trunk over torch.distributed, `diffusion_head` the sampler run data-parallel
over the same ranks, and `memory` the activation accounting the benchmark and the planner share.
"""

from scratchlm.fold.pairformer import (
    Pairformer,
    PairformerBlock,
    PairformerConfig,
    chunk_size_for_budget,
    load_boltz_checkpoint,
    load_boltz_state_dict,
)

__all__ = ["Pairformer", "PairformerBlock", "PairformerConfig", "chunk_size_for_budget", "load_boltz_checkpoint",
           "load_boltz_state_dict"]
