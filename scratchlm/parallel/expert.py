"""Expert parallelism (EP) for mixture-of-experts models, with data-parallel attention (DeepSeek's deployment).

`LLMEngine.from_pretrained(path, EngineConfig(expert_parallel_size=E, tensor_parallel_size=T))` (so
`LLM(path, expert_parallel_size=E)` and `scratchlm serve --expert-parallel-size E`) runs E x T ranks,
``rank = ep_rank * T + tp_rank``: E replicas of the T-way tensor-parallel model (`parallel/tensor.py`), whose MoE
layers share their routed experts. The model code is not changed: each rank builds the model's own blocks and
`ShardedLM` swaps every `MoE` feed-forward for an `ExpertParallelMoE` holding only the rank's experts (as it swaps
row-parallel linears for `RowParallel`).

Who holds what:

- experts: every MoE layer's `n_experts` routed experts in E contiguous ranges, replica r holds
  [r n/E, (r+1) n/E) (`n_experts % E == 0`, else a start-up error). Inside a replica each expert is split over
  the T tp ranks by hidden unit, as the dense MLP is (w1/w3 rows, w2 columns);
- the router (`gate`, `score_bias`), the shared expert (split over TP like the experts), attention, the dense
  layers, the embedding and the head are in every replica (TP-sharded inside it);
- the KV cache: every replica holds the whole pool (its TP shard of the heads), so KV capacity is that of one
  replica, not E times it (see "Attention" below).

A step (rank 0 broadcasts the scheduler's `ModelInput` to every rank, as under TP):

1. split: the step's sequences are cut into E groups (`split_model_input`, whole sequences balanced by token
   count; the same on every rank); replica r runs group r through the model: embedding, attention, dense
   layers and the head on its own tokens only (data-parallel attention). A replica with no sequence in the
   step (batch 1 at E = 2) runs zero rows but still takes part in every exchange.
2. attention: each replica computes q/k/v for its tokens; the new K/V rows (MLA: latents and RoPE keys) are sent
   to the other replicas over the EP group (the ranks with the same KV heads, one per replica; an
   `all_to_all_single` in which each rank sends its rows to every other) and written into every replica's
   cache, then each replica attends for its own rows. So any replica can run any sequence in any later step
   (no sticky assignment; prefix caching, preemption and copy-on-write work as with one rank), for the price
   of 2 x rows x kv_heads x head_dim values (MLA: rows x (kv_lora_rank + rope dims)) per layer and step on the
   wire and a replicated KV pool.
3. MoE layer (`ExpertParallelMoE.forward`): route the replica's tokens with the replicated router (the model's
   own `route`, HF's tie-breaking); count rows per expert and all-gather the counts over the EP group (so each
   rank knows what it will receive, and rank 0 knows every expert's load); *dispatch*: the token rows, one per
   (token, chosen expert), grouped by expert, go to the experts' owners with `all_to_all_single`; *experts*:
   each rank runs each of its experts once on all the rows it received for it (from every replica, in replica
   order); *combine*: the outputs go back with the reverse `all_to_all_single` and each token's outputs are
   weighted and summed in expert-id order, with the same `index_add_` calls as one rank's `MoE.routed`, so the
   float sums are the same as one rank's. Under TP the experts' and the shared expert's outputs are partial
   sums over the hidden units: one all-reduce over the replica's TP group per MoE layer.
4. head: each replica computes the logits of its sampled rows (all-gathered over its TP group); replica r's
   tp rank 0 sends them to rank 0, which puts them back in the step's order.

gloo on CPU, NCCL on CUDA (`all_to_all_single` needs gloo >= the one in torch 2.x, which has it). A dead rank
fails the step as under TP (the EP collectives use the step timeout; rank 0's runner names the dead rank;
the heartbeats of `runner.py` serve /health). Per-expert load (rows routed to each expert, per MoE layer, summed
over replicas) accumulates on rank 0: `ExpertParallelRunner.expert_load()`, which the engine's stats carry to
/metrics and the inspector.

Not supported (start-up errors): EP with pipeline or context parallelism, with quantization or speculative
decoding (as under TP), and a model without routed experts. EP x TP on a model with multi-head latent attention
splits MLA by query head (`MLAttention.tp_plan`); every TP rank caches and exchanges the whole latent.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import Tensor, nn

from scratchlm.inference.attention import PagedAttention
from scratchlm.inference.runner import ModelInput
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import MLP
from scratchlm.model.moe import MoE
from scratchlm.parallel.comm import Comm
from scratchlm.parallel.layout import RankLayout
from scratchlm.parallel.pipeline import split_model_input
from scratchlm.parallel.runner import ParallelRunner

_LOGITS_TAG = 1 << 21  # p2p tag of replica r's logits to rank 0: _LOGITS_TAG + r


def moe_shards(prefix: str, moe: MoE, config: ModelConfig, layout: RankLayout) -> dict:
    """{parameter name: Shard} of one MoE feed-forward on `layout`'s rank: the router whole, its experts'
    hidden units split over TP, the shared expert likewise; the other replicas' experts are absent."""
    from scratchlm.parallel.tensor import WHOLE, module_shards

    out = {prefix + name: WHOLE for name, _ in moe.named_parameters()  # the router's: gate, biases, shared gate
           if not name.startswith(("experts.", "shared."))}
    for e in range(*layout.experts):
        out.update(module_shards(f"{prefix}experts.{e}.", moe.experts[e], config, layout, units=layout.expert_ff))
    if moe.shared is not None:
        out.update(module_shards(prefix + "shared.", moe.shared, config, layout, units=layout.shared_ff))
    return out


