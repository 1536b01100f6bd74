"""Sequence (context) parallelism for one long prompt: ring attention, Ulysses, and split-KV decode.

The shared primitive is `merge_attention_states`: attention over keys split into shards, each shard
giving an output `o` and the log-sum-exp `lse` of its scores, merges exactly into attention over all
keys. On top of it:

- **Ring attention (pass-KV).** Every rank keeps its queries; the K/V blocks travel round a ring of
  P ranks (`isend`/`irecv` of the next block posted before the current block is computed, so the
  transfer overlaps the compute). Sharding is zig-zag: the prompt is cut into 2P chunks and rank i
  holds chunks i and 2P-1-i, so every rank does the same causal work. Sub-blocks that the causal mask
  hides entirely are skipped.
- **Ulysses.** An all-to-all turns sequence-sharded q/k/v into head-sharded q/k/v over the whole
  sequence, ordinary causal attention runs on H/P heads, and an all-to-all turns the output back.
  The K/V heads are split too, so P must divide the number of KV heads.
- **Decode from the sharded KV cache.** After a ring prefill the cache stays sharded by sequence;
  every rank computes the new token (replicated), attends to its own shard, and the partial results
  are merged by LSE after an all-gather (as vLLM's decode context parallelism). New tokens' K/V go
  round-robin to the ranks. After Ulysses the cache is sharded by head; each rank attends with its
  heads and the outputs are all-gathered.

`ContextParallelLM` drives a `TransformerLM` through its attention hook; `spawn_gloo` starts P local
gloo ranks (used by the tests and the benchmark).
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from scratchlm.model.layers import AttentionSpec, causal_attention
from scratchlm.parallel.layout import check_cp_features

Backend = Literal["ring", "ulysses"]


# ---------------------------------------------------------------------------------------------
# The primitive: partial attention with its log-sum-exp, and the merge.



def require_plain(spec: AttentionSpec | None, q: Tensor) -> None:
    """Sequence parallelism implements plain causal softmax(q.k / sqrt(D)); a layer with another spec is an error."""
    if spec is not None and not spec.is_plain(q.shape[-1]):
        raise NotImplementedError(f"ring / Ulysses attention implements plain causal attention only; this layer has "
                                  f"{spec} (soft-cap, window or another query scale)")

def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor | None = None,
                       k_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention of q over k/v, with the log-sum-exp of the scaled scores.

    q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D), H a multiple of Hkv (grouped-query attention).
    With positions q_pos (Tq,) and k_pos (Tk,), key j is hidden from query t when k_pos[j] > q_pos[t]
    (causal); without them every key is visible. Computed in float32.
    Returns o (B, Tq, H, D) float32 and lse (B, Tq, H) float32; a row with no visible key gets o = 0,
    lse = -inf (so it drops out of any merge).
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"attention_with_lse: {h} query heads is not a multiple of {hkv} kv heads")
    g = h // hkv
    qg = q.float().reshape(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, Tq, D)
    kg = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hkv, 1, Tk, D)
    vg = v.float().permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hkv, 1, Tk, D)
    s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(1.0 / math.sqrt(d))  # (B, Hkv, G, Tq, Tk)
    if q_pos is not None and k_pos is not None:
        hidden = k_pos.view(1, tk) > q_pos.view(tq, 1)  # (Tq, Tk)
        if bool(hidden.any()):
            s.masked_fill_(hidden, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G, Tq, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully hidden rows: avoid inf - inf
    e = s.sub_(m).exp_()
    l = e.sum(dim=-1, keepdim=True)  # (B, Hkv, G, Tq, 1)
    o = torch.matmul(e, vg).div_(l.clamp_min(torch.finfo(torch.float32).tiny))  # (B, Hkv, G, Tq, D)
    lse = (m + l.log()).squeeze(-1)  # (B, Hkv, G, Tq)
    o = o.permute(0, 3, 1, 2, 4).reshape(b, tq, h, d)  # (B, Tq, H, D)
    lse = lse.permute(0, 3, 1, 2).reshape(b, tq, h)  # (B, Tq, H)
    return o, lse


def merge_attention_states(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets into attention over their union.

    o1, o2: (..., D); lse1, lse2: (...) the log-sum-exp of each part's scores. Returns (o, lse) with
    lse = log(exp(lse1) + exp(lse2)) and o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2. A part whose lse
    is -inf (no visible key) contributes nothing; if both are -inf the result is o = 0, lse = -inf.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(
            f"merge_attention_states: expected o (..., D) and lse (...) of matching shapes, got "
            f"o1 {tuple(o1.shape)}, lse1 {tuple(lse1.shape)}, o2 {tuple(o2.shape)}, lse2 {tuple(lse2.shape)}"
        )
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both -inf: weights become 0, not nan
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)  # (..., 1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def merge_many(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Fold `merge_attention_states` over a list of (o, lse) parts (in order, so every rank agrees)."""
    if not parts:
        raise ValueError("merge_many: no attention parts to merge")
    o, lse = parts[0]
    for o2, lse2 in parts[1:]:
        o, lse = merge_attention_states(o, lse, o2, lse2)
    return o, lse


