"""Draft proposers: n-gram prompt lookup, a separate draft model, the target's first K layers.

A proposer gets the running sequences that may speculate and how many tokens each may draft, and
returns the drafts (and the draft's distributions q, or None for point masses).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scratchlm.inference.block_manager import BlockManager
from scratchlm.inference.kv_cache import KVCache, kv_window
from scratchlm.inference.runner import ModelRunner, build_model_input
from scratchlm.inference.sampler import SamplingRow
from scratchlm.inference.scheduler import ScheduledSequence, SchedulerOutput
from scratchlm.inference.sequence import Sequence
from scratchlm.inference.speculative.rejection import processed_logits, sample_from, sampling_probs


@dataclass
class Proposal:
    """Drafted tokens of one sequence and the draft's distribution q: (len(tokens), V), or None (point masses)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


def model_cost(model: torch.nn.Module) -> int:
    """Weight bytes read per decoded token: the blocks plus the output head (the embedding lookup is ~free).
    Buffers count too, so packed quantized weights are measured by their real size."""
    blocks = sum(t.numel() * t.element_size() for layer in model.layers
                 for t in [*layer.parameters(), *layer.buffers()])
    try:
        head = model.output_weight
    except (AttributeError, RuntimeError):
        head = None
    return blocks + (head.numel() * head.element_size() if isinstance(head, torch.Tensor) else 0)


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n = max_n down to
    min_n) and propose the tokens that followed it. No model, so drafting costs ~nothing (cost 0)."""

    cost = 0.0

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min(min_n, max_n)

    def lookup(self, token_ids: SequenceABC[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest matching suffix n-gram."""
        length = len(token_ids)
        if k < 1 or length < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n :]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # (length - n, n): starts
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []

    def propose(self, seqs: list[Sequence], ks: list[int], rows: Any = None) -> list[Proposal]:
        return [Proposal(self.lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def release(self, seq_id: int) -> None:
        """Nothing to free: the n-gram proposer keeps no per-sequence state."""


@dataclass(eq=False)
class _DraftSeq:
    """The draft model's view of one sequence: what it has computed, in its own KV blocks."""

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_dropped_blocks: int = 0  # leading entries freed by the draft's sliding window (null block)

    def __len__(self) -> int:
        return len(self.token_ids)


def truncate_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A view of `model` that runs only its first `num_layers` blocks, then the final norm and head.
    Shares every weight (no copy): self-speculation by layer skipping."""
    n = len(model.layers)
    if not 1 <= num_layers < n:
        raise ValueError(f"layers:{num_layers}: the draft must use between 1 and {n - 1} of the target's {n} layers")
    draft = copy.copy(model)
    draft._modules = dict(model._modules)  # a new module dict: do not rebind the target's layers
    draft.layers = torch.nn.ModuleList(list(model.layers)[:num_layers])
    return draft


class ModelProposer:
    """A draft model with its own paged KV cache; drafts k tokens with k batched forwards.

    Each sequence's draft state remembers which tokens the draft has computed; before drafting, the
    state is cut back to the longest prefix that still agrees with the sequence (rejected drafts are
    dropped) and the missing tokens are fed in the first forward (a catch-up chunk).

    The cache is shaped by the draft's `kv_spec` (its layers' heads and head_dim, `KVCache.for_spec`). When every
    draft layer is windowed, the blocks before the window of the cut-back point are freed after each cut (the
    cut-back point never moves back: later cuts keep at least the tokens the draft had caught up to).
    """

    def __init__(self, model: torch.nn.Module, kv_spec: list[Any], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, cost: float, max_len: int):
        self.cache = KVCache.for_spec(kv_spec, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False, window=kv_window(kv_spec))
        self.runner = ModelRunner(model, self.cache, device)
        self.states: dict[int, _DraftSeq] = {}
        self.cost = cost
        self.max_len = max_len
        self.num_forwards = 0

    def release(self, seq_id: int) -> None:
        """Free the draft blocks of a sequence that stopped running."""
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.blocks.release(st.block_table)

    def _sync(self, seq: Sequence) -> _DraftSeq:
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = _DraftSeq()
        n = min(st.num_computed_tokens, len(seq.token_ids) - 1)
        old, new = st.token_ids, seq.token_ids
        i = 0
        while i < n and old[i] == new[i]:  # rejected drafts differ only in the last few tokens
            i += 1
        st.num_computed_tokens = i
        st.token_ids = list(new)
        st.num_prompt_tokens = seq.num_prompt_tokens
        st.num_dropped_blocks = self.blocks.drop_out_of_window(st.block_table, i, st.num_dropped_blocks)
        return st

    def propose(self, seqs: list[Sequence], ks: list[int], rows: list[SamplingRow]) -> list[Proposal]:
        """rows[i]: the sampling row of seqs[i] (params, generator, history) before any draft."""
        props = [Proposal([], None) for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        states = [self._sync(s) for s in seqs]
        ks = [min(k, self.max_len - len(s)) for s, k in zip(seqs, ks)]
        bs = self.blocks.block_size
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > step]
            plan = SchedulerOutput()
            for i in list(active):
                st = states[i]
                need = self.blocks.blocks_needed(len(st)) - len(st.block_table)
                if need > self.blocks.num_free_blocks:
                    ks[i] = step  # no room in the draft cache: stop drafting this one
                    active.remove(i)
                    continue
                if need > 0:
                    st.block_table.extend(self.blocks.allocate(need))
                plan.scheduled.append(ScheduledSequence(st, len(st) - st.num_computed_tokens))
            if not active:
                break
            inp, _ = build_model_input(plan, bs)
            logits = self.runner.execute(inp)  # (len(active), V): the last fed token of each
            self.num_forwards += 1
            hist = []
            for i in active:
                r = rows[i]
                hist.append(SamplingRow(r.params, r.generator, r.prompt_ids, [*r.output_ids, *props[i].tokens],
                                        r.banned_ids if len(r.output_ids) + step < r.params.min_tokens else ()))
            logits = processed_logits(logits, hist)
            for row, i in enumerate(active):
                st, params = states[i], rows[i].params
                st.num_computed_tokens = len(st)
                if params.greedy:
                    tok = int(logits[row].argmax())
                else:
                    q = sampling_probs(logits[row : row + 1], params)[0]
                    tok = sample_from(q, rows[i].generator)
                    qs[i].append(q)
                props[i].tokens.append(tok)
                st.token_ids.append(tok)
        for i, p in enumerate(props):
            if qs[i]:
                p.probs = torch.stack(qs[i])  # (k, V)
        return props


def build_model_proposer(engine: Any, method: Any) -> ModelProposer:
    """The draft for `layers:K` (the target's first K layers) or `draft:PATH` (loaded like the target)."""
    target = engine.runner.model
    c = engine.config
    if method.kind == "layers":
        draft = truncate_layers(target, method.layers)
        mc = engine.model_config
        max_len = mc.max_seq_len
    else:
        from scratchlm.inference.quantization import load_model_quantized

        path = Path(method.path)
        if not path.exists():
            raise ValueError(f"speculative draft model not found: {path} (expected a model path, as for the target)")
        loaded = load_model_quantized(path, None, dtype=c.torch_dtype, device=c.device)
        mc = loaded.config
        if mc.vocab_size != engine.model_config.vocab_size:
            raise ValueError(f"draft model {path} has vocab_size {mc.vocab_size}, the target "
                             f"{engine.model_config.vocab_size}: the draft must share the target's tokenizer")
        draft = loaded.model.to(device=c.device, dtype=c.torch_dtype).eval()
        max_len = mc.max_seq_len
    cost = model_cost(draft) / max(1, model_cost(target))
    spec = mc.kv_spec()[: len(draft.layers)]  # layers:K runs the target's first K layers
    return ModelProposer(draft, spec, engine.block_manager.num_blocks, engine.block_manager.block_size,
                         c.torch_dtype, torch.device(c.device), cost, max_len)
