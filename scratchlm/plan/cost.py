"""The cost model: memory, prefill and decode time of a DP x TP x PP x CP (x EP) layout on a cluster.

Every equation here is written out in docs/planning.md. The model is a roofline per rank plus an
alpha-beta model per collective:

- compute time = FLOPs / flops, memory time = bytes / mem_bw, and a step takes the larger of the two;
- attention's softmax work (scale, mask, max, exp, sum over the score matrix) is its own term,
  score elements / softmax_rate, since on CPUs it costs as much as the GEMMs at long context;
- a message of n bytes costs latency + n / bandwidth; ring all-reduce over p ranks
  2 (p-1) (latency + n / (p bandwidth)); all-gather and all-to-all (p-1) (latency + n / (p bandwidth));
- ring attention overlaps its K/V transfer with the block's compute: a step costs the larger.

The model's figures come from `ModelConfig`'s own counts (`num_parameters`, `layer_parameters`,
`matmul_weights_per_layer`, `attended_tokens`, `kv_spec`), split by how tensor parallelism divides them
(`split_count`): no parameter or KV formula lives here, so every family's features (biases, q/k-norms, sandwich
norms, plain MLPs, learned positions) count as the model builds them. A sliding window caps a layer's attention
work at its window, and the KV bytes as the engine frees them (`kv_bytes_per_sequence`).

Rank placement: TP innermost (neighbouring ranks), then CP, then PP, then DP; a group whose ranks
fall on different nodes uses the inter-node link.

Mixture of experts (`ModelConfig.moe`), as `scratchlm.parallel.expert` runs it: `ep` of the DP replicas (each
TP ranks) share one set of routed experts, E/ep per replica, each expert split over the replica's TP ranks by hidden
unit; attention is data-parallel (each replica runs its own sequences). Every MoE block all-gathers the per-expert
row counts over the EP group, sends each token's top_k copies of its d_model activations to the experts' replicas
and back (dispatch + combine: an all-to-all each, rows x top_k x d_model x bytes x (ep-1)/ep per rank, the share to
other nodes on the inter-node link); every layer sends the step's new K/V rows to the other replicas, so each keeps the
whole KV pool (`ep_kv="replicated"`; `"sharded"` models a deployment that keeps each replica's own sequences only,
as DeepSeek's does). A step of N tokens routed among E experts touches E (1 - (1 - k/E)^N) of them on average (each
expert chosen by a token with probability k/E): decode streams only those experts' weights, N k / touched rows each.
Multi-head latent attention (`ModelConfig.mla`) caches one latent per token (`kv_elements_per_token`) that every TP
rank keeps whole, and decodes absorbed: each head scores the latent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from scratchlm.model.config import ModelConfig
from scratchlm.plan.cluster import ClusterSpec


@dataclass(frozen=True)
class Layout:
    """Data x tensor x pipeline x context parallel sizes; world = dp * tp * pp * cp. `ep`: how many of the dp
    replicas share one set of routed experts (it divides dp; no more ranks: see the module docstring)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return f"DP{self.dp}xTP{self.tp}xPP{self.pp}xCP{self.cp}" + (f"xEP{self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class Workload:
    """Requests served together: prompt and output lengths and how many run at once."""

    prompt_len: int = 512
    output_len: int = 128
    concurrency: int = 1

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len", "concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Workload: {name}={v!r} must be a positive int")


@dataclass
class Terms:
    """Seconds spent in each resource. Ops run one after another (one thread per rank on a CPU, one kernel at
    a time on a GPU), each bound by compute or by memory: `compute` sums the compute-bound ops, `memory` the
    memory-bound ones, and the step takes their sum (see `total`)."""

    compute: float = 0.0
    memory: float = 0.0
    network: float = 0.0
    overlapped_network: float = 0.0  # hidden behind compute + memory where it is smaller
    overhead: float = 0.0  # fixed per-layer dispatch / launch cost, engine step bookkeeping
    comm_cpu: float = 0.0  # CPU time the rank spends in collective calls (in `work`, not in `total`)

    @property
    def work(self) -> float:
        """One rank's busy (CPU) time: compute + memory + overhead + the CPU cost of its collective calls."""
        return self.compute + self.memory + self.overhead + self.comm_cpu

    @property
    def total(self) -> float:
        return max(self.compute + self.memory, self.overlapped_network) + self.network + self.overhead

    @property
    def bottleneck(self) -> str:
        net = self.network + max(0.0, self.overlapped_network - self.compute - self.memory)
        return max((("compute", self.compute), ("memory bandwidth", self.memory), ("network", net),
                    ("per-op overhead", self.overhead)), key=lambda kv: kv[1])[0]

    def add_op(self, compute_s: float, memory_s: float) -> None:
        """One op (or a group of alike ops): it takes the larger of its compute and memory times."""
        if compute_s >= memory_s:
            self.compute += compute_s
        else:
            self.memory += memory_s


@dataclass
class Prediction:
    """What the model predicts for one layout."""

    layout: Layout
    feasible: bool
    reason: str = ""
    weights_bytes: float = 0.0  # per rank
    kv_bytes: float = 0.0
    activation_bytes: float = 0.0
    prefill: Terms = field(default_factory=Terms)  # one prompt
    decode: Terms = field(default_factory=Terms)  # one decode step of the replica's batch
    decode_rank: Terms = field(default_factory=Terms)  # the busiest rank's share of that step
    decode_stages: list[Terms] = field(default_factory=list)  # one micro-batch through each stage (a TP rank)
    microbatches: int = 1
    engine_overhead: float = 0.0  # rank 0's scheduler / sampler seconds per decode step
    batch_prefill: Terms = field(default_factory=Terms)  # the replica's prompts in one forward
    stage_layers: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    throughput: float = 0.0  # output tokens/s of the whole deployment
    total_s: float = 0.0  # the whole workload: prefills + decode
    decode_time_s: float = 0.0
    decode_a2a_s: float = 0.0  # expert parallelism's all-to-alls in one decode step (part of decode.network)
    prefill_a2a_s: float = 0.0  # and in one prompt's prefill
    experts_touched: float = 0.0  # routed experts one decode step touches per MoE block, this rank's
    expert_bytes: float = 0.0  # routed-expert weight bytes one decode step streams on the busiest rank
    note: str = ""  # what the prediction assumes beyond what scratchlm runs today

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    @property
    def bottleneck(self) -> str:
        """The resource that dominates the workload's time: prefill's or decode's, whichever costs more."""
        return self.decode.bottleneck if self.decode_share >= 0.5 else self.prefill.bottleneck

    @property
    def decode_share(self) -> float:
        """Fraction of the workload time spent decoding."""
        return 0.0 if self.total_s == 0 else min(1.0, self.decode_time_s / self.total_s)


def tp_units(c: ModelConfig) -> tuple[int, int]:
    """(units tensor parallelism splits attention by, query heads per unit): KV heads with their query heads, or
    MLA's query heads one by one (the latent is not split)."""
    if c.mla.kv_lora_rank:
        return c.n_heads, 1
    return c.n_kv_heads, c.n_heads // c.n_kv_heads


@dataclass(frozen=True)
class Split:
    """A per-block count (parameters, matmul weights) by how tensor parallelism divides it: `per_group` goes with
    each KV head and its query heads (MLA: each query head), `per_unit` with each MLP hidden unit, `per_shared`
    with each shared-expert hidden unit, `rest` is replicated. Routed experts are not in it (`routed_local`)."""

    per_group: int
    per_unit: int
    rest: int
    per_shared: int = 0

    def local(self, c: ModelConfig, tp: int) -> int:
        """The count on the largest TP rank (whole KV-head groups, the first ranks take the larger ranges)."""
        return (self.rest + math.ceil(tp_units(c)[0] / tp) * self.per_group + math.ceil(c.d_ff / tp) * self.per_unit
                + math.ceil(c.moe.d_shared / tp) * self.per_shared)


def _routed(c: ModelConfig, layer: int, active: bool) -> int:
    """The routed experts' part of a block's count: all experts' parameters, or the top_k one token multiplies."""
    if not c.is_moe_layer(layer):
        return 0
    return (c.moe.top_k if active else c.moe.n_experts) * c.expert_parameters()


def split_count(c: ModelConfig, count: Callable[[ModelConfig], int]) -> Split:
    """Split `count(c)` (a `ModelConfig` count of one block, routed experts left out) by linearity: one KV-head group
    more (n_heads + G, n_kv_heads + 1; MLA: one query head) adds `per_group`, one hidden unit more (d_ff + 1)
    `per_unit`, one shared-expert unit more `per_shared`. So the planner keeps no parameter formula of its own; the
    model config's counts are the only ones."""
    base = count(c)
    units, group = tp_units(c)
    kv_more = c.n_kv_heads + (1 if not c.mla.kv_lora_rank else (1 if c.n_kv_heads == c.n_heads else 0))
    per_group = count(replace(c, n_heads=c.n_heads + group, n_kv_heads=kv_more)) - base
    per_unit = count(replace(c, d_ff=c.d_ff + 1)) - base
    per_shared = 0
    if c.moe.n_experts:
        per_shared = count(replace(c, moe=replace(c.moe, d_shared=c.moe.d_shared + 1))) - base
    return Split(per_group, per_unit, base - units * per_group - c.d_ff * per_unit - c.moe.d_shared * per_shared,
                 per_shared)


@dataclass(frozen=True)
class ModelCounts:
    """What the cost model reads of a config, all from `ModelConfig`'s own counts, per block (dense and MoE blocks
    differ; both kinds are split once)."""

    layers: list[Split]  # parameters of each block, routed experts left out
    matmul: list[Split]  # weights one token multiplies in each block, routed experts left out
    moe: list[bool]  # whether each block is a MoE block
    expert: int  # parameters of one routed expert
    embedding: int  # vocab x d_model
    positions: int  # learned absolute positions (stage 0)
    final_norm: int  # the final norm (last stage)

    @classmethod
    def of(cls, c: ModelConfig) -> ModelCounts:
        blocks = sum(c.layer_parameters(i) for i in range(c.n_layers))
        outside = c.num_parameters() - blocks  # embedding, positions, final norm, head
        embedding = c.vocab_size * c.d_model
        positions = c.num_parameters() - replace(c, learned_positions=False).num_parameters()
        head = 0 if c.tie_embeddings else embedding
        kinds: dict[bool, tuple[Split, Split]] = {}
        for i in range(c.n_layers):
            kind = c.is_moe_layer(i)
            if kind not in kinds:
                kinds[kind] = (split_count(c, lambda m, i=i: m.layer_parameters(i) - _routed(m, i, False)),
                               split_count(c, lambda m, i=i: m.matmul_weights_per_layer(i) - _routed(m, i, True)))
        moe = [c.is_moe_layer(i) for i in range(c.n_layers)]
        return cls([kinds[k][0] for k in moe], [kinds[k][1] for k in moe], moe, c.expert_parameters(),
                   embedding, positions, outside - embedding - head - positions)


def expert_local(c: ModelConfig, tp: int) -> int:
    """Parameters of one routed expert's slice on a TP rank (`ModelConfig.expert_parameters` at 1/tp of the width;
    the down projection's bias, if any, on every rank)."""
    return replace(c, moe=replace(c.moe, d_expert=math.ceil(c.d_expert / tp))).expert_parameters()


def routed_local(c: ModelConfig, tp: int, ep: int) -> int:
    """Routed-expert parameters of one MoE block on one rank: E/ep experts at 1/tp of their width."""
    if not c.moe.n_experts:
        return 0
    return math.ceil(c.moe.n_experts / ep) * expert_local(c, tp)


def rank_parameters(c: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> list[int]:
    """Parameters each pipeline stage's largest TP rank holds (the vocabulary padded to equal shards, routed experts
    split over `ep`); at TP = PP = EP = 1 the model's `num_parameters()`."""
    n = ModelCounts.of(c)
    routed = routed_local(c, tp, ep)
    layer = [n.layers[i].local(c, tp) + (routed if n.moe[i] else 0) for i in range(c.n_layers)]
    emb = math.ceil(c.vocab_size / tp) * c.d_model
    head_separate = not (c.tie_embeddings and pp == 1)  # a tied head on its own stage is a second copy
    stages = stage_layers(c, pp)
    starts = [sum(stages[:s]) for s in range(pp)]
    return [sum(layer[starts[s]:starts[s] + stages[s]]) + ((emb + n.positions) if s == 0 else 0)
            + ((emb if head_separate else 0) + n.final_norm if s == pp - 1 else 0) for s in range(pp)]


def kv_bytes_per_sequence(c: ModelConfig, layers: range, ctx: int, tp: int = 1, cp: int = 1,
                          dtype_bytes: float = 4) -> float:
    """K and V bytes one sequence of `ctx` tokens keeps in `layers` on one rank (`ModelConfig.kv_spec()`): a rank
    keeps its KV heads and 1/cp of the tokens; MLA's latent (`kv_elements_per_token`) is whole on every TP rank.
    Windows as the engine frees KV: its one block table serves every
    layer, so a sequence keeps only the window when every layer is windowed (`inference.kv_cache.kv_window`, e.g.
    Mistral), the whole context otherwise (Gemma 2/3 alternate windowed and full layers)."""
    from scratchlm.inference.kv_cache import kv_window

    spec = c.kv_spec()
    window = kv_window(spec)
    kept = ctx if window is None else min(ctx, window)
    if c.mla.kv_lora_rank:
        return sum(math.ceil(kept / cp) * c.kv_elements_per_token(i) * dtype_bytes for i in layers)
    return sum(math.ceil(kept / cp) * math.ceil(spec[i].n_kv_heads / tp) * (spec[i].head_dim + spec[i].value_dim)
               * dtype_bytes for i in layers)


def ffn_width(c: ModelConfig) -> float:
    """Feed-forward hidden units one token goes through, averaged over the blocks: d_ff in a dense block, top_k x
    d_expert + d_shared in a MoE block."""
    moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    sparse = c.moe.top_k * c.d_expert + c.moe.d_shared if moe else 0
    return ((c.n_layers - moe) * c.d_ff + moe * sparse) / c.n_layers


def experts_touched(n_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens choose, each expert taken with probability k/E by each token:
    E (1 - (1 - k/E)^N)."""
    if n_experts == 0 or tokens <= 0:
        return 0.0
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def _alltoall(n: float, p: int, cluster: ClusterSpec, inner: int = 1) -> float:
    """One all-to-all among p ranks spaced `inner` apart in which each rank sends n bytes in all (1/p of them to
    each rank, itself included): the peers on its node over the intra-node link, the others over the inter-node
    one, both at once."""
    if p <= 1:
        return 0.0
    local = max(1, min(p, cluster.devices_per_node // inner))
    intra = (local - 1) * (cluster.intra_latency + n / (p * cluster.intra_bw))
    inter = (p - local) * (cluster.inter_latency + n / (p * cluster.inter_bw))
    return max(intra, inter)


def _allreduce(n: float, p: int, lat: float, bw: float) -> float:
    return 0.0 if p <= 1 else 2 * (p - 1) * (lat + n / (p * bw))


def _allgather(n_total: float, p: int, lat: float, bw: float) -> float:
    """All-gather (or all-to-all) where each rank ends with n_total bytes, of which it sent n_total / p."""
    return 0.0 if p <= 1 else (p - 1) * (lat + n_total / (p * bw))


def _spans_nodes(inner: int, size: int, cluster: ClusterSpec) -> bool:
    """Does a group of `size` ranks spaced `inner` apart cross a node boundary? (Also when groups do not tile
    a node evenly: TP=3 on 8-GPU nodes puts some groups across two nodes.)"""
    span = inner * size
    return size > 1 and (span > cluster.devices_per_node or cluster.devices_per_node % span != 0)


def ring_score_elements(t: int, cp: int) -> float:
    """Score elements one rank computes per head in a causal zig-zag ring prefill of t tokens over cp ranks
    (chunk pairs the mask hides entirely are skipped): t^2/(2cp) (1 + 1/(2cp)); t^2 on one rank (the
    unblocked causal kernel computes the full square)."""
    return float(t) * t if cp == 1 else t * t / (2 * cp) * (1 + 1 / (2 * cp))


def elementwise_elements(c: ModelConfig, tp: int = 1) -> float:
    """Elements per token per layer that the block's elementwise ops touch, as `calibrate.measure_elementwise`
    counts them: two RMSNorms and two residual adds over d_model, RoPE over q and k, SiLU x up over the
    feed-forward's width (`ffn_width`)."""
    units, group = tp_units(c)
    h_local = math.ceil(units / tp) * group
    kv_local = 1 if c.mla.kv_lora_rank else math.ceil(c.n_kv_heads / tp)
    return 4 * c.d_model + (h_local + kv_local) * c.attention_head_dims()[0] + ffn_width(c) / tp


def stage_layers(c: ModelConfig, pp: int) -> list[int]:
    """Layers per pipeline stage as the engine splits them (`scratchlm.parallel.layout.balanced_stages`:
    contiguous, balanced by parameter count with the embedding on the first stage and the head on the last)."""
    if pp <= 1:
        return [c.n_layers]
    if pp > c.n_layers:
        return [1] * c.n_layers + [0] * (pp - c.n_layers)
    from scratchlm.parallel.layout import balanced_stages

    return balanced_stages(c, pp)


def per_token_activation_elements(c: ModelConfig, tp: int = 1) -> float:
    """Float32 elements per prompt token live at a prefill's peak besides the KV cache and the scores, when the
    cluster has no measured `token_bytes`: residual stream, norm output, q, k, v, attention output (d_model and
    head widths), gate and up (`ffn_width`)."""
    units, group = tp_units(c)
    h_local = math.ceil(units / tp) * group
    kv_local = 1 if c.mla.kv_lora_rank else math.ceil(c.n_kv_heads / tp)
    return 4 * c.d_model + 3 * ffn_width(c) / tp + (h_local + 2 * kv_local) * c.head_dim


def _linear(t: Terms, cluster: ClusterSpec, weights: float, rows: float, slow: float, expert: bool = False) -> None:
    """A linear layer of `weights` elements times `rows` rows (`expert`: routed experts' forwards): compute- or
    memory-bound by the roofline."""
    if weights <= 0 or rows <= 0:
        return
    sec = cluster.linear_time(weights, rows, expert) * slow
    if 2 * rows * weights / cluster.flops >= weights * cluster.weight_dtype_bytes / cluster.mem_bw:
        t.compute += sec
    else:
        t.memory += sec


def _broadcast(n: float, p: int, lat: float, bw: float) -> float:
    """Tree broadcast of n bytes to p ranks."""
    return 0.0 if p <= 1 else math.ceil(math.log2(p)) * (lat + n / bw)


def predict(c: ModelConfig, w: Workload, cluster: ClusterSpec, layout: Layout,
            ranks_per_node: int | None = None, cp_kind: str = "ring", ep_kv: str = "replicated") -> Prediction:
    """Predict memory and times of `layout`. `ranks_per_node` > devices_per_node models oversubscription
    (ranks share devices: every time grows by the ratio), used to check the model locally. `ep_kv`: whether the
    EP replicas all-gather every step's new K/V and keep the whole pool ("replicated", as scratchlm's EP does) or
    each its own sequences' ("sharded")."""
    if ep_kv not in ("replicated", "sharded"):
        raise ValueError(f"predict: ep_kv={ep_kv!r}, expected 'replicated' or 'sharded'")
    pred = Prediction(layout, feasible=True)
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    problems = ep_problems(c, layout)
    units, group = tp_units(c)
    if tp > units:
        problems.append(f"TP={tp} > {c.n_heads} query heads (MLA shards by head)" if c.mla.kv_lora_rank else
                        f"TP={tp} > {c.n_kv_heads} KV heads (tensor parallelism shards by KV head)")
    if pp > c.n_layers:
        problems.append(f"PP={pp} > {c.n_layers} layers")
    if dp > w.concurrency:
        problems.append(f"DP={dp} > concurrency {w.concurrency} (idle replicas)")
    if cp > 1 and w.prompt_len < 2 * cp:
        problems.append(f"CP={cp} needs a prompt of at least {2 * cp} tokens")
    if cp_kind == "ulysses" and (c.n_kv_heads % (cp * tp) or c.n_heads % (cp * tp)):
        problems.append(f"Ulysses CP={cp} x TP={tp} must divide {c.n_kv_heads} KV heads")
    if cp > 1:
        from scratchlm.parallel.layout import cp_unsupported_features

        problems += [f"CP={cp} does not implement the {f}" for f in cp_unsupported_features(c)]
    e = cluster.dtype_bytes
    ekv = cluster.kv_dtype_bytes
    rpn = ranks_per_node or min(layout.world, cluster.devices_per_node)
    slow = max(1.0, rpn / cluster.devices_per_node)  # ranks sharing a device run this much slower
    flops, mem_bw = cluster.flops / slow, cluster.mem_bw / slow
    elem_rate, overhead = cluster.elementwise_rate / slow, cluster.layer_overhead * slow

    kv_local = math.ceil(c.n_kv_heads / tp)  # the largest TP shard (whole KV-head groups)
    h_local = math.ceil(units / tp) * group
    stages = stage_layers(c, pp)
    pred.stage_layers = stages
    stage_range = [range(sum(stages[:s]), sum(stages[:s + 1])) for s in range(pp)]
    counts = ModelCounts.of(c)
    lin = [counts.matmul[i].local(c, tp) for i in range(c.n_layers)]  # linear weights of each layer on one rank
    n_moe = [sum(counts.moe[i] for i in r) for r in stage_range]  # MoE blocks of each stage
    emb = math.ceil(c.vocab_size / tp) * c.d_model  # the head's rows on one rank
    pred.weights_bytes = max(rank_parameters(c, tp, pp, ep)) * cluster.weight_dtype_bytes
    dqk, dv = c.attention_head_dims()
    if c.mla.kv_lora_rank:  # absorbed decode: every head scores the latent + RoPE key and sums the latents
        m_ = c.mla
        dec_flops_key = h_local * 2 * (2 * m_.kv_lora_rank + m_.qk_rope_head_dim)
        dec_bytes_key = c.kv_elements_per_token(0) * ekv
    else:
        dec_flops_key = h_local * 2 * (dqk + dv)
        dec_bytes_key = 2 * kv_local * c.head_dim * ekv

    # KV cache: this replica's sequences, its stage's layers, its KV heads, 1/cp of the tokens (windows: as the
    # engine frees them).
    batch = math.ceil(w.concurrency / dp)
    ctx = w.prompt_len + w.output_len
    kv_replicas = ep if ep_kv == "replicated" else 1  # an EP group's replicas each keep all of its sequences
    pred.kv_bytes = batch * kv_replicas * max(kv_bytes_per_sequence(c, r, ctx, tp, cp, ekv) for r in stage_range)

    # Activations of one prompt's prefill (the peak): per-token buffers plus the attention scores.
    tl = math.ceil(w.prompt_len / cp)
    if cluster.token_bytes:
        per_token = cluster.token_bytes * per_token_activation_elements(c, tp) / per_token_activation_elements(c)
    else:
        per_token = per_token_activation_elements(c, tp) * 4
    if cp == 1 or cp_kind == "ulysses":
        heads = h_local if cp == 1 else h_local // cp
        sq = w.prompt_len
        sk = max(c.attended_tokens(i, w.prompt_len) for i in range(c.n_layers))  # windows narrow the scores
    else:
        heads, sq = h_local, math.ceil(w.prompt_len / (2 * cp))
        sk = sq
    pred.activation_bytes = tl * per_token + cluster.score_bytes * heads * sq * sk
    if pred.memory_bytes > cluster.mem_capacity:
        problems.append(f"needs {pred.memory_bytes / 2**30:.2f} GiB per rank > {cluster.mem_capacity / 2**30:.2f} GiB")

    # Which link each group uses (TP innermost, then CP, then PP, then DP).
    tp_lat, tp_bw = cluster.link(_spans_nodes(1, tp, cluster))
    cp_lat, cp_bw = cluster.link(_spans_nodes(tp, cp, cluster))
    pp_lat, pp_bw = cluster.link(_spans_nodes(tp * cp, pp, cluster))
    L = c.n_layers
    ew = elementwise_elements(c, tp)
    # Routed experts: E/ep per replica at 1/tp of their width, serving the tokens of the ep replicas.
    ew_expert = expert_local(c, tp) if c.moe.n_experts else 0
    ep_lat, ep_bw = cluster.link(_spans_nodes(tp, ep, cluster))
    if c.mla.kv_lora_rank:
        kv_row = c.kv_elements_per_token(0) * ekv  # one token's new KV in one layer on one rank
    else:
        kv_row = 2 * kv_local * c.head_dim * ekv

    def routed(terms: Terms, rows: float, moe_layers: int, layers: int) -> float:
        """`moe_layers` MoE blocks of `rows` tokens per replica (each of its TP ranks holds them all) on this rank's
        experts: the experts the EP group's tokens touch, each streamed once with its share of the rows, plus the
        routing's fixed costs; and EP's collectives in `layers` layers (counts, dispatch, combine; the K/V rows).
        Returns the all-to-all seconds (added to `terms.network`)."""
        if not moe_layers or not ew_expert or rows <= 0:
            return 0.0
        tokens = rows * ep
        touched = experts_touched(c.moe.n_experts, c.moe.top_k, tokens)
        python = ep > 1 or not cluster.fused_moe  # the Python MoE block (its own curve and overheads)
        _linear(terms, cluster, moe_layers * touched / ep * ew_expert, tokens * c.moe.top_k / touched, slow, python)
        if python:
            terms.overhead += moe_layers * (touched / ep * cluster.expert_overhead + cluster.moe_overhead) * slow
        if ep == 1:
            return 0.0
        terms.overhead += moe_layers * cluster.ep_layer_overhead * slow
        sent = rows * c.moe.top_k * c.d_model * e  # the replica's tokens, top_k copies, from each of its TP ranks
        a2a = moe_layers * 2 * _alltoall(sent, ep, cluster, inner=tp)  # dispatch + combine
        terms.network += a2a + moe_layers * _allgather(ep * c.moe.n_experts * 8, ep, ep_lat, ep_bw)  # row counts
        if ep_kv == "replicated":
            terms.network += layers * _allgather(ep * rows * kv_row, ep, ep_lat, ep_bw)
        return a2a

    # ---- prefill: `prompts` prompts in one forward (the engine batches them), stages one after another ----
    t = w.prompt_len
    if cp_kind == "ulysses" and cp > 1:
        score = L * h_local / cp * float(t) * t
    else:  # summed over the layers; a windowed layer's queries see at most the window (ModelConfig.attended_tokens)
        score = h_local * sum(ring_score_elements(t, cp) if c.window(i) is None or cp > 1
                              else float(t) * c.attended_tokens(i, t) for i in range(L))

    def prefill_terms(prompts: int) -> tuple[Terms, float]:
        """The forward of `prompts` prompts, and its all-to-all seconds (in its network term)."""
        pre = Terms()
        _linear(pre, cluster, sum(lin), prompts * tl, slow)
        _linear(pre, cluster, emb, prompts, slow)  # the last token's logits
        a2a = routed(pre, prompts * tl, sum(n_moe), L)
        smax = cluster.softmax_for(heads * sq * sk) / slow  # one attention op's score matrix in cache or not
        pre.add_op(prompts * (2 * score * (dqk + dv) / flops + score / smax), 0.0)
        pre.add_op(0.0, prompts * L * tl * ew / elem_rate)
        pre.overhead += L * overhead + prompts * L * cluster.prefill_seq_overhead * slow  # (+ the MoE blocks')
        calls = (2 * L + 1 if tp > 1 else 0) + (3 * sum(n_moe) + (L if ep_kv == "replicated" else 0) if ep > 1 else 0)
        pre.comm_cpu = calls * cluster.comm_cpu * slow
        if cp > 1 and cp_kind != "ulysses":
            pre.overhead += L * (cp - 1) * cluster.ring_step_overhead * slow  # the extra ring steps
        act = prompts * tl * c.d_model * e
        pre.network += (L * 2 + 1) * _allreduce(act, tp, tp_lat, tp_bw)
        pre.network += (pp - 1) * (pp_lat + act / pp_bw)
        if cp > 1:
            if cp_kind == "ulysses":
                qkvo = prompts * tl * (2 * h_local + 2 * kv_local) * c.head_dim * e
                pre.network += L * _allgather(qkvo, cp, cp_lat, cp_bw)
            else:
                block = 2 * prompts * tl * kv_local * c.head_dim * e  # this rank's K and V
                pre.overlapped_network = L * (cp - 1) * (cp_lat + block / cp_bw)
        return pre, a2a

    pred.prefill, pred.prefill_a2a_s = prefill_terms(1)
    batch_prefill = prefill_terms(batch)[0]

    # ---- one decode step: every sequence of the replica advances one token ----
    # With pp > 1 the batch is cut into m micro-batches that flow through the stages: a step costs the sum of
    # the stages' times for one micro-batch plus (m - 1) times the slowest stage; each stage streams its weights
    # once per micro-batch.
    s_avg = w.prompt_len + w.output_len / 2
    m = min(pp, batch) if pp > 1 else 1
    rows = batch / m
    stage_terms: list[Terms] = []
    a2a_stages: list[float] = []
    ep_network = 0.0
    for s in range(pp):
        st = Terms()
        n = stages[s]
        _linear(st, cluster, sum(lin[i] for i in stage_range[s]), rows, slow)
        if s == pp - 1:
            _linear(st, cluster, emb, rows, slow)
        a2a = routed(st, rows, n_moe[s], n)
        a2a_stages.append(a2a)
        ep_network, st.network = st.network, 0.0  # EP's collectives enter the step below, with the others
        # keys the stage's layers attend to (a windowed layer: its window), this rank's 1/cp of them
        ctx_tokens = rows * sum(c.attended_tokens(i, s_avg) for i in stage_range[s]) / cp
        smax = cluster.softmax_for(h_local * s_avg / cp) / slow
        st.add_op(ctx_tokens * (dec_flops_key / flops + h_local / smax), ctx_tokens * dec_bytes_key / mem_bw)
        st.add_op(0.0, n * rows * ew / elem_rate)
        st.overhead += n * overhead
        calls = (2 * n + (s == 0) + (s == pp - 1)) if tp > 1 else 0  # all-reduces, the logits' all-gather
        if pp > 1:  # activations in / out, the logits to rank 0
            calls += (s > 0) + (s < pp - 1) + (s == pp - 1) + (s == 0)
        calls += (3 * n_moe[s] + (n if ep_kv == "replicated" else 0)) if ep > 1 else 0  # counts, a2a x 2, K/V
        st.comm_cpu = calls * cluster.comm_cpu * slow
        stage_terms.append(st)
    slowest = max(stage_terms, key=lambda x: x.work)
    dec = Terms()
    for name in ("compute", "memory", "overhead"):
        setattr(dec, name, sum(getattr(x, name) for x in stage_terms) + (m - 1) * getattr(slowest, name))
    engine = (cluster.step_overhead + batch * ep * cluster.seq_overhead) * slow  # scheduler, sampler (rank 0): all
    # the sequences of its EP group
    dec.overhead += engine
    x = rows * c.d_model * e
    for s in range(pp):  # TP collectives of every stage, per micro-batch: 2 per layer, the embedding, the logits
        calls = 2 * stages[s] + (1 if s == 0 else 0)
        dec.network += m * calls * _allreduce(x, tp, tp_lat, tp_bw)
    dec.network += m * _allgather(rows * c.vocab_size * e, tp, tp_lat, tp_bw)
    if pp > 1:  # activations between stages, the logits back to rank 0
        dec.network += m * ((pp - 1) * (pp_lat + x / pp_bw) + pp_lat + rows * c.vocab_size * e / pp_bw)
    dec.network += 2 * _broadcast(64 + 48 * batch, tp * pp, pp_lat, pp_bw)  # the step command (size, payload)
    if cp > 1:  # partial outputs + LSE gathered and merged in every layer
        dec.network += L * _allgather(cp * batch * h_local * (c.head_dim + 1) * 4, cp, cp_lat, cp_bw)
    pred.decode_a2a_s = m * sum(a2a_stages)
    dec.network += m * ep_network  # (EP runs without PP: one stage)
    if ep > 1:  # each replica's logits to rank 0
        dec.network += (ep - 1) * (ep_lat + rows * c.vocab_size * 4 / ep_bw)
    if ew_expert:
        tokens = rows * ep
        pred.experts_touched = experts_touched(c.moe.n_experts, c.moe.top_k, tokens) / ep
        pred.expert_bytes = m * max(n_moe) * pred.experts_touched * ew_expert * cluster.weight_dtype_bytes
    pred.decode = dec
    busiest = max(range(pp), key=lambda s: m * stage_terms[s].work + (engine if s == 0 else 0.0))
    rank = Terms()
    for name in ("compute", "memory", "overhead", "comm_cpu"):
        setattr(rank, name, m * getattr(stage_terms[busiest], name))
    if tp * pp > 1:
        rank.comm_cpu += 2 * cluster.comm_cpu * slow  # the step command's two broadcasts
    rank.overhead += engine if busiest == 0 else 0.0
    pred.decode_rank = rank
    pred.decode_stages, pred.microbatches, pred.engine_overhead = stage_terms, m, engine
    pred.batch_prefill = batch_prefill

    pred.tpot_s = dec.total
    pred.ttft_s = batch_prefill.total  # the replica's prompts arrive together and share the first steps
    decode_time = w.output_len * dec.total
    pred.total_s = batch_prefill.total + decode_time
    pred.decode_time_s = decode_time
    pred.throughput = w.concurrency * w.output_len / pred.total_s
    if problems:
        pred.feasible, pred.reason = False, "; ".join(problems)
    return pred


def ep_problems(c: ModelConfig, layout: Layout) -> list[str]:
    """Why `layout`'s expert parallelism cannot run `c` (empty: it can); as `scratchlm.parallel.expert` checks."""
    ep = layout.ep
    if ep == 1:
        return []
    out = []
    if not c.moe.n_experts:
        out.append(f"EP={ep} needs a mixture-of-experts model")
    elif c.moe.n_experts % ep:
        out.append(f"EP={ep} does not divide the {c.moe.n_experts} experts")
    if layout.dp % ep:
        out.append(f"EP={ep} must divide DP={layout.dp} (the replicas that share the experts)")
    if layout.cp > 1 or layout.pp > 1:
        out.append(f"EP={ep} does not run with pipeline or context parallelism")
    return out


def enumerate_layouts(world: int, max_cp: int | None = None, n_experts: int = 0) -> list[Layout]:
    """Every (dp, tp, pp, cp) with dp * tp * pp * cp == world; for a MoE model (`n_experts` > 0) also every EP > 1
    that divides dp and the experts (PP = CP = 1)."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for tp in divs:
        for pp in divs:
            for cp in divs:
                if world % (tp * pp * cp) == 0 and (max_cp is None or cp <= max_cp):
                    lay = Layout(world // (tp * pp * cp), tp, pp, cp)
                    out.append(lay)
                    if n_experts and cp == 1 and pp == 1:
                        out += [Layout(lay.dp, tp, 1, 1, ep) for ep in range(2, lay.dp + 1)
                                if lay.dp % ep == 0 and n_experts % ep == 0]
    return out


def plan(c: ModelConfig, w: Workload, cluster: ClusterSpec, objective: str = "throughput",
         world: int | None = None, ep_kv: str = "replicated") -> list[Prediction]:
    """Predictions for every layout of `world` ranks (default: all devices), feasible ones first, ranked by
    `objective`: "throughput" (output tokens/s, ties by TTFT) or "ttft"."""
    if objective not in ("throughput", "ttft"):
        raise ValueError(f"plan: objective={objective!r}, expected 'throughput' or 'ttft'")
    world = world or cluster.devices
    if world > cluster.devices:
        raise ValueError(f"plan: world={world} ranks but the cluster has {cluster.devices} devices "
                         f"({cluster.nodes} nodes x {cluster.devices_per_node})")
    preds = [predict(c, w, cluster, lay, ep_kv=ep_kv) for lay in enumerate_layouts(world, n_experts=c.moe.n_experts)]

    def key(p: Prediction) -> tuple:
        if objective == "throughput":
            return (not p.feasible, -p.throughput, p.ttft_s)
        return (not p.feasible, p.ttft_s, -p.throughput)

    return sorted(preds, key=key)


def _ms(seconds: float) -> str:
    """Milliseconds with 3 significant digits, so a small term never prints as 0.00 beside a bigger one."""
    ms = seconds * 1e3
    return "0 ms" if ms == 0 else f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def explain(ranked: list[Prediction], objective: str = "throughput") -> str:
    """A few sentences on why the first layout wins, against the runner-up and the plain replicas."""
    feasible = [p for p in ranked if p.feasible]
    if not feasible:
        reasons = sorted({p.reason for p in ranked})[:3]
        return "No layout fits: " + " | ".join(reasons)
    best = feasible[0]
    phase = "decode" if best.decode_share >= 0.5 else "prefill"  # the phase whose bottleneck `best.bottleneck` is
    share = best.decode_share if phase == "decode" else 1 - best.decode_share
    lines = [
        f"Best for {objective}: {best.layout} -- {best.throughput:.1f} output tok/s, TTFT {best.ttft_s * 1e3:.1f} ms, "
        f"{best.memory_bytes / 2**30:.2f} GiB per rank; limited by {best.bottleneck} in {phase} "
        f"({phase} is {share:.0%} of the time)."
    ]

    def terms(t: Terms) -> str:
        compute = f"compute {_ms(t.compute)}" + (" (every op memory-bound)" if t.compute == 0 and t.memory else "")
        return (f"{compute}, memory {_ms(t.memory)}, network {_ms(t.network + t.overlapped_network)}, "
                f"per-op overhead {_ms(t.overhead)}")

    lines.append(f"Its decode step: {terms(best.decode)}; one prefill: {terms(best.prefill)}.")
    if best.experts_touched:
        a2a = (f"; expert parallelism's all-to-alls take {_ms(best.decode_a2a_s)} of the step "
               f"({best.decode_a2a_s / best.tpot_s:.0%}) and {_ms(best.prefill_a2a_s)} of a prefill "
               f"({best.prefill_a2a_s / best.prefill.total:.0%})" if best.layout.ep > 1 else "")
        lines.append(f"A decode step runs {best.experts_touched:.1f} routed experts per MoE block on a rank "
                     f"({best.expert_bytes / 2**30:.2f} GiB of expert weights streamed){a2a}.")
    if best.note:
        lines.append(f"Note: {best.note}.")
    if len(feasible) > 1:
        r = feasible[1]
        lines.append(f"Runner-up {r.layout}: {r.throughput:.1f} tok/s, TTFT {r.ttft_s * 1e3:.1f} ms "
                     f"({r.bottleneck}-bound).")
    replicas = next((p for p in feasible if p.layout.tp == p.layout.pp == p.layout.cp == p.layout.ep == 1), None)
    if replicas is not None and replicas is not best:
        lines.append(f"Plain replicas {replicas.layout}: {replicas.throughput:.1f} tok/s, "
                     f"TTFT {replicas.ttft_s * 1e3:.1f} ms.")
    comm_heavy = [p for p in feasible if p.bottleneck == "network"]
    if comm_heavy:
        lines.append(f"{len(comm_heavy)} of {len(feasible)} feasible layouts spend more time communicating than "
                     "computing: there splitting costs more than it saves.")
    infeasible = len(ranked) - len(feasible)
    if infeasible:
        lines.append(f"{infeasible} layouts are infeasible (e.g. {next(p for p in ranked if not p.feasible).reason}).")
    return "\n".join(lines)
