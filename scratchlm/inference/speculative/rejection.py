"""Target / draft distributions and the Leviathan et al. acceptance rule.

The target's distribution at a position is exactly what the engine's `Sampler` would sample from:
penalties and banned ids on the raw logits, then temperature, top-k, top-p and min-p (the same
functions, in the same order). A draft model's q goes through the same processing, so the rule
below leaves the output distribution equal to the target's:

- draft token x at position j is accepted with probability min(1, p_j(x) / q_j(x));
- on the first rejection the token is drawn from norm(max(0, p_j - q_j)) and drafting stops;
- when all k drafts are accepted a bonus token is drawn from p_k.

An n-gram draft is a point mass (q_j(x) = 1): acceptance is p_j(x) and the residual is p_j without x.
Greedy requests accept while the draft equals the target's argmax, then emit the argmax: the output
is the non-speculative greedy output token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scratchlm.inference.params import SamplingParams
from scratchlm.inference.sampler import Sampler, SamplingRow, apply_min_p, apply_top_k, apply_top_p, mask_logits


def processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """(S, V) raw logits -> float logits after penalties, banned ids and grammar masks (the Sampler's first stage)."""
    logits = raw = logits.float()
    if any(r.params.has_penalties for r in rows):
        logits = Sampler._penalize(logits, rows)
    return mask_logits(logits, rows, raw)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(S, V) processed logits of one request -> probabilities after temperature, top-k, top-p, min-p."""
    s, vocab = logits.shape
    device = logits.device
    scaled = logits / (params.temperature if params.temperature > 0 else 1.0)
    if params.top_k is not None:
        scaled = apply_top_k(scaled, torch.full((s,), params.top_k or vocab, device=device, dtype=torch.long))
    if params.top_p < 1.0:
        scaled = apply_top_p(scaled, torch.full((s,), params.top_p, device=device))
    if params.min_p > 0.0:
        scaled = apply_min_p(scaled, torch.full((s,), params.min_p, device=device))
    return scaled.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a (V,) distribution (need not be normalized): the exponential race, as the Sampler."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify(target: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Accept a prefix of `drafts` against the target and add one token.

    target: (k + 1, V) processed target logits (row j = the distribution of the token after j drafts);
    drafts: the k drafted tokens; draft_probs: (k, V) the draft's q (None = point masses, as n-gram drafts).
    Returns (tokens to append: the accepted drafts + one corrected or bonus token, number of accepted drafts).
    """
    k = len(drafts)
    if target.shape[0] != k + 1:
        raise ValueError(f"verify needs k + 1 = {k + 1} target rows, got {target.shape[0]}")
    if params.greedy:
        best = target.argmax(dim=-1).tolist()
        m = 0
        while m < k and drafts[m] == best[m]:
            m += 1
        return [*drafts[:m], best[m]], m
    p = sampling_probs(target, params)  # (k + 1, V)
    u = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    for j, x in enumerate(drafts):
        px = float(p[j, x])
        qx = float(draft_probs[j, x]) if draft_probs is not None else 1.0
        if u[j] * qx < px:  # u < p/q without dividing (q may underflow to 0 for a point mass check)
            continue
        if draft_probs is not None:
            residual = (p[j] - draft_probs[j]).clamp_min_(0.0)
        else:
            residual = p[j].clone()
            residual[x] = 0.0
        if float(residual.sum()) <= 0.0:  # only by rounding: p == q
            residual = p[j]
        return [*drafts[:j], sample_from(residual, generator)], j
    return [*drafts, sample_from(p[k], generator)], k