class ExpertParallelMoE(nn.Module):
    """One rank's part of a `MoE` layer (see the module docstring): the replicated router and shared expert, the
    rank's experts `experts[str(e)]` (global ids), the all-to-all dispatch and combine. Parameter names are the
    `MoE`'s, so the rank's state dict slots in unchanged; routing is the model's own `MoE.route` (every router
    feature the model has: softmax / sigmoid / top-k-then-softmax, groups, biases)."""

    def __init__(self, moe: MoE, layout: RankLayout, comm: Comm):
        super().__init__()
        self.features, self.layout, self.comm = moe.features, layout, comm
        for name, child in moe.named_children():  # gate, shared, shared_gate: everything but the routed experts
            if name != "experts":
                setattr(self, name, child)
        for name, p in moe.named_parameters(recurse=False):  # score_bias, router_bias
            setattr(self, name, p)
        for name in ("score_bias", "router_bias", "shared", "shared_gate"):  # the features' absent parts: None
            if not hasattr(self, name):
                setattr(self, name, None)
        self.first, self.stop = layout.experts
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(self.first, self.stop)})
        n = self.features.n_experts
        self.load = torch.zeros(n, dtype=torch.long)  # rows routed to each expert, every replica's, since reset
        self.seconds: dict[str, float] = defaultdict(float)  # route / experts / combine compute (comm: Comm.seconds)

    def _tick(self, kind: str, t: float) -> float:
        now = time.perf_counter()
        self.seconds[kind] += now - t
        return now

    def forward(self, x: Tensor) -> Tensor:
        lay, comm, f = self.layout, self.comm, self.features
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d_model): this replica's tokens
        t = time.perf_counter()
        k, n_exp, ep = f.top_k, f.n_experts, lay.ep
        if x.shape[0]:
            weights, ids = MoE.route(self, x)  # (N, k) each: the model's routing, on this module's router
        else:  # a replica with no sequence in the step still takes part in the exchanges
            weights = torch.empty(0, k, device=x.device)
            ids = torch.empty(0, k, dtype=torch.long, device=x.device)
        flat = ids.flatten()  # (N * k,): token n's j-th choice at n * k + j
        order = flat.argsort(stable=True)  # slots grouped by expert (so by owner), tokens in order within each
        counts = torch.bincount(flat, minlength=n_exp)  # (E,)
        t = self._tick("route", t)
        everyone = comm.ep_all_gather(counts, "ep_counts") if ep > 1 else counts[None]  # (ep, E)
        t = time.perf_counter()
        self.load += everyone.sum(0).cpu()
        per = n_exp // ep
        mine = everyone[:, self.first:self.stop]  # (ep, per): rows each replica sends for each of my experts
        send_rows = counts.view(ep, per).sum(1).tolist()
        recv_rows = mine.sum(1).tolist()
        rows = x.index_select(0, order // k)  # (N * k, d_model): one row per (token, choice), grouped by expert
        t = self._tick("route", t)
        got = comm.all_to_all(rows, send_rows, recv_rows, "ep_dispatch") if ep > 1 else rows  # (R, d_model)
        t = time.perf_counter()
        # the received rows are source-major (replica 0's rows for my experts, grouped by expert, then replica 1's):
        # regroup them expert-major so each expert runs once
        local_ids = torch.arange(per, device=x.device).repeat(ep)  # (ep * per,): expert of each (source, expert)
        row_expert = torch.repeat_interleave(local_ids, mine.flatten().to(x.device))  # (R,)
        by_expert = row_expert.argsort(stable=True)  # (R,): expert-major, sources in order within each
        done = torch.empty_like(got)
        start = 0
        for j, n in enumerate(mine.sum(0).tolist()):
            if n == 0:
                continue
            idx = by_expert[start:start + n]
            start += n
            done.index_copy_(0, idx, self.experts[str(self.first + j)](got.index_select(0, idx)))  # (n, d_model)
        t = self._tick("experts", t)
        back = comm.all_to_all(done, recv_rows, send_rows, "ep_combine") if ep > 1 else done  # (N * k, d_model)
        t = time.perf_counter()
        out = torch.zeros_like(x)
        w = weights.flatten()
        start = 0
        for n in counts.tolist():  # experts in id order, as `MoE.routed` adds them
            if n == 0:
                continue
            slots = order[start:start + n]
            y = back[start:start + n]
            start += n
            out.index_add_(0, slots // k, y * w.index_select(0, slots)[:, None].to(y.dtype))
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        self._tick("combine", t)
        return comm.all_reduce(out).view(shape)  # under TP: the sum of the hidden-unit slices' partial outputs

    def extra_repr(self) -> str:
        return f"experts=[{self.first}, {self.stop}) of {self.features.n_experts}, top_k={self.features.top_k}"


def check_expert_tp(moe: MoE, tp: int) -> None:
    """Experts split over TP are MLPs (their partial outputs are summed by `ExpertParallelMoE`'s all-reduce)."""
    mlps = [*moe.experts, *([moe.shared] if moe.shared is not None else [])]
    if tp > 1 and not all(isinstance(m, MLP) for m in mlps):
        raise ValueError("tensor parallelism: MoE experts that are not MLPs are not supported under TP")


def tp_output_bias(name: str, t: Tensor, tp_rank: int) -> Tensor:
    """An MoE expert's output bias (`experts.N.b2`, `shared.b2`, gpt-oss) as TP rank `tp_rank` holds it: whole on
    rank 0, zeros on the others, so the all-reduce of the hidden-unit slices' partial outputs adds it once."""
    return t if tp_rank == 0 or not name.endswith(".b2") else torch.zeros_like(t)


class DataParallelAttention:
    """The attention backend of one replica under EP: the replica's own rows attend (a `PagedAttention` over its
    sub-batch), after the other replicas' new cache rows (K/V, or MLA's latent and RoPE key) are exchanged over the
    EP group and written into this rank's cache, so every replica's cache holds every sequence."""

    def __init__(self, local: PagedAttention, comm: Comm, rows: list[int], other_slots: Tensor):
        self.local, self.comm, self.rows = local, comm, rows
        self.other_slots = other_slots  # (sum of the other replicas' rows,): their slots, replica order

    def _exchange(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Send this replica's new cache rows k (n, ...), v (n, ...) to every other replica, write theirs."""
        me, ep = self.comm.layout.ep_rank, self.comm.layout.ep
        n, kw, vw = k.shape[0], k.shape[1:].numel(), v.shape[1:].numel()
        rows = torch.cat((k.reshape(n, kw), v.reshape(n, vw)), dim=1)  # (n, kw + vw); n may be 0
        send = [0 if r == me else n for r in range(ep)]  # to every other replica, nothing to itself
        recv = [0 if r == me else m for r, m in enumerate(self.rows)]
        others = self.comm.all_to_all(rows.repeat(ep - 1, 1), send, recv, "ep_kv")  # (m, kw + vw)
        if others.shape[0]:
            m = others.shape[0]
            self.local.cache.write(layer, self.other_slots, others[:, :kw].reshape(m, *k.shape[1:]),
                                   others[:, kw:].reshape(m, *v.shape[1:]))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, spec=None) -> Tensor:
        self._exchange(layer, k[0], v[0])  # (n, Hkv, D) each
        if q.shape[1] == 0:  # no sequence of this replica in the step
            return torch.empty_like(q)
        return self.local(layer, q, k, v, spec)

    def mla(self, layer: int, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, module,
            spec) -> Tensor:
        """Multi-head latent attention (`PagedAttention.mla`): the latents (n, c) and RoPE keys (n, r) exchanged."""
        self._exchange(layer, latent[0][:, None], k_rope[0][:, None])  # (n, 1, c), (n, 1, r): as the cache holds
        return self.local.mla(layer, q_nope, q_rope, latent, k_rope, module, spec)


class ExpertParallelRunner(ParallelRunner):
    """`ParallelRunner` of an EP x TP world: data-parallel attention over the EP replicas (module docstring)."""

    def _split(self, inp: ModelInput) -> list[tuple[ModelInput, list[int]]]:
        """The step's sequences in `ep` groups (the same on every rank); groups past the step's sequences empty."""
        ep = self.layout.ep
        groups = split_model_input(inp, ep) if inp.token_ids else []
        empty = ModelInput([], [], [], 0, [], [], [], [])
        return [(sub, pos) for sub, pos in groups] + [(empty, [])] * (ep - len(groups))

    @torch.inference_mode()
    def _step(self, inp: ModelInput) -> torch.Tensor | None:
        self.steps += 1
        self.cache.copy_blocks(inp.block_copies)  # every replica's cache holds every sequence
        lay, comm, model = self.layout, self.comm, self.model
        vocab = model.config.vocab_size
        if not inp.token_ids:
            return torch.empty(0, 0, device=self.device)
        groups = self._split(inp)
        sub, _ = groups[lay.ep_rank]
        sub.block_copies = []  # done above
        rows = [len(g.token_ids) for g, _ in groups]
        other_slots = self._tensor([s for r, (g, _) in enumerate(groups) if r != lay.ep_rank for s in g.slot_mapping])
        attn = DataParallelAttention(PagedAttention(self.cache, self._metadata(sub)), comm, rows, other_slots)
        positions = self._tensor(sub.positions)  # (n,)
        x = model.embed_tokens(self._tensor(sub.token_ids)[None, :], positions)  # (1, n, d)
        x = model.forward_layers(x, positions, attn, self._rope_lengths(sub))  # (1, n, d)
        logits = None
        if sub.logits_indices:
            logits = model.logits(x[0].index_select(0, self._tensor(sub.logits_indices)))  # (m, vocab)
        if lay.rank != 0:
            if lay.tp_rank == 0 and logits is not None:
                comm.wait(comm.isend(logits, 0, _LOGITS_TAG + lay.ep_rank), "send_wait")
            return None
        out = torch.empty(len(inp.logits_indices), vocab, dtype=self.dtype, device=self.device)
        recvs = []
        for r, (_, where) in enumerate(groups):
            if not where:
                continue
            if r == 0:
                out[self._tensor(where)] = logits
                continue
            buf = torch.empty(len(where), vocab, dtype=self.dtype, device=self.device)
            recvs.append((buf, where, comm.irecv(buf, r * lay.tp, _LOGITS_TAG + r)))
        for buf, where, work in recvs:
            comm.wait(work, nbytes=buf.numel() * buf.element_size())
            out[self._tensor(where)] = buf
        return out

    def _moe_layers(self) -> list[tuple[int, ExpertParallelMoE]]:
        first = self.layout.layers[0]
        return [(first + j, b.ffn) for j, b in enumerate(self.model.lm.layers) if isinstance(b.ffn, ExpertParallelMoE)]

    def expert_load(self) -> dict[int, list[int]]:
        """{layer: rows routed to each expert} since the engine started (every replica's tokens; rank 0)."""
        return {i: moe.load.tolist() for i, moe in self._moe_layers()}

    def expert_seconds(self) -> dict[str, float]:
        """This rank's MoE compute time by part (route, experts, combine), summed over layers, since reset."""
        out: dict[str, float] = defaultdict(float)
        for _, moe in self._moe_layers():
            for kind, s in moe.seconds.items():
                out[kind] += s
        return dict(out)

    def reset_expert_stats(self) -> None:
        """Zero this rank's per-expert load and MoE compute times."""
        for _, moe in self._moe_layers():
            moe.seconds.clear()
            moe.load.zero_()
