"""The sampler: logits of the sampled positions -> next token ids (and logprobs), per-request params.

Order of the logits processors (as vLLM): repetition / frequency / presence penalties on the raw
logits, the request's ``logit_bias`` (OpenAI semantics: the bias added to the token's logit), the
min_tokens mask and a grammar's token mask (structured outputs: -inf on the tokens it disallows, only on the
rows that have one), temperature, then top-k, top-p and min-p filtering (greedy takes the argmax of the
biased, masked logits). Each stage runs only when some row of the batch uses it: a batch without a
penalty or a logit_bias does no tensor work for them. Returned logprobs are those of the raw model
logits (as vLLM's default), whatever the processors did. Each one matches
its Hugging Face counterpart on the same logits (tests/inference/test_sampler.py). Sampling uses the
exponential race (argmax p_i / E_i with E_i ~ Exp(1)) drawn from the request's own generator, so a
seeded request gives the same tokens whatever else is in the batch.

Numerics: everything runs in float32 on bounded parameters (`SamplingParams` bounds temperature,
penalties and top_k); logits are shifted by their row maximum before the temperature divides them,
so a small temperature sends the tail to -inf instead of the head to +inf, and a row whose
penalties still produced NaN or +inf is repaired (NaN -> -inf, +inf -> the float32 maximum) rather than
sampled as junk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scratchlm.inference.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_ids: Sequence[int] = ()  # tokens masked out (EOS / stop ids while below min_tokens)
    request_id: str | None = None  # whose row this is (logging, fault injection in tests)
    token_mask: torch.Tensor | None = None  # (W,) int32 bit words: the tokens a grammar allows (structured.py)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row, None when no row asked for logprobs


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: for seen tokens, logit / p if positive, logit * p if negative. seen: (S, V) bool."""
    penalty = penalty[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI semantics: logit - frequency * count - presence * (count > 0), counts of generated tokens."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[int], ids: Sequence[int], bias: Sequence[float]
                     ) -> torch.Tensor:
    """`logits` with bias[j] added at (rows[j], ids[j]) (out of place); ids outside the vocabulary raise."""
    vocab = logits.shape[-1]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"logit_bias holds token ids outside the vocabulary [0, {vocab}): {sorted(set(bad))[:5]}")
    device = logits.device
    index = (torch.as_tensor(rows, dtype=torch.long, device=device), torch.as_tensor(ids, dtype=torch.long,
                                                                                     device=device))
    return logits.index_put(index, torch.as_tensor(bias, dtype=logits.dtype, device=device), accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> torch.Tensor:
    """-inf in row ``rows[j]`` of `logits` (S, V) wherever ``masks[j]`` ((R, W) int32, bit b of word w = token
    32 w + b) disallows the token, in place; tokens past 32 W (beyond the tokenizer) are disallowed. Only the
    listed rows are touched. A mask that allows no token of the vocabulary raises a ValueError (the engine fails
    that request alone)."""
    vocab = logits.shape[-1]
    masks = masks.to(logits.device)  # the packed words travel, not the expanded (R, V) booleans
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # (R, 32 W)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    dead = (~allowed.any(dim=-1)).nonzero().flatten().tolist()
    if dead:
        raise ValueError(f"structured output: the grammar allows no token of the model's vocabulary here (rows "
                         f"{[rows[i] for i in dead]})")
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, index, sub)


def mask_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], raw: torch.Tensor) -> torch.Tensor:
    """The banned ids (min_tokens) and the grammar masks as -inf, each only when some row has one; `logits` is
    copied first when it is still `raw` (the model's logits are never written)."""
    banned = [(i, list(r.banned_ids)) for i, r in enumerate(rows) if r.banned_ids]
    masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
    if not banned and not masked:
        return logits
    if logits is raw:
        logits = logits.clone()
    for i, ids in banned:
        logits[i, ids] = float("-inf")
    if masked:
        apply_token_bitmask(logits, masked, torch.stack([rows[i].token_mask for i in masked]))
    return logits


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf and +inf -> the dtype's maximum, so softmax and argmax stay meaningful."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep tokens >= the k-th largest logit of their row (top_k (S,) long, vocab size = no filter)."""
    vocab = logits.shape[-1]
    k = top_k.clamp(1, vocab)
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # (S, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter, HF semantics: drop the least likely tokens whose cumulative mass is <= 1 - top_p
    (so the token that crosses top_p is kept, and at least one token always is)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (S, V) ascending
    remove_sorted = cum <= (1 - top_p)[:, None]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * max probability of their row."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Turns the (S, V) logits of the sampled positions into one token per row."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """logits: (S, V) float, one row per entry of `rows`."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(rows)} requests")
        logits = logits.float()
        raw = logits
        params = [r.params for r in rows]
        device = logits.device
        want_logprobs = any(p.logprobs is not None for p in params)

        if any(p.has_penalties for p in params):
            logits = _finite(self._penalize(logits, rows))
        logits = mask_logits(logits, rows, raw)

        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            temp = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
            # shift by the row max first: (l - max) / t <= 0, so a tiny t cannot overflow to +inf
            scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temp[:, None]
            scaled = _finite(scaled)
            vocab = logits.shape[-1]
            if any(p.top_k is not None for p in params):
                k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
                scaled = apply_top_k(scaled, k)
            if any(p.top_p < 1.0 for p in params):
                scaled = apply_top_p(scaled, torch.tensor([p.top_p for p in params], device=device))
            if any(p.min_p > 0.0 for p in params):
                scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=device))
            probs = scaled.softmax(dim=-1)
            greedy_ids = logits.argmax(dim=-1).tolist()
            token_ids = []
            for i, row in enumerate(rows):
                if greedy[i]:
                    token_ids.append(greedy_ids[i])
                    continue
                noise = torch.empty_like(probs[i]).exponential_(generator=row.generator)
                token_ids.append(int((probs[i] / noise).argmax()))

        logprobs = None
        if want_logprobs:
            logprobs = []
            lp = raw.log_softmax(dim=-1)
            for i, p in enumerate(params):
                entry = {token_ids[i]: float(lp[i, token_ids[i]])}
                if p.logprobs:
                    vals, idx = lp[i].topk(p.logprobs)
                    for v, t in zip(vals.tolist(), idx.tolist()):
                        entry.setdefault(t, v)
                logprobs.append(entry if p.logprobs is not None else None)
        return SampleResult(token_ids, logprobs)

    @staticmethod
    def _penalize(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The penalties, then the logit biases, each only when some row has one (`SamplingParams.has_penalties`)."""
        if any(r.params.has_repetition_penalties for r in rows):
            logits = Sampler._repetition_penalties(logits, rows)
        biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
        if biased:
            row_of = [i for i, b in biased for _ in b]
            logits = apply_logit_bias(logits, row_of, [t for _, b in biased for t in b],
                                      [v for _, b in biased for v in b.values()])
        return logits

    @staticmethod
    def _repetition_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        S, V = logits.shape
        device = logits.device
        out = torch.zeros(S, V, device=device)
        seen = torch.zeros(S, V, dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            if r.output_ids:
                ids = torch.as_tensor(list(r.output_ids), dtype=torch.long, device=device)
                out[i] = torch.bincount(ids, minlength=V)[:V].float()
            if r.params.repetition_penalty != 1.0:
                all_ids = list(r.prompt_ids) + list(r.output_ids)
                if all_ids:
                    seen[i, torch.as_tensor(all_ids, dtype=torch.long, device=device)] = True
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
        logits = apply_repetition_penalty(logits, seen, rep)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
        return apply_presence_frequency(logits, out, presence, frequency)
