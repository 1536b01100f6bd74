"""The cost model: memory, prefill and decode time of a DP x TP x PP x CP layout on a cluster.

Every equation here is written out in docs/planning.md. The model is a roofline per rank plus an
alpha-beta model per collective:

- compute time = FLOPs / flops, memory time = bytes / mem_bw, and a step takes the larger of the two;
- attention's softmax work (scale, mask, max, exp, sum over the score matrix) is its own term,
  score elements / softmax_rate, since on CPUs it costs as much as the GEMMs at long context;
- a message of n bytes costs latency + n / bandwidth; ring all-reduce over p ranks
  2 (p-1) (latency + n / (p bandwidth)); all-gather and all-to-all (p-1) (latency + n / (p bandwidth));
- ring attention overlaps its K/V transfer with the block's compute: a step costs the larger.

Rank placement: TP innermost (neighbouring ranks), then CP, then PP, then DP; a group whose ranks
fall on different nodes uses the inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scratchlm.model.config import ModelConfig
from scratchlm.plan.cluster import ClusterSpec


@dataclass(frozen=True)
class Layout:
    """Data x tensor x pipeline x context parallel sizes; world = dp * tp * pp * cp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return f"DP{self.dp}xTP{self.tp}xPP{self.pp}xCP{self.cp}"


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
    """Seconds spent in each resource; the step time combines them (see `total`)."""

    compute: float = 0.0
    memory: float = 0.0
    network: float = 0.0
    overlapped_network: float = 0.0  # hidden behind compute where it is smaller
    overhead: float = 0.0  # fixed per-layer dispatch / launch cost

    @property
    def total(self) -> float:
        return max(self.compute, self.memory, self.overlapped_network) + self.network + self.overhead

    @property
    def bottleneck(self) -> str:
        net = self.network + max(0.0, self.overlapped_network - max(self.compute, self.memory))
        return max((("compute", self.compute), ("memory bandwidth", self.memory), ("network", net),
                    ("per-op overhead", self.overhead)), key=lambda kv: kv[1])[0]


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
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    throughput: float = 0.0  # output tokens/s of the whole deployment
    total_s: float = 0.0  # the whole workload: prefills + decode
    decode_time_s: float = 0.0

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


def attention_params(c: ModelConfig) -> int:
    """q, k, v, o projection weights of one block."""
    return c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)


def mlp_params(c: ModelConfig) -> int:
    """SwiGLU weights of one block (gate, up, down)."""
    return 3 * c.d_model * c.d_ff


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


