"""Context parallelism (CP) in the engine: a sequence's KV cache sharded by token over C ranks.

`EngineConfig(context_parallel_size=C, context_parallel_threshold=N, tensor_parallel_size=T)` runs
C replicas of the T-way tensor-parallel model (world = T x C; rank = cp_rank * T + tp_rank). Rank 0
keeps the scheduler and broadcasts each step's `ModelInput`, as for TP/PP.

**Ownership rule (interleaved tokens, as vLLM's decode context parallelism).** Token p of a sequence
lives on CP rank p % C. The engine's block manager counts *logical* blocks of C x block_size tokens;
logical block b is physical block b (block_size slots) on every CP rank, and token p sits in slot
`table[p // (C bs)] * bs + (p // C) % bs` of rank p % C. So a sequence's KV takes 1/C of each rank's
pool, rank 0's block manager accounts per-rank capacity exactly (one logical block = one block on
each rank), and forks (copy-on-write), preemption and prefix caching work unchanged.

**A step.** Every rank runs the same batch except for the long prefill chunks:

- *Replicated rows* (decodes, and prefill chunks shorter than the threshold): every CP rank computes
  q/k/v for all of them (replicated GEMMs), stores the K/V of the tokens it owns, attends over its own
  KV shard (`attention_lse_sorted`: output and log-sum-exp) and the C partial results are all-gathered
  and merged by LSE in rank order (`merge_attention_states`), so every rank continues with the same
  output. For a decode that is one (o, lse) per head: the cheap path, and the one vLLM's DCP takes.
- *Sharded rows* (a prefill chunk of >= threshold tokens): each rank takes only the chunk's tokens it
  owns (p % C == rank: interleaved sharding, which is also causally balanced), so the GEMM work of the
  chunk splits 1/C per rank; their K/V go straight into the rank's cache. Attention is ring attention
  (pass-KV): the rank's whole KV shard of the sequence (cached prefix + this chunk, padded to the same
  length on every rank) travels round the CP ring with `isend`/`irecv` posted before each block is
  computed, partial results merged by LSE; per run of 256 queries, the keys they all see go through
  torch's fused CPU attention (which returns the LSE) unmasked, the diagonal band masked, the rest skipped.
- The sampled row of a sharded chunk lives on its owner: it is summed into rank 0 with an all-reduce
  of zeros elsewhere (exact), and CP rank 0's TP group computes the logits.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.runner import ModelInput
from scratchlm.model.layers import AttentionSpec
from scratchlm.parallel.comm import Comm
from scratchlm.parallel.layout import RankLayout, check_cp_features
from scratchlm.parallel.runner import ParallelRunner
from scratchlm.parallel.sequence import merge_many

_PAD_POS = float(1 << 24)  # position of padding keys in a ring block: after every query (exact in float32)
_RUN = 256  # query rows per fused attention call (keys the causal mask hides from a whole run are skipped)


# ---------------------------------------------------------------------------------------------
# Ownership arithmetic (pure: rank 0 and the tests use it too)


def local_len(total: int, cp: int, cp_rank: int) -> int:
    """How many of the positions [0, total) CP rank `cp_rank` holds (those with p % cp == cp_rank)."""
    return max(0, (total - cp_rank + cp - 1) // cp)


def split_slot(slot: int, cp: int, block_size: int) -> tuple[int, int]:
    """A logical slot (block * cp * block_size + offset) -> (owner CP rank, physical slot on the owner)."""
    block, offset = divmod(slot, cp * block_size)
    return offset % cp, block * block_size + offset // cp


@dataclass
class CPStepPlan:
    """What one CP rank computes in a step (local rows = the global rows it keeps, in order)."""

    rows: list[int]  # global rows of the step this rank runs
    write_rows: list[int]  # local rows whose K/V this rank stores ...
    write_slots: list[int]  # ... at these physical slots
    num_decode: int
    decode_tables: list[list[int]]
    decode_lens: list[int]  # keys of each decode on this rank (its share of the context)
    replicated: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # (start, len, ctx, table)
    sharded: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # (start, local len, ctx, table)
    logits_rows: list[int] = field(default_factory=list)  # local row of each sampled row (-1: on another rank)
    logits_owner: list[int] = field(default_factory=list)  # -1: replicated row; else the CP rank holding it

    @property
    def replicated_rows(self) -> list[int]:
        """Local rows whose attention is merged by the all-gather: the decodes, then replicated chunks."""
        out = list(range(self.num_decode))
        for start, n, _, _ in self.replicated:
            out.extend(range(start, start + n))
        return out


def plan_cp_step(inp: ModelInput, cp: int, cp_rank: int, block_size: int, threshold: int) -> CPStepPlan:
    """Split a step over the CP ranks: chunks of >= max(threshold, cp) tokens are sharded by token owner."""
    rows: list[int] = []
    write_rows: list[int] = []
    write_slots: list[int] = []
    local_of: dict[int, int] = {}

    def keep(g: int) -> None:
        local_of[g] = len(rows)
        rows.append(g)
        owner, phys = split_slot(inp.slot_mapping[g], cp, block_size)
        if owner == cp_rank:
            write_rows.append(local_of[g])
            write_slots.append(phys)

    nd = inp.num_decode_tokens
    for g in range(nd):
        keep(g)
    plan = CPStepPlan(rows, write_rows, write_slots, nd, [list(t) for t in inp.decode_block_tables],
                      [local_len(n, cp, cp_rank) for n in inp.decode_context_lens])
    owner_of: dict[int, int] = {}
    for qs, ql, cl, table in inp.prefills:
        start = len(rows)
        if ql >= max(threshold, cp):
            for g in range(qs, qs + ql):
                owner_of[g] = inp.positions[g] % cp
                if owner_of[g] == cp_rank:
                    keep(g)
            plan.sharded.append((start, len(rows) - start, cl, list(table)))
        else:
            for g in range(qs, qs + ql):
                keep(g)
            plan.replicated.append((start, ql, cl, list(table)))
    for g in inp.logits_indices:
        plan.logits_rows.append(local_of.get(g, -1))
        plan.logits_owner.append(owner_of.get(g, -1))
    return plan


# ---------------------------------------------------------------------------------------------
# Partial attention over position-sorted keys


def _flash_lse(qg: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """q (Hkv, G n, D) (the G query heads of each KV head stacked along the rows), k/v (Hkv, Tk, D) float32
    -> o (Hkv, G n, D), lse (Hkv, G n); `mask` (G n, Tk) additive (-inf = hidden)."""
    if qg.device.type == "cpu":  # torch's fused CPU kernel, which returns the log-sum-exp too
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg[None], k[None], v[None], 0.0, False,
                                                                             attn_mask=mask)
        return o[0], lse[0]
    s = torch.matmul(qg, k.transpose(-1, -2)).mul_(qg.shape[-1] ** -0.5)  # (Hkv, G n, Tk)
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, G n)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def attention_lse_sorted(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor,
                         run: int = _RUN) -> tuple[Tensor, Tensor]:
    """Causal attention of q (Tq, H, D) at q_pos over k/v (Tk, Hkv, D) whose positions k_pos (Tk,) ascend
    (padding keys last, at `_PAD_POS`): key j is visible to query t when k_pos[j] <= q_pos[t].

    Queries go in runs of `run` rows: the keys every query of a run sees (a prefix of k) in one unmasked
    fused call, the band where the diagonal falls in one masked call, the rest skipped. Grouped-query
    attention without repeating K/V: the G query heads of a KV head are stacked as rows of one call.
    Returns o (Tq, H, D) and lse (Tq, H) float32 (a query without a visible key: o = 0, lse = -inf, so it
    drops out of a merge)."""
    tq, h, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    g = h // hkv
    o = torch.zeros(tq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((tq, h), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or tk == 0:
        return o, lse
    kh = k.float().transpose(0, 1)  # (Hkv, Tk, D)
    vh = v.float().transpose(0, 1)  # (Hkv, Tk, D)
    for start in range(0, tq, run):
        stop = min(start + run, tq)
        n = stop - start
        qp = q_pos[start:stop]
        qg = q[start:stop].float().view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # (Hkv, G n, D)
        lo = int(torch.searchsorted(k_pos, qp.min(), right=True))  # keys [0, lo): visible to the whole run
        hi = int(torch.searchsorted(k_pos, qp.max(), right=True))  # keys [hi, Tk): hidden from the whole run
        parts = []
        if lo > 0:
            parts.append(_flash_lse(qg, kh[:, :lo], vh[:, :lo], None))
        if hi > lo:
            hidden = k_pos[lo:hi][None, :] > qp[:, None]  # (n, hi - lo)
            mask = torch.zeros(hidden.shape, dtype=torch.float32, device=q.device).masked_fill_(hidden, float("-inf"))
            po, pl = _flash_lse(qg, kh[:, lo:hi], vh[:, lo:hi], mask.repeat(g, 1))  # mask rows: (G n, hi - lo)
            none = qp < k_pos[lo]  # (n,): queries before the band's first key see none of it
            if bool(none.any()):  # the kernel's o/lse of a fully masked row are meaningless: make it drop out
                rows = none.repeat(g)  # (G n,)
                po = po.masked_fill(rows[None, :, None], 0.0)
                pl = pl.masked_fill(rows[None, :], float("-inf"))
            parts.append((po, pl))
        if parts:
            po, pl = merge_many(parts)  # (Hkv, G n, D), (Hkv, G n)
            o[start:stop] = po.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)  # (n, H, D)
            lse[start:stop] = pl.view(hkv, g, n).permute(2, 0, 1).reshape(n, h)  # (n, H)
    return o, lse


# ---------------------------------------------------------------------------------------------
# Communication


class ContextParallelComm(Comm):
    """`Comm` for a TP x PP x CP world: TP groups per (CP replica, stage), one CP group per (stage, tp rank)."""

    def __init__(self, layout: RankLayout, timeout_s: float, backend: str, device: torch.device):
        super().__init__(layout, timeout_s, backend, device)  # command/step groups and the TP groups
        timeout = timedelta(seconds=timeout_s)
        self.cp_group = None
        for stage in range(layout.pp):
            for t in range(layout.tp):
                g = dist.new_group(layout.cp_ranks(stage, t), timeout=timeout, backend=backend)
                if (stage, t) == (layout.stage, layout.tp_rank):
                    self.cp_group = g
        ring = layout.cp_ranks()
        self.cp_next = ring[(layout.cp_rank + 1) % layout.cp]
        self.cp_prev = ring[(layout.cp_rank - 1) % layout.cp]

    def cp_merge(self, o: Tensor, lse: Tensor) -> Tensor:
        """Partial attention (o (n, H, D), lse (n, H), float32) over this rank's KV shard -> attention over
        the whole context: all-gather over the CP group, merge by LSE in rank order (the same on every rank)."""
        t = time.perf_counter()
        packed = torch.cat((o.reshape(-1), lse.reshape(-1)))  # (n H D + n H,)
        parts = [torch.empty_like(packed) for _ in range(self.layout.cp)]
        dist.all_gather(parts, packed, group=self.cp_group)
        self._timed("cp_all_gather", t, packed.numel() * packed.element_size() * (self.layout.cp - 1))
        n = o.numel()
        return merge_many([(p[:n].view_as(o), p[n:].view_as(lse)) for p in parts])[0]

    def cp_all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the CP group in place."""
        t = time.perf_counter()
        dist.all_reduce(x, group=self.cp_group)
        self._timed("cp_all_reduce", t, self.ring_all_reduce_bytes(x, self.layout.cp))
        return x

    def ring_attention(self, q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor) -> Tensor:
        """Causal ring attention (pass-KV) of this rank's queries q (Tq, H, D) at positions q_pos (Tq,) over the
        K/V blocks (L, Hkv, D) at k_pos (L,) of every CP rank (the same L everywhere: pad with positions
        `_PAD_POS`). Block s+1 is in flight while block s is computed. Returns (Tq, H, D) float32."""
        cp = self.layout.cp
        n_kv = k.numel()
        block = torch.cat((k.float().reshape(-1), v.float().reshape(-1), k_pos.float()))  # (2 L Hkv D + L,)
        o = lse = None
        for step in range(cp):
            reqs, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(block)
                t = time.perf_counter()
                reqs = [dist.isend(block, self.cp_next, group=self.cp_group),
                        dist.irecv(incoming, self.cp_prev, group=self.cp_group)]
                self._timed("cp_ring", t, block.numel() * block.element_size())  # posted: isend + irecv
            kb = block[:n_kv].view_as(k)
            vb = block[n_kv:2 * n_kv].view_as(v)
            kp = block[2 * n_kv:].to(torch.long)
            part = attention_lse_sorted(q, q_pos, kb, vb, kp)  # (Tq, H, D), (Tq, H)
            o, lse = part if o is None else merge_many([(o, lse), part])
            t = time.perf_counter()
            for r in reqs:
                r.wait(timedelta(seconds=self.timeout_s)) if self.backend == "gloo" else r.wait()
            if reqs:
                self._timed("cp_ring_wait", t)
            if incoming is not None:
                block = incoming
        return o