def split_kv_attention(q: Tensor, k: Tensor, v: Tensor, num_splits: int) -> Tensor:
    """Decode-style attention of q over all of k/v computed in `num_splits` key shards merged by LSE
    (flash-decoding's split-KV). q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D). Returns (B, Tq, H, D) float32."""
    if num_splits < 1:
        raise ValueError(f"split_kv_attention: num_splits={num_splits} must be >= 1")
    parts = [attention_with_lse(q, ks, vs) for ks, vs in zip(k.tensor_split(num_splits, dim=1),
                                                           v.tensor_split(num_splits, dim=1)) if ks.shape[1]]
    return merge_many(parts)[0]


# ---------------------------------------------------------------------------------------------
# Sharding


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2*world) that `rank` holds under zig-zag sharding: rank and 2*world-1-rank."""
    return rank, 2 * world - 1 - rank


def shard_positions(seq_len: int, world: int, rank: int, scheme: Literal["zigzag", "contiguous"]) -> Tensor:
    """Absolute positions (LongTensor) of the tokens `rank` holds; seq_len must divide evenly."""
    parts = 2 * world if scheme == "zigzag" else world
    if scheme not in ("zigzag", "contiguous"):
        raise ValueError(f"shard_positions: scheme={scheme!r}, expected 'zigzag' or 'contiguous'")
    if seq_len % parts:
        raise ValueError(f"shard_positions: seq_len={seq_len} is not a multiple of {parts} chunks "
                         f"({scheme} sharding over {world} ranks); pad the prompt")
    c = seq_len // parts
    if scheme == "contiguous":
        return torch.arange(rank * c, (rank + 1) * c)
    a, b = zigzag_chunks(rank, world)
    return torch.cat((torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)))


def check_ulysses(n_heads: int, n_kv_heads: int, world: int) -> None:
    """Ulysses splits heads over ranks: raise ValueError unless `world` divides both head counts."""
    if n_kv_heads % world or n_heads % world:
        raise ValueError(
            f"Ulysses sequence parallelism shards attention heads over ranks, so the number of ranks ({world}) must "
            f"divide the number of KV heads ({n_kv_heads}) and of query heads ({n_heads}); it is limited to at most "
            f"{n_kv_heads} ranks here. Use ring attention (backend='ring') for this model or a smaller size"
        )


# ---------------------------------------------------------------------------------------------
# Communication counters (the benchmark compares them with the formula in docs/sequence_parallel.md)


@dataclass
class CommStats:
    """Bytes this rank sent, per kind of collective."""

    p2p_bytes: int = 0
    all_to_all_bytes: int = 0
    all_gather_bytes: int = 0

    @property
    def total(self) -> int:
        return self.p2p_bytes + self.all_to_all_bytes + self.all_gather_bytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Ring attention


def block_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor,
                     q_chunks: int, k_chunks: int) -> tuple[Tensor, Tensor]:
    """Causal attention of q over one K/V block, chunk by chunk, skipping chunk pairs the mask hides.

    q (B, Tq, H, D) holds `q_chunks` contiguous position runs, k/v (B, Tk, Hkv, D) `k_chunks`. Only the
    pairs with some visible key are computed; the mask is applied only where a pair straddles the
    diagonal. Returns (o, lse) for all of q (rows with no visible key: o = 0, lse = -inf).
    """
    b, tq, h, d = q.shape
    o = torch.zeros(b, tq, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, tq, h), float("-inf"), dtype=torch.float32, device=q.device)
    qs = [(c.start, c.stop) for c in _runs(tq, q_chunks)]
    ks = [(c.start, c.stop) for c in _runs(k.shape[1], k_chunks)]
    for qa, qb in qs:
        qp = q_pos[qa:qb]
        parts = []
        for ka, kb in ks:
            kp = k_pos[ka:kb]
            if int(kp.min()) > int(qp.max()):
                continue  # every key is after every query: hidden
            full = int(kp.max()) <= int(qp.min())  # every key visible: no mask
            parts.append(attention_with_lse(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb],
                                            None if full else qp, None if full else kp))
        if parts:
            o[:, qa:qb], lse[:, qa:qb] = merge_many(parts)
    return o, lse


def _runs(n: int, parts: int) -> list[slice]:
    step = n // parts
    return [slice(i * step, (i + 1) * step if i < parts - 1 else n) for i in range(parts)]


def ring_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: Any = None,
                   stats: CommStats | None = None, chunks: int = 2) -> Tensor:
    """Causal ring attention (pass-KV) over the ranks of `group`.

    q (B, Tl, H, D), k/v (B, Tl, Hkv, D) and positions (Tl,) are this rank's tokens (any sharding;
    zig-zag gives every rank the same work; `chunks` = number of contiguous position runs per rank,
    2 for zig-zag, used to skip hidden sub-blocks). Every rank must hold the same number of tokens.
    The K/V block of rank r-s arrives at step s while the block for step s+1 is already in flight.
    Returns (B, Tl, H, D) in q's dtype.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        o, _ = block_attention(q, positions, k, v, positions, chunks, chunks)
        return o.to(q.dtype)
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    # One message per step: k, v and the positions packed into a single float32 buffer.
    b, tl, hkv, d = k.shape
    kv_numel = b * tl * hkv * d
    pos_f = positions.to(torch.float32)  # exact for positions < 2**24
    block = torch.cat((k.float().reshape(-1), v.float().reshape(-1), pos_f))  # (2*B*Tl*Hkv*D + Tl,)
    o = lse = None
    for step in range(world):
        reqs, incoming = [], None
        if step < world - 1:
            incoming = torch.empty_like(block)
            reqs = [dist.isend(block, nxt, group=group), dist.irecv(incoming, prv, group=group)]
            if stats is not None:
                stats.p2p_bytes += _nbytes(block)
        kb = block[:kv_numel].view(b, tl, hkv, d)
        vb = block[kv_numel:2 * kv_numel].view(b, tl, hkv, d)
        kpos = block[2 * kv_numel:].to(torch.long)
        part = block_attention(q, positions, kb, vb, kpos, chunks, chunks)
        o, lse = part if o is None else merge_attention_states(o, lse, *part)
        for r in reqs:
            r.wait()
        if incoming is not None:
            block = incoming
    return o.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Ulysses


