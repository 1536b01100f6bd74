"""Speculative decoding inside the engine (`EngineConfig.speculative` / `--speculative`).

Three proposers: `ngram` (prompt lookup, no extra model), `draft:PATH` (a smaller model with the same
tokenizer) and `layers:K` (self-speculation: the target's first K layers). Drafts are verified in one
target forward over k + 1 positions against the paged KV cache with the Leviathan et al. rule, so
outputs are distributed exactly as the target's (greedy: token for token). See docs/speculative.md.
"""

from scratchlm.inference.speculative.method import SpecMethod, parse_speculative
from scratchlm.inference.speculative.proposers import ModelProposer, NgramProposer, Proposal, truncate_layers
from scratchlm.inference.speculative.rejection import processed_logits, sampling_probs, verify
from scratchlm.inference.speculative.speculator import SpecStats, Speculator, expected_speedup

__all__ = [
    "ModelProposer", "NgramProposer", "Proposal", "SpecMethod", "SpecStats", "Speculator", "expected_speedup",
    "parse_speculative", "processed_logits", "sampling_probs", "truncate_layers", "verify",
]