# ---------------------------------------------------------------------------------------------
# The attention backend of one step


def paged_partial_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                         lens: Tensor) -> tuple[Tensor, Tensor]:
    """Decode queries q (B, H, D) over the first lens[b] slots of their block tables (B, nb) in this rank's
    cache (blocks, bs, Hkv, D). Returns o (B, H, D), lse (B, H) float32 (a row without keys: 0, -inf)."""
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    length = tables.shape[1] * bs
    keys = k_cache[tables].view(b, length, hkv, d).transpose(1, 2).float()  # (B, Hkv, L, D)
    values = v_cache[tables].view(b, length, hkv, d).transpose(1, 2).float()  # (B, Hkv, L, D)
    qg = q.float().view(b, hkv, h // hkv, d)  # (B, Hkv, G, D)
    s = torch.matmul(qg, keys.transpose(-1, -2)).mul_(d ** -0.5)  # (B, Hkv, G, L)
    hidden = torch.arange(length, device=q.device)[None, :] >= lens[:, None]  # (B, L)
    s.masked_fill_(hidden[:, None, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a rank without keys for this row
    e = s.sub_(m).exp_()
    denom = e.sum(dim=-1, keepdim=True)  # (B, Hkv, G, 1)
    o = torch.matmul(e, values).div_(denom.clamp_min(torch.finfo(torch.float32).tiny))  # (B, Hkv, G, D)
    lse = (m + denom.log()).view(b, h)  # (B, H)
    return o.reshape(b, h, d), lse


class ContextParallelAttention:
    """The model's `attn(layer, q, k, v)` hook for one CP step (see the module docstring)."""

    def __init__(self, cache: KVCache, plan: CPStepPlan, positions: Tensor, comm: ContextParallelComm):
        self.cache, self.plan, self.positions, self.comm = cache, plan, positions, comm
        self.cp, self.rank = comm.layout.cp, comm.layout.cp_rank
        dev = positions.device

        def lt(values: Sequence[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        self.write_rows, self.write_slots = lt(plan.write_rows), lt(plan.write_slots)
        nd = plan.num_decode
        self.decode_tables = lt(plan.decode_tables) if nd else None
        self.decode_lens = lt(plan.decode_lens) if nd else None
        self.rep_rows = lt(plan.replicated_rows)
        self.tables = [lt(t) for _, _, _, t in plan.replicated] + [lt(t) for _, _, _, t in plan.sharded]

    def _local_kv(self, k_cache: Tensor, v_cache: Tensor, table: Tensor, context_len: int,
                  pad_to: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's K/V of a sequence's first `context_len` tokens: (L, Hkv, D) x 2 and positions (L,),
        padded to `pad_to` rows (zeros at position `_PAD_POS`)."""
        bs, hkv, d = k_cache.shape[1:]
        n = local_len(context_len, self.cp, self.rank)
        nb = -(-n // bs)
        k = k_cache[table[:nb]].reshape(-1, hkv, d)[:n]  # (n, Hkv, D)
        v = v_cache[table[:nb]].reshape(-1, hkv, d)[:n]
        pos = self.rank + self.cp * torch.arange(n, device=k.device)  # (n,)
        if pad_to is not None and pad_to > n:
            k = torch.cat((k, k.new_zeros(pad_to - n, hkv, d)))
            v = torch.cat((v, v.new_zeros(pad_to - n, hkv, d)))
            pos = torch.cat((pos, torch.full((pad_to - n,), int(_PAD_POS), device=k.device)))
        return k, v, pos

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
        if spec is not None and not spec.is_plain(q.shape[-1]):
            raise NotImplementedError(f"context-parallel attention implements plain causal softmax(q.k / sqrt(D)) "
                                      f"only; this layer has {spec} (soft-cap, window or another query scale)")
        if q.shape[0] != 1:
            raise ValueError(f"context-parallel attention expects one flattened batch (B=1), got {tuple(q.shape)}")
        q, k, v = q[0], k[0], v[0]  # (N, H, D), (N, Hkv, D), (N, Hkv, D)
        plan = self.plan
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # (blocks, bs, Hkv, D)
        hkv, d = k_cache.shape[-2:]
        if plan.write_rows:  # the K/V of the tokens this rank owns
            for cache, new in ((k_cache, k), (v_cache, v)):
                mine = new.index_select(0, self.write_rows).to(cache.dtype)  # (n_written, Hkv, D)
                cache.view(-1, hkv, d).index_copy_(0, self.write_slots, mine)
        out = torch.empty_like(q)
        parts_o, parts_lse = [], []
        nd = plan.num_decode
        if nd:
            o, lse = paged_partial_decode(q[:nd], k_cache, v_cache, self.decode_tables, self.decode_lens)
            parts_o.append(o)
            parts_lse.append(lse)
        for i, (start, n, ctx, _) in enumerate(plan.replicated):
            ks, vs, kpos = self._local_kv(k_cache, v_cache, self.tables[i], ctx)
            o, lse = attention_lse_sorted(q[start:start + n], self.positions[start:start + n], ks, vs, kpos)
            parts_o.append(o)
            parts_lse.append(lse)
        if parts_o:
            merged = self.comm.cp_merge(torch.cat(parts_o), torch.cat(parts_lse))  # (n_rep, H, D)
            out.index_copy_(0, self.rep_rows, merged.to(q.dtype))
        for j, (start, n, ctx, _) in enumerate(plan.sharded):
            table = self.tables[len(plan.replicated) + j]
            ks, vs, kpos = self._local_kv(k_cache, v_cache, table, ctx, pad_to=local_len(ctx, self.cp, 0))
            o = self.comm.ring_attention(q[start:start + n], self.positions[start:start + n], ks, vs, kpos)
            out[start:start + n] = o.to(q.dtype)
        return out.unsqueeze(0)  # (1, N, H, D)


# ---------------------------------------------------------------------------------------------
# The runner


def _proc_status_kib(*names: str) -> dict[str, int]:
    """{name: KiB} from /proc/self/status (empty where unavailable)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in names:
                out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


class ContextParallelRunner(ParallelRunner):
    """One rank's runner in a TP x CP world; on rank 0 `execute(ModelInput)` -> logits (see module docstring).

    The KV pool of every rank has the engine's `num_blocks` blocks of `block_size` tokens (the engine's block
    manager counts logical blocks of C x block_size tokens, one physical block per rank)."""

    def __init__(self, model, comm: ContextParallelComm, block_size: int, dtype: torch.dtype, device: torch.device,
                 threshold: int, procs: Sequence = ()):
        super().__init__(model, comm, block_size, dtype, device, 1, procs)
        if self.layout.pp != 1:
            raise ValueError(f"context parallelism runs with pipeline_parallel_size=1, got {self.layout.pp}")
        check_cp_features(model.config)  # at start-up, not at the first forward
        self.threshold = threshold
        self.step_cpu_s = 0.0  # this thread's CPU time in steps (the work itself; waiting on peers is not counted)

    def _command_handlers(self) -> dict:
        return {**super()._command_handlers(), "stats": self._gather_stats}

    def rank_stats(self, reset_peak: bool = False) -> list[dict]:
        """Rank 0: every rank's memory and KV figures, by rank: max RSS, VmRSS / VmHWM (KiB, Linux), KV pool
        bytes, KV slots written in layer 0, steps and their thread CPU seconds, communication seconds/calls/bytes.
        `reset_peak`: afterwards reset each rank's VmHWM to its current RSS (/proc/self/clear_refs), to measure
        the peak of what follows."""
        return self._guard(lambda: (self.comm.broadcast_command(("stats", reset_peak)),
                                    self._gather_stats(reset_peak))[1])

    def _gather_stats(self, reset_peak: bool = False) -> list[dict]:
        lay = self.layout
        k0 = self.cache.k[0]  # (blocks, bs, Hkv, D)
        mine = {
            "rank": lay.rank, "cp_rank": lay.cp_rank, "tp_rank": lay.tp_rank,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **_proc_status_kib("VmRSS", "VmHWM"),
            "kv_pool_bytes": 2 * self.cache.k.numel() * self.cache.k.element_size(),
            "kv_slots_written": int((k0.abs().sum(dim=(-1, -2)) != 0).sum()),
            "kv_bytes_per_slot": 2 * self.cache.k[:, 0, 0].numel() * self.cache.k.element_size(),
            "steps": self.steps, "step_cpu_s": self.step_cpu_s,
            "comm": {k: (self.comm.seconds[k], self.comm.calls[k]) for k in self.comm.seconds},
            "comm_bytes": dict(self.comm.bytes),
        }
        out: list = [None] * lay.world_size
        dist.all_gather_object(out, mine, group=self.comm.cmd_group)
        if reset_peak:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        return out

    def _step(self, inp: ModelInput) -> Tensor | None:
        t = time.thread_time()
        try:
            return self._cp_step(inp)
        finally:
            self.step_cpu_s += time.thread_time() - t

    @torch.inference_mode()
    def _cp_step(self, inp: ModelInput) -> Tensor | None:
        self.steps += 1
        self.cache.copy_blocks(inp.block_copies)
        lay, model = self.layout, self.model
        vocab, d = model.config.vocab_size, model.config.d_model
        if not inp.token_ids:
            return torch.empty(0, 0, device=self.device)
        plan = plan_cp_step(inp, lay.cp, lay.cp_rank, self.block_size, self.threshold)
        tokens = self._tensor([inp.token_ids[g] for g in plan.rows])  # (N_local,)
        positions = self._tensor([inp.positions[g] for g in plan.rows])  # (N_local,)
        attn = ContextParallelAttention(self.cache, plan, positions, self.comm)
        x = model.embed_tokens(tokens[None, :], positions)  # (1, N_local, d)
        x = model.forward_layers(x, positions, attn)[0]  # (N_local, d)
        if not inp.logits_indices:
            return torch.empty(0, vocab, dtype=self.dtype, device=self.device) if lay.rank == 0 else None
        sharded = [i for i, o in enumerate(plan.logits_owner) if o >= 0]
        gathered = None
        if sharded:  # the last row of a sharded chunk lives on its owner: sum with zeros from the others (exact)
            gathered = torch.zeros(len(sharded), d, dtype=x.dtype, device=self.device)  # (n_sharded, d)
            for j, i in enumerate(sharded):
                if plan.logits_owner[i] == lay.cp_rank:
                    gathered[j] = x[plan.logits_rows[i]]
            self.comm.cp_all_reduce(gathered)
        if lay.cp_rank != 0:
            return None
        rows = x.index_select(0, self._tensor([max(r, 0) for r in plan.logits_rows]))  # (n_logits, d)
        if gathered is not None:
            rows[self._tensor(sharded)] = gathered
        logits = model.logits(rows)  # (n_logits, vocab): all-gathered over CP rank 0's TP group
        return logits if lay.rank == 0 else None
