"""The speculative engine step: propose, verify in one target forward, roll back, adapt k.

`LLMEngine.step()` hands over to `Speculator.step()` when `EngineConfig.speculative` is set:

1. `scheduler.schedule()` as usual (decodes, prefill chunks, preemption).
2. Every decode of a sequence that may speculate gets k draft tokens (k adapts per sequence, and is
   capped by the step's leftover token budget, free KV blocks, max_tokens and max_model_len). The
   drafts are appended to the sequence's token ids and its entry grows from 1 to k + 1 tokens, whose
   logits are all returned (`ScheduledSequence.num_logits`). Sequences with k = 0 decode as usual.
3. One target forward over the whole batch (the verify chunks are prefill-like chunks with a cached prefix).
4. Verification (rejection sampling, see rejection.py) before `commit`: the sequence keeps the accepted
   drafts, `num_computed_tokens` advances only over them, so only full blocks of accepted tokens are
   hashed into the prefix cache, and the blocks allocated beyond the new length are freed at once.
5. The accepted tokens + the corrected/bonus token are appended one by one with the engine's stop checks;
   everything else (prefills, k = 0 decodes, n > 1 forks) goes through the engine's own postprocess.

Structured outputs: a constrained sequence drafts like any other; its grammar masks for the k + 1 verified
positions (the state after each draft prefix, from llguidance's draft fill, while the forward runs) mask the target
logits, so a draft the grammar disallows has probability 0 and is rejected, and the corrected/bonus token is drawn
from the masked target: the output follows the grammar with the target's distribution. The grammar matcher
consumes only the tokens appended (the engine's stop check), so nothing is rolled back.

Adaptive k: each sequence keeps a decayed estimate of its per-token acceptance rate alpha and drafts the k in
[0, k_max] that maximizes the expected tokens per step over the step's cost,
(1 - alpha^(k+1)) / (1 - alpha) / (1 + k c + [k > 0] (v0 + v k)), where c is the draft's cost per token relative
to the target (0 for n-grams) and v0 + v k the target's extra cost of verifying k drafts in its forward (on this
CPU a (k + 1)-row GEMM costs far more than the 1-row GEMV of a decode: v0 ~ 0.3, v ~ 0.08 measured, see
docs/speculative.md). When k = 0 wins it stops drafting and probes with k = 1 after `probe_every` steps, then
after twice as many while probes keep failing (up to 16x); a draft that could not pay even at alpha = 0.95
never probes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from scratchlm.inference.runner import build_model_input
from scratchlm.inference.sampler import SamplingRow
from scratchlm.inference.scheduler import ScheduledSequence
from scratchlm.inference.sequence import Sequence, SequenceStatus
from scratchlm.inference.speculative.method import SpecMethod, parse_speculative
from scratchlm.inference.speculative.proposers import NgramProposer, Proposal, build_model_proposer
from scratchlm.inference.speculative.rejection import processed_logits, verify

log = logging.getLogger(__name__)


def expected_speedup(alpha: float, k: float, cost: float, verify_fixed: float = 0.0, verify_per_token: float = 0.0
                     ) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(k cost + 1)): tokens per step over the step's cost (Leviathan et al.);
    with verify_fixed / verify_per_token the target's forward costs 1 + v0 + v k instead of 1 when k > 0."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    verify = verify_fixed + verify_per_token * k if k > 0 else 0.0
    return tokens / (k * cost + 1.0 + verify)


@dataclass
class SpecStats:
    """Counters over the engine's life: verify = one sequence verified k >= 1 drafts in a step."""

    steps: int = 0  # engine steps that ran a target forward
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by verifies (accepted + corrected/bonus)
    rejected: int = 0  # verifies that rejected a draft (the others accepted all k)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability (the formula's alpha), estimated as accepted / (accepted + rejections):
        the maximum-likelihood estimate when each draft is accepted independently with probability alpha."""
        n = self.accepted + self.rejected
        return self.accepted / n if n else 0.0


@dataclass
class _Adaptive:
    accepted: float = 1.5  # prior: alpha ~ 0.6
    rejected: float = 1.0
    idle: int = 0
    probe_every: int = 0  # 0 = the speculator's base interval; doubles after each failed probe

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class _Pending:
    entry: ScheduledSequence
    base_len: int
    proposal: Proposal
    row: SamplingRow
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    raw: torch.Tensor | None = None  # (k + 1, V) raw target logits, kept only for logprobs


class Speculator:
    """Owns the proposer and the per-sequence adaptive state; `step()` replaces the engine's step."""

    def __init__(self, engine: Any, method: SpecMethod | str, k_max: int | None = None, verify_fixed: float = 0.3,
                 verify_per_token: float = 0.08, adaptive: bool = True, probe_every: int = 16, decay: float = 0.9):
        self.engine = engine
        self.method = parse_speculative(method) if isinstance(method, str) else method
        if k_max is None:
            k_max = 8 if self.method.kind == "ngram" else 4  # n-gram drafts are free: longer ones pay off
        if k_max < 1:
            raise ValueError(f"num_speculative_tokens={k_max} must be >= 1")
        self.k_max = k_max
        self.verify_fixed = verify_fixed
        self.verify_per_token = verify_per_token
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.decay = decay
        if self.method.kind == "ngram":
            self.proposer: Any = NgramProposer(self.method.ngram_max, min(2, self.method.ngram_max))
        else:
            self.proposer = build_model_proposer(engine, self.method)
        self.stats = SpecStats()
        self._adapt: dict[int, _Adaptive] = {}
        # The best this draft could do with a near-perfect acceptance rate: if even that loses, never probe.
        c, v0, v = self.proposer.cost, verify_fixed, verify_per_token
        self.ceiling = max(expected_speedup(0.95, k, c, v0, v) for k in range(1, self.k_max + 1))
        log.info("speculative decoding: %s, k_max %d, draft cost %.3f of the target", self.method, k_max,
                 self.proposer.cost)

    # --- k per sequence ------------------------------------------------------------------------
    def choose_k(self, seq_id: int) -> int:
        """The k that maximizes the expected speed-up for this sequence's acceptance estimate (0 = don't draft)."""
        if not self.adaptive:
            return self.k_max
        st = self._adapt.setdefault(seq_id, _Adaptive())
        c, v0, v = self.proposer.cost, self.verify_fixed, self.verify_per_token
        best = max(range(self.k_max + 1), key=lambda k: expected_speedup(st.alpha, k, c, v0, v))
        if best == 0 and self.ceiling <= 1.0:
            return 0  # a draft this expensive cannot pay for itself (e.g. layers:K with K close to n_layers)
        if best == 0:
            st.idle += 1
            if st.idle >= (st.probe_every or self.probe_every):
                st.idle = 0
                # back off exponentially while probes keep failing (a model draft's probe also pays a catch-up)
                st.probe_every = min(2 * (st.probe_every or self.probe_every), 16 * self.probe_every)
                return 1
        else:
            st.probe_every = 0
        return best

    def _observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        st = self._adapt.setdefault(seq_id, _Adaptive())
        st.accepted = st.accepted * self.decay + accepted
        st.rejected = st.rejected * self.decay + (1 if accepted < drafted else 0)

    # --- the step ------------------------------------------------------------------------------
    def _eligible(self, entry: ScheduledSequence) -> bool:
        seq = entry.seq
        if entry.num_new_tokens != 1 or not entry.samples or seq.num_computed_tokens < seq.num_prompt_tokens:
            return False
        req = self.engine.requests.get(seq.request_id)
        return req is not None and (req.params.n == 1 or req.forked)

    def _release_stopped(self) -> None:
        running = {s.seq_id for s in self.engine.scheduler.running}
        for seq_id in [i for i in self._adapt if i not in running]:
            del self._adapt[seq_id]
        states = getattr(self.proposer, "states", None)
        if states:
            for seq_id in [i for i in states if i not in running]:
                self.proposer.release(seq_id)

    def _draft(self, plan: Any) -> list[_Pending]:
        eng = self.engine
        bm = eng.block_manager
        budget = eng.scheduler.max_num_batched_tokens - plan.num_tokens
        cands: list[tuple[ScheduledSequence, int]] = []
        for entry in plan.scheduled:
            if budget <= 0:
                break
            if not self._eligible(entry):
                continue
            seq = entry.seq
            p = seq.params
            room = eng.max_model_len - len(seq) - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - len(seq.output_ids) - 1)
            k = min(self.choose_k(seq.seq_id), room, budget)
            if k > 0:
                cands.append((entry, k))
                budget -= k
        if not cands:
            return []
        seqs = [e.seq for e, _ in cands]
        rows = [eng._sampling_row(s) for s in seqs]
        props = self.proposer.propose(seqs, [k for _, k in cands], rows)
        pending = []
        for (entry, _), prop, row in zip(cands, props, rows):
            seq = entry.seq
            k = len(prop.tokens)
            need = bm.blocks_needed(seq.num_computed_tokens + 1 + k) - len(seq.block_table)
            if need > bm.num_free_blocks:
                k = max(0, bm.num_free_blocks * bm.block_size + len(seq.block_table) * bm.block_size
                        - seq.num_computed_tokens - 1)
                k = min(k, len(prop.tokens))
                prop = Proposal(prop.tokens[:k], prop.probs[:k] if prop.probs is not None else None)
                need = bm.blocks_needed(seq.num_computed_tokens + 1 + k) - len(seq.block_table)
            if k == 0:
                continue
            if need > 0:
                seq.block_table.extend(bm.allocate(need))
            base_len = len(seq.token_ids)
            seq.token_ids.extend(prop.tokens)
            entry.num_new_tokens = 1 + k
            entry.num_logits = 1 + k
            pending.append(_Pending(entry, base_len, prop, row))
        return pending

    def _verify(self, plan: Any, pend: list[_Pending], logits: torch.Tensor, rows: list[int]) -> None:
        """Accept drafts for every pending entry; set what commit() must see (accepted tokens only)."""
        index = {id(e.seq): r for e, r in zip(plan.scheduled, rows)}
        hist: list[SamplingRow] = []
        spans = []
        for pd in pend:
            r, k = pd.row, len(pd.proposal.tokens)
            masks = self.engine._masks.get(pd.entry.seq.seq_id)  # a grammar's mask at each of the k + 1 positions
            for j in range(k + 1):
                out = [*r.output_ids, *pd.proposal.tokens[:j]]
                banned = r.banned_ids if len(out) < r.params.min_tokens else ()
                hist.append(SamplingRow(r.params, r.generator, r.prompt_ids, out, banned,
                                        token_mask=None if masks is None else masks[j]))
            spans.append((index[id(pd.entry.seq)], k + 1))
        sel = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(logits.device)
        target = processed_logits(logits.index_select(0, sel), hist)  # (sum(k + 1), V)
        pos = 0
        for pd in pend:
            k = len(pd.proposal.tokens)
            pd.tokens, pd.accepted = verify(target[pos : pos + k + 1], pd.proposal.tokens, pd.row.params,
                                            pd.row.generator, pd.proposal.probs)
            if pd.row.params.logprobs is not None:
                start = index[id(pd.entry.seq)]
                pd.raw = logits[start : start + k + 1]
            pos += k + 1
            seq = pd.entry.seq
            del seq.token_ids[pd.base_len + pd.accepted :]  # keep accepted drafts: commit hashes full blocks of them
            pd.entry.num_new_tokens = 1 + pd.accepted

    def step(self) -> list[Any]:
        """One engine step with speculation; returns the request outputs like `LLMEngine.step()`."""
        eng = self.engine
        plan = eng.scheduler.schedule()
        self._release_stopped()
        pend = self._draft(plan) if not plan.is_empty else []
        if plan.is_empty and not plan.block_copies:
            return eng._postprocess(plan, None)
        inp, rows = build_model_input(plan, eng.block_manager.block_size)
        fill = eng._start_masks(plan, {pd.entry.seq.seq_id: pd.proposal.tokens for pd in pend})
        try:
            logits = eng.runner.execute(inp)
        finally:
            eng._wait_masks(fill)
        self.stats.steps += 1
        if pend:
            self._verify(plan, pend, logits, rows)
        eng.scheduler.commit(plan)
        progressed = {}
        for pd in pend:
            rows[plan.scheduled.index(pd.entry)] = -1  # the engine's postprocess skips it
            req = eng.requests[pd.entry.seq.request_id]
            try:
                self._append(pd)
            except Exception as e:  # detokenizing / stop-checking this request failed: it alone fails
                eng._fail_request(req, e)
            progressed[req.request_id] = req
        outputs = eng._postprocess(plan, (logits, rows))
        seen = {o.request_id for o in outputs}
        for rid, req in progressed.items():
            if rid in seen:
                continue
            outputs.append(eng._request_output(req))
            if req.finished:
                eng.requests.pop(rid, None)
        self._release_stopped()  # finished this step: free their draft KV now
        return outputs

    def _append(self, pd: _Pending) -> Any:
        eng = self.engine
        seq: Sequence = pd.entry.seq
        req = eng.requests[seq.request_id]
        del seq.token_ids[pd.base_len :]
        k = len(pd.proposal.tokens)
        lp = self._logprobs(pd) if seq.logprobs is not None and pd.raw is not None else None
        for j, tok in enumerate(pd.tokens):
            seq.append_token(tok)
            if lp is not None:
                seq.logprobs.append(lp[j])
            eng._generation_tokens_total += 1
            eng._check_stop(seq)
            if seq.is_finished:
                break
        if seq.status is SequenceStatus.RUNNING:
            bm = eng.block_manager
            keep = bm.blocks_needed(seq.num_computed_tokens)
            if len(seq.block_table) > keep:  # roll back: free the blocks that held only rejected drafts
                bm.release(seq.block_table[keep:])
                del seq.block_table[keep:]
        st = self.stats
        st.verifies += 1
        st.drafted += k
        st.accepted += pd.accepted
        st.emitted += len(pd.tokens)
        st.rejected += int(pd.accepted < k)
        self._observe(seq.seq_id, k, pd.accepted)
        return req

    def _logprobs(self, pd: _Pending) -> list[dict[int, float]]:
        """Raw log-softmax of the target at each emitted position (as the Sampler reports them)."""
        lp = pd.raw.float().log_softmax(dim=-1)
        n = pd.row.params.logprobs
        out = []
        for j, tok in enumerate(pd.tokens):
            entry = {tok: float(lp[j, tok])}
            if n:
                vals, idx = lp[j].topk(n)
                for v, t in zip(vals.tolist(), idx.tolist()):
                    entry.setdefault(t, v)
            out.append(entry)
        return out