def predict(c: ModelConfig, w: Workload, cluster: ClusterSpec, layout: Layout,
            ranks_per_node: int | None = None, cp_kind: str = "ring") -> Prediction:
    """Predict memory and times of `layout`. `ranks_per_node` > devices_per_node models oversubscription
    (ranks share devices: compute and memory slow down by the ratio), used to check the model locally."""
    pred = Prediction(layout, feasible=True)
    dp, tp, pp, cp = layout.dp, layout.tp, layout.pp, layout.cp
    problems = []
    if tp > c.n_kv_heads:
        problems.append(f"TP={tp} > {c.n_kv_heads} KV heads (tensor parallelism shards by KV head)")
    if pp > c.n_layers:
        problems.append(f"PP={pp} > {c.n_layers} layers")
    if dp > w.concurrency:
        problems.append(f"DP={dp} > concurrency {w.concurrency} (idle replicas)")
    if cp > 1 and w.prompt_len < 2 * cp:
        problems.append(f"CP={cp} needs a prompt of at least {2 * cp} tokens")
    if cp_kind == "ulysses" and (c.n_kv_heads % (cp * tp) or c.n_heads % (cp * tp)):
        problems.append(f"Ulysses CP={cp} x TP={tp} must divide {c.n_kv_heads} KV heads")
    e = cluster.dtype_bytes
    ekv = cluster.kv_dtype_bytes
    rpn = ranks_per_node or min(layout.world, cluster.devices_per_node)
    share = min(1.0, cluster.devices_per_node / rpn)  # fraction of a device each rank gets
    flops, mem_bw, smax = cluster.flops * share, cluster.mem_bw * share, cluster.softmax_rate * share

    kv_local = math.ceil(c.n_kv_heads / tp)  # the largest TP shard (whole KV-head groups)
    h_local = kv_local * (c.n_heads // c.n_kv_heads)
    a_frac = kv_local / c.n_kv_heads
    ls = math.ceil(c.n_layers / pp)
    layer_local = attention_params(c) * a_frac + mlp_params(c) / tp + 2 * c.d_model
    emb = c.vocab_size * c.d_model / tp
    head = emb  # the output head (tied or not) is computed on the last stage
    stage_params = ls * layer_local + (emb + (0 if c.tie_embeddings and pp == 1 else head))
    pred.weights_bytes = stage_params * e

    # KV cache: this replica's sequences, its stage's layers, its KV heads, 1/cp of the tokens.
    batch = math.ceil(w.concurrency / dp)
    ctx = w.prompt_len + w.output_len
    kv_per_token = 2 * ls * kv_local * c.head_dim * ekv
    pred.kv_bytes = batch * math.ceil(ctx / cp) * kv_per_token

    # Activations of one prompt's prefill (the peak): per-token buffers plus the attention scores.
    tl = math.ceil(w.prompt_len / cp)
    per_token = (4 * c.d_model + 3 * c.d_ff / tp + (h_local + 2 * kv_local) * c.head_dim) * 4
    if cp == 1 or cp_kind == "ulysses":
        heads = h_local if cp == 1 else h_local // cp
        sq = sk = w.prompt_len
    else:
        heads, sq = h_local, math.ceil(w.prompt_len / (2 * cp))
        sk = sq
    pred.activation_bytes = tl * per_token + 1.5 * heads * sq * sk * 4
    if pred.memory_bytes > cluster.mem_capacity:
        problems.append(f"needs {pred.memory_bytes / 2**30:.2f} GiB per rank > {cluster.mem_capacity / 2**30:.2f} GiB")

    # Which link each group uses (TP innermost, then CP, then PP, then DP).
    tp_lat, tp_bw = cluster.link(_spans_nodes(1, tp, cluster))
    cp_lat, cp_bw = cluster.link(_spans_nodes(tp, cp, cluster))
    pp_lat, pp_bw = cluster.link(_spans_nodes(tp * cp, pp, cluster))

    # ---- prefill of one prompt (its stages run one after the other) ----
    t = w.prompt_len
    gemm_flops = 2 * tl * (c.n_layers * layer_local) + 2 * c.d_model * c.vocab_size / tp  # + last token's logits
    if cp_kind == "ulysses" and cp > 1:
        score = h_local / cp * float(t) * t
    else:
        score = h_local * ring_score_elements(t, cp)
    attn_flops = 4 * score * c.head_dim * c.n_layers
    streamed = c.n_layers * tl * (6 * c.d_model + 4 * c.d_ff / tp) * 12  # norms, rope, silu: ~3 passes of 4 B
    pre = Terms()
    pre.compute = (gemm_flops + attn_flops) / flops + c.n_layers * score / smax + streamed / mem_bw
    pre.overhead = c.n_layers * cluster.layer_overhead
    pre.memory = c.n_layers * layer_local * e / mem_bw + emb * e / mem_bw
    act = tl * c.d_model * e
    pre.network += c.n_layers * 2 * _allreduce(act, tp, tp_lat, tp_bw)
    pre.network += (pp - 1) * (pp_lat + act / pp_bw)
    if cp > 1:
        if cp_kind == "ulysses":
            qkvo = tl * (2 * h_local + 2 * kv_local) * c.head_dim * e
            pre.network += c.n_layers * _allgather(qkvo, cp, cp_lat, cp_bw)
        else:
            block = 2 * tl * kv_local * c.head_dim * e  # this rank's K and V
            pre.overlapped_network = c.n_layers * (cp - 1) * (cp_lat + block / cp_bw)
    pred.prefill = pre

    # ---- one decode step: every sequence of the replica advances one token ----
    s_avg = w.prompt_len + w.output_len / 2
    dec = Terms()
    st_flops = 2 * batch * (ls * layer_local + emb / pp) + 4 * batch * s_avg / cp * h_local * c.head_dim * ls
    st_bytes = stage_params * e + batch * s_avg / cp * kv_per_token
    dec.compute = pp * (st_flops / flops + batch * ls * (s_avg / cp) * h_local / smax)
    dec.memory = pp * st_bytes / mem_bw
    dec.overhead = c.n_layers * cluster.layer_overhead
    x = batch * c.d_model * e
    dec.network = c.n_layers * 2 * _allreduce(x, tp, tp_lat, tp_bw) + (pp - 1) * (pp_lat + x / pp_bw)
    if cp > 1:  # partial outputs + LSE gathered and merged in every layer
        dec.network += c.n_layers * _allgather(cp * batch * h_local * (c.head_dim + 1) * 4, cp, cp_lat, cp_bw)
    pred.decode = dec

    pred.tpot_s = dec.total
    t_prefill = pre.total
    pred.ttft_s = t_prefill * (batch + 1) / 2  # prompts of a replica are prefilled one after another
    prefill_time = batch * t_prefill
    decode_time = w.output_len * dec.total
    pred.total_s = prefill_time + decode_time
    pred.decode_time_s = decode_time
    pred.throughput = w.concurrency * w.output_len / pred.total_s
    if problems:
        pred.feasible, pred.reason = False, "; ".join(problems)
    return pred


def enumerate_layouts(world: int, max_cp: int | None = None) -> list[Layout]:
    """Every (dp, tp, pp, cp) with dp * tp * pp * cp == world."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for tp in divs:
        for pp in divs:
            for cp in divs:
                if world % (tp * pp * cp) == 0 and (max_cp is None or cp <= max_cp):
                    out.append(Layout(world // (tp * pp * cp), tp, pp, cp))
    return out


def plan(c: ModelConfig, w: Workload, cluster: ClusterSpec, objective: str = "throughput",
         world: int | None = None) -> list[Prediction]:
    """Predictions for every layout of `world` ranks (default: all devices), feasible ones first, ranked by
    `objective`: "throughput" (output tokens/s, ties by TTFT) or "ttft"."""
    if objective not in ("throughput", "ttft"):
        raise ValueError(f"plan: objective={objective!r}, expected 'throughput' or 'ttft'")
    world = world or cluster.devices
    if world > cluster.devices:
        raise ValueError(f"plan: world={world} ranks but the cluster has {cluster.devices} devices "
                         f"({cluster.nodes} nodes x {cluster.devices_per_node})")
    preds = [predict(c, w, cluster, lay) for lay in enumerate_layouts(world)]

    def key(p: Prediction) -> tuple:
        if objective == "throughput":
            return (not p.feasible, -p.throughput, p.ttft_s)
        return (not p.feasible, p.ttft_s, -p.throughput)

    return sorted(preds, key=key)


def explain(ranked: list[Prediction], objective: str = "throughput") -> str:
    """A few sentences on why the first layout wins, against the runner-up and the plain replicas."""
    feasible = [p for p in ranked if p.feasible]
    if not feasible:
        reasons = sorted({p.reason for p in ranked})[:3]
        return "No layout fits: " + " | ".join(reasons)
    best = feasible[0]
    lines = [
        f"Best for {objective}: {best.layout} -- {best.throughput:.1f} output tok/s, TTFT {best.ttft_s * 1e3:.1f} ms, "
        f"{best.memory_bytes / 2**30:.2f} GiB per rank; limited by {best.bottleneck} "
        f"(decode is {best.decode_share:.0%} of the time)."
    ]
    d = best.decode
    lines.append(f"Its decode step: compute {d.compute * 1e3:.2f} ms, memory {d.memory * 1e3:.2f} ms, "
                 f"network {d.network * 1e3:.2f} ms; one prefill: compute {best.prefill.compute * 1e3:.1f} ms, "
                 f"network {(best.prefill.network + best.prefill.overlapped_network) * 1e3:.1f} ms.")
    if len(feasible) > 1:
        r = feasible[1]
        lines.append(f"Runner-up {r.layout}: {r.throughput:.1f} tok/s, TTFT {r.ttft_s * 1e3:.1f} ms "
                     f"({r.bottleneck}-bound).")
    replicas = next((p for p in feasible if p.layout.tp == p.layout.pp == p.layout.cp == 1), None)
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