def _all_to_all(x: Tensor, group: Any, stats: CommStats | None) -> Tensor:
    """all_to_all_single on dim 0 of x (P, ...): out[i] = the x[rank] of rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.all_to_all_bytes += _nbytes(x) * (x.shape[0] - 1) // x.shape[0]
    return out


def seq_to_head(x: Tensor, group: Any = None, stats: CommStats | None = None) -> Tensor:
    """(B, Tl, Hx, D) sequence-sharded -> (B, P*Tl, Hx/P, D) head-sharded (contiguous sharding)."""
    world = dist.get_world_size(group)
    b, tl, hx, d = x.shape
    xs = x.reshape(b, tl, world, hx // world, d).permute(2, 0, 1, 3, 4)  # (P, B, Tl, Hx/P, D)
    out = _all_to_all(xs, group, stats)  # (P, B, Tl, Hx/P, D): out[i] = rank i's tokens, my heads
    return out.permute(1, 0, 2, 3, 4).reshape(b, world * tl, hx // world, d)  # (B, T, Hx/P, D)


def head_to_seq(x: Tensor, group: Any = None, stats: CommStats | None = None) -> Tensor:
    """(B, P*Tl, Hx/P, D) head-sharded -> (B, Tl, Hx, D) sequence-sharded: the inverse of `seq_to_head`."""
    world = dist.get_world_size(group)
    b, t, hp, d = x.shape
    tl = t // world
    xs = x.reshape(b, world, tl, hp, d).permute(1, 0, 2, 3, 4)  # (P, B, Tl, Hx/P, D)
    out = _all_to_all(xs, group, stats)  # (P, B, Tl, Hx/P, D): out[i] = my tokens, rank i's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, tl, world * hp, d)  # (B, Tl, Hx, D)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: Any = None,
                      stats: CommStats | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Ulysses causal attention over contiguously sequence-sharded q (B, Tl, H, D), k/v (B, Tl, Hkv, D).

    Returns (out (B, Tl, H, D), k_heads, v_heads (B, T, Hkv/P, D)): the output for this rank's tokens and
    the full-sequence K/V of this rank's heads (its share of the KV cache).
    """
    world = dist.get_world_size(group)
    check_ulysses(q.shape[2], k.shape[2], world)
    qh, kh, vh = (seq_to_head(x, group, stats) for x in (q, k, v))  # (B, T, H/P | Hkv/P, D)
    out = causal_attention(qh, kh, vh)  # (B, T, H/P, D)
    return head_to_seq(out, group, stats), kh, vh


# ---------------------------------------------------------------------------------------------
# The model-level driver


@dataclass
class _LayerCache:
    k: Tensor  # (B, S, Hkv_local, D)
    v: Tensor
    pos: Tensor  # (S,) absolute positions of the cached keys


@dataclass
class ContextParallelLM:
    """A `TransformerLM` run over one long prompt on the ranks of `group`, then greedy decoding.

    backend "ring": zig-zag sequence sharding, ring attention in prefill, KV cache sharded by sequence,
    decode merges per-rank partial attention by LSE. backend "ulysses": contiguous sharding, all-to-all
    head exchange, KV cache sharded by head. Every rank holds the full weights (compose with TP by giving
    a TP-sharded model and a CP group).
    """

    model: torch.nn.Module
    backend: Backend = "ring"
    group: Any = None
    stats: CommStats = field(default_factory=CommStats)

    def __post_init__(self) -> None:
        if self.backend not in ("ring", "ulysses"):
            raise ValueError(f"ContextParallelLM: backend={self.backend!r}, expected 'ring' or 'ulysses'")
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        c = self.model.config
        check_cp_features(c)  # at construction, not at the first forward
        if self.backend == "ulysses":
            check_ulysses(c.n_heads, c.n_kv_heads, self.world)
        self.cache: list[_LayerCache | None] = [None] * c.n_layers
        self.seq_len = 0  # tokens in the (logical, unsharded) cache
        self._decoded = 0

    # -- prefill --------------------------------------------------------------------------------
    def _prefill_attn(self, positions: Tensor) -> Callable[..., Tensor]:
        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
            require_plain(spec, q)
            if self.backend == "ring":
                out = ring_attention(q, k, v, positions, self.group, self.stats) if self.world > 1 else \
                    causal_attention(q, k, v)
                self.cache[layer] = _LayerCache(k, v, positions)
                return out
            if self.world == 1:
                self.cache[layer] = _LayerCache(k, v, positions)
                return causal_attention(q, k, v)
            out, kh, vh = ulysses_attention(q, k, v, self.group, self.stats)
            self.cache[layer] = _LayerCache(kh, vh, torch.arange(kh.shape[1]))
            return out
        return attn

    @torch.no_grad()
    def prefill(self, ids: list[int] | Tensor) -> Tensor:
        """Run the prompt sharded over the ranks; returns the final hidden states of all T prompt tokens
        in order, (T, d_model), after the final norm (identical on every rank). Fills the sharded KV cache."""
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        t = ids.numel()
        if t == 0:
            raise ValueError("ContextParallelLM.prefill: empty prompt")
        parts = 2 * self.world if self.backend == "ring" else self.world
        padded = -(-t // parts) * parts
        full = torch.cat((ids, ids.new_zeros(padded - t)))  # causal: padding at the end changes nothing before it
        scheme = "zigzag" if self.backend == "ring" else "contiguous"
        pos = shard_positions(padded, self.world, self.rank, scheme)  # (Tl,)
        h = self.model.hidden_states(full[pos].view(1, -1), pos, self._prefill_attn(pos))  # (1, Tl, d)
        h = self.model.norm(h[0])  # (Tl, d)
        # Drop the padding from the cache.
        for i, c in enumerate(self.cache):
            keep = c.pos < t
            self.cache[i] = _LayerCache(c.k[:, keep], c.v[:, keep], c.pos[keep])
        self.seq_len, self._decoded = t, 0
        if self.world == 1:
            return h[:t]
        gathered = [torch.empty_like(h) for _ in range(self.world)]
        dist.all_gather(gathered, h.contiguous(), group=self.group)
        self.stats.all_gather_bytes += _nbytes(h) * (self.world - 1)
        all_pos = [shard_positions(padded, self.world, r, scheme) for r in range(self.world)]
        out = torch.empty(padded, h.shape[-1], dtype=h.dtype)
        for p, g in zip(all_pos, gathered):
            out[p] = g
        return out[:t]

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits for normed hidden states (..., d_model): the head, then the model's logit scale and soft-cap."""
        return self.model.finish_logits(hidden @ self.model.output_weight.t())

    # -- decode ---------------------------------------------------------------------------------
    def _decode_attn(self, position: int, owner: int) -> Callable[..., Tensor]:
        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
            require_plain(spec, q)
            c = self.cache[layer]
            if self.backend == "ulysses" and self.world > 1:
                hq, hk = q.shape[2] // self.world, k.shape[2] // self.world
                qh = q[:, :, self.rank * hq:(self.rank + 1) * hq]  # (B, 1, H/P, D): my heads
                kh = k[:, :, self.rank * hk:(self.rank + 1) * hk]
                vh = v[:, :, self.rank * hk:(self.rank + 1) * hk]
                c = self.cache[layer] = _LayerCache(torch.cat((c.k, kh), 1), torch.cat((c.v, vh), 1),
                                                    torch.cat((c.pos, torch.tensor([position]))))
                o, _ = attention_with_lse(qh, c.k, c.v)  # (B, 1, H/P, D)
                heads = [torch.empty_like(o) for _ in range(self.world)]
                dist.all_gather(heads, o, group=self.group)
                self.stats.all_gather_bytes += _nbytes(o) * (self.world - 1)
                return torch.cat(heads, dim=2).to(q.dtype)  # (B, 1, H, D)
            if self.rank == owner:  # the new token's K/V lives on one rank (round-robin)
                c = self.cache[layer] = _LayerCache(torch.cat((c.k, k), 1), torch.cat((c.v, v), 1),
                                                    torch.cat((c.pos, torch.tensor([position]))))
            o, lse = attention_with_lse(q, c.k, c.v)  # (B, 1, H, D), (B, 1, H): over my shard only
            if self.world == 1:
                return o.to(q.dtype)
            packed = torch.cat((o.reshape(-1), lse.reshape(-1)))
            parts = [torch.empty_like(packed) for _ in range(self.world)]
            dist.all_gather(parts, packed, group=self.group)
            self.stats.all_gather_bytes += _nbytes(packed) * (self.world - 1)
            n = o.numel()
            merged, _ = merge_many([(p[:n].view_as(o), p[n:].view_as(lse)) for p in parts])
            return merged.to(q.dtype)
        return attn

    @torch.no_grad()
    def decode_step(self, token: int) -> Tensor:
        """Append `token` at the next position and return its logits (vocab,), identical on every rank."""
        if self.seq_len == 0:
            raise ValueError("ContextParallelLM.decode_step: call prefill first")
        position = self.seq_len
        owner = self._decoded % self.world
        ids = torch.tensor([[token]], dtype=torch.long)
        h = self.model.hidden_states(ids, torch.tensor([position]), self._decode_attn(position, owner))
        self.seq_len += 1
        self._decoded += 1
        return self.logits(self.model.norm(h[0, -1]))

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], Tensor]:
        """Greedy decoding: (new token ids, prompt hidden states (T, d))."""
        hidden = self.prefill(ids)
        tok = int(self.logits(hidden[-1]).argmax())
        out = [tok]
        for _ in range(max_new_tokens - 1):
            tok = int(self.decode_step(tok).argmax())
            out.append(tok)
        return out, hidden

    def kv_cache_bytes(self) -> int:
        """Bytes of K/V this rank holds."""
        return sum(_nbytes(c.k) + _nbytes(c.v) for c in self.cache if c is not None)


@torch.no_grad()
def reference_generate(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> tuple[list[int], Tensor]:
    """Single-process oracle: full causal prefill, then greedy decoding with a plain KV cache.
    Returns (new token ids, normed prompt hidden states (T, d))."""
    cache: list[tuple[Tensor, Tensor]] = []

    def prefill_attn(layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
        require_plain(spec, q)
        cache.append((k, v))
        return causal_attention(q, k, v)

    x = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    hidden = model.norm(model.hidden_states(x, None, prefill_attn)[0])  # (T, d)
    w = model.output_weight
    tok = int((hidden[-1] @ w.t()).argmax())
    out, pos = [tok], x.shape[1]
    for _ in range(max_new_tokens - 1):
        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
            require_plain(spec, q)
            ck, cv = cache[layer]
            ck, cv = torch.cat((ck, k), 1), torch.cat((cv, v), 1)
            cache[layer] = (ck, cv)
            return causal_attention(q, ck, cv, q_offset=ck.shape[1] - 1)
        h = model.hidden_states(torch.tensor([[tok]]), torch.tensor([pos]), attn)
        tok = int((model.norm(h[0, -1]) @ w.t()).argmax())
        out.append(tok)
        pos += 1
    return out, hidden


# ---------------------------------------------------------------------------------------------
# Local multi-process launch (tests, benchmark)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Plain pickle copies tensors by value: torch's queue reducers would pass shared-memory file
        # descriptors, which break once this process exits before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, whatever it is
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_gloo(fn: Callable, world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` local processes joined in a gloo group (1 thread each);
    returns the results by rank, or raises RuntimeError with the failing rank's traceback.
    `fn` must be importable (a module-level function)."""
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(r, world, port, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, status, value = q.get(timeout=timeout)
            except _queue.Empty as e:
                raise RuntimeError(f"spawn_gloo: ranks {sorted(set(range(world)) - set(results))} "
                                   f"gave no result within {timeout} s") from e
            if status != "ok":
                raise RuntimeError(f"spawn_gloo: rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
