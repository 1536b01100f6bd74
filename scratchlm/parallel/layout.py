"""Which slice of the model each rank holds, and the fail-fast checks run before any weight loads.

Ranks are numbered ``rank = replica * (pp * tp) + stage * tp + tp_rank``: the `tp` ranks of one pipeline
stage are neighbours (one tensor-parallel group per stage), and rank 0 (stage 0, tp rank 0, replica 0) runs
the scheduler. Context parallelism (CP) replicates the TP x PP model C times; the ranks with the same stage
and tp rank form one CP group, which shares a sequence's KV cache by token (`scratchlm.parallel.context`).
Expert parallelism (EP) replicates the TP model's attention and dense layers E times (data-parallel attention)
and splits the routed experts of every MoE layer into E contiguous ranges, one per replica; the ranks with the
same tp rank form one EP group, which exchanges token rows with all-to-all (`scratchlm.parallel.expert`).
CP and EP are not combined (a replica index is one or the other).

Tensor parallelism shards attention *by KV head*: a rank keeps a contiguous range of KV heads and
the query heads of their groups (GQA), so its paged KV cache holds only its KV heads. Shards are as
even as whole KV-head groups allow: SmolLM2-135M (9 query heads, 3 KV heads) at TP=2 gives rank 0
two KV heads (6 query heads) and rank 1 one (3 query heads). The MLP's hidden size and the vocabulary
are split into near-equal contiguous ranges (the vocabulary padded so every shard has the same
number of rows, which an all-gather needs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from scratchlm.model.config import ModelConfig


def split_range(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` items in `parts` contiguous ranges whose sizes differ by at most one (the first ones larger)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def cp_unsupported_features(config: ModelConfig) -> list[str]:
    """The model's features that context parallelism (the engine's CP and `sequence.py`'s ring / Ulysses) does not
    implement, each with its layers: it implements plain causal softmax(q.k / sqrt(D)) attention only (no soft-cap,
    no window, no other query scale); everything else runs in the model's own code."""
    import math

    c = config
    out = []
    if c.attn.logit_softcap is not None:
        out.append(f"attention logit soft-cap attn.logit_softcap={c.attn.logit_softcap}")
    windowed = [i for i in range(c.n_layers) if c.window(i) is not None]
    if windowed:
        out.append(f"sliding window attn.sliding_window={c.attn.sliding_window} (layers {windowed})")
    if c.query_scale() != 1.0 / math.sqrt(c.head_dim):
        out.append(f"query scale {c.query_scale():g} (not 1/sqrt(head_dim={c.head_dim}))")
    from scratchlm.model.transformer import attention_spec

    odd = [i for i in range(c.n_layers) if not attention_spec(c, i).is_plain(c.head_dim)]
    if odd and not out:  # a spec feature added to the model after this list was written
        out.append(f"non-plain attention on layers {odd}: {attention_spec(c, odd[0])}")
    return out


def check_cp_features(config: ModelConfig) -> None:
    """Raise ValueError naming the features context parallelism does not implement (at start-up, before any
    weight loads), instead of a NotImplementedError at the first forward."""
    missing = cp_unsupported_features(config)
    if missing:
        raise ValueError("context parallelism implements plain causal attention only; this model has "
                         + "; ".join(missing) + ": run it without context_parallel_size (tensor / pipeline "
                         "parallelism support these features)")


def balanced_stages(config: ModelConfig, pp: int) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's parameter count.

    Stage 0 also holds the embedding and the last stage the final norm and the output head, so
    they count towards those stages (a tied head still costs a copy of the embedding there).
    """
    n = config.n_layers
    weights = [config.layer_parameters(i) for i in range(n)]  # dense and MoE blocks differ
    emb = config.vocab_size * config.d_model
    # what is not in the blocks: the embedding (+ learned positions) on stage 0, the final norm and the head last
    rest = config.num_parameters() - sum(weights) - emb - (0 if config.tie_embeddings else emb)
    weights[0] += emb
    weights[-1] += emb + rest
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest max-stage weight splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(pp, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def parse_stage_layers(text: str | None) -> list[int] | None:
    """'3,2' -> [3, 2]; None/'' -> None. Bad text is a ValueError naming the option."""
    if text is None or text == "":
        return None
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"pipeline_stage_layers={text!r}: expected comma-separated layer counts, e.g. '3,2'") from None
    return sizes


def check_parallel_config(config: ModelConfig, tp: int, pp: int, world_size: int | None = None,
                          stage_layers: list[int] | None = None, cp: int = 1, ep: int = 1) -> None:
    """Raise one ValueError naming every factor that does not fit; call it before loading any weight."""
    problems = []
    for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp), ("context_parallel_size", cp),
                    ("expert_parallel_size", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{name}={v!r} must be a positive integer")
    if problems:
        raise ValueError("invalid parallel configuration: " + "; ".join(problems))
    if world_size is not None and tp * pp * cp * ep != world_size:
        cp_text = f" x context_parallel_size ({cp})" if cp > 1 else ""
        ep_text = f" x expert_parallel_size ({ep})" if ep > 1 else ""
        problems.append(f"tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}){cp_text}{ep_text} = "
                        f"{tp * pp * cp * ep} != world size {world_size}")
    if ep > 1:
        problems += expert_parallel_problems(config, tp, pp, cp, ep)
    if cp > 1 and pp > 1:
        problems.append(f"context_parallel_size={cp} with pipeline_parallel_size={pp} is not supported "
                        f"(CP composes with tensor parallelism only); drop one of them")
    if tp > config.n_kv_heads:
        problems.append(f"tensor_parallel_size={tp} exceeds the model's n_kv_heads={config.n_kv_heads} "
                        f"(n_heads={config.n_heads}): attention and the KV cache are sharded by KV head, "
                        f"so every rank needs at least one")
    if tp > config.d_ff:
        problems.append(f"tensor_parallel_size={tp} exceeds the MLP hidden size d_ff={config.d_ff}")
    if tp > config.vocab_size:
        problems.append(f"tensor_parallel_size={tp} exceeds vocab_size={config.vocab_size}")
    if pp > config.n_layers:
        problems.append(f"pipeline_parallel_size={pp} exceeds the model's n_layers={config.n_layers}: "
                        f"every stage needs at least one layer")
    if stage_layers is not None:
        if len(stage_layers) != pp:
            problems.append(f"pipeline_stage_layers={stage_layers} has {len(stage_layers)} stages, "
                            f"pipeline_parallel_size={pp}")
        if sum(stage_layers) != config.n_layers or any(s < 1 for s in stage_layers):
            problems.append(f"pipeline_stage_layers={stage_layers} must be positive and sum to "
                            f"n_layers={config.n_layers}")
    if problems:
        raise ValueError("invalid parallel configuration: " + "; ".join(problems))


def expert_parallel_problems(config: ModelConfig, tp: int, pp: int, cp: int, ep: int) -> list[str]:
    """Why `expert_parallel_size=ep` (with these other sizes) cannot run this model; empty when it can."""
    f = config.moe
    if f.n_experts == 0:
        return [f"expert_parallel_size={ep} needs a mixture-of-experts model; this one has no routed experts "
                f"(moe.n_experts=0): use tensor_parallel_size / pipeline_parallel_size instead"]
    problems = []
    if f.n_experts % ep:
        problems.append(f"expert_parallel_size={ep} does not divide the model's moe.n_experts={f.n_experts}: every "
                        f"EP rank holds the same number of experts (a contiguous range); pick a divisor of "
                        f"{f.n_experts}")
    if pp > 1:
        problems.append(f"expert_parallel_size={ep} with pipeline_parallel_size={pp} is not supported (EP composes "
                        f"with tensor parallelism only); drop one of them")
    if cp > 1:
        problems.append(f"expert_parallel_size={ep} with context_parallel_size={cp} is not supported (EP composes "
                        f"with tensor parallelism only); drop one of them")
    if tp > config.d_expert:
        problems.append(f"tensor_parallel_size={tp} exceeds the experts' hidden size d_expert={config.d_expert}")
    return problems


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of the model."""

    rank: int
    tp: int
    pp: int
    layers: tuple[int, int]  # [start, stop) of the global layer indices held by this rank's stage
    kv_heads: tuple[int, int]  # [start, stop) of KV heads
    q_heads: tuple[int, int]  # [start, stop) of query heads (the groups of the KV heads above)
    ff: tuple[int, int]  # [start, stop) of the MLP hidden units
    vocab: tuple[int, int]  # [start, stop) of vocabulary rows (real ones)
    vocab_shard: int  # rows per vocabulary shard, padded: every rank holds this many
    cp: int = 1  # context-parallel replicas of the TP x PP model
    ep: int = 1  # expert-parallel replicas of the TP model (each holds a range of every MoE layer's experts)
    experts: tuple[int, int] = (0, 0)  # [start, stop) of the routed experts this rank holds (MoE models)
    expert_ff: tuple[int, int] = (0, 0)  # [start, stop) of each held expert's hidden units (split over TP)
    shared_ff: tuple[int, int] = (0, 0)  # [start, stop) of the shared expert's hidden units (split over TP)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def replica(self) -> int:
        """Which CP or EP replica of the TP x PP model this rank is in (0 when there is one)."""
        return self.rank // (self.tp * self.pp)

    @property
    def cp_rank(self) -> int:
        return self.replica if self.cp > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.replica if self.ep > 1 else 0

    @property
    def replicas(self) -> int:
        return self.cp * self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def stage_ranks(self, stage: int, cp_rank: int | None = None) -> list[int]:
        """Global ranks of `stage`'s tensor-parallel group (in CP replica `cp_rank`, default: this rank's)."""
        base = (self.replica if cp_rank is None else cp_rank) * self.tp * self.pp + stage * self.tp
        return list(range(base, base + self.tp))

    def ep_ranks(self, tp_rank: int | None = None) -> list[int]:
        """Global ranks of the expert-parallel group of `tp_rank` (default: this rank's): one per EP replica."""
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return [e * self.tp + tp_rank for e in range(self.ep)]

    def cp_ranks(self, stage: int | None = None, tp_rank: int | None = None) -> list[int]:
        """Global ranks of the context-parallel group of (stage, tp_rank) (default: this rank's)."""
        stage = self.stage if stage is None else stage
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return [c * self.tp * self.pp + stage * self.tp + tp_rank for c in range(self.cp)]


def is_foreign_expert(name: str, layout: RankLayout) -> bool:
    """Whether block parameter `name` (e.g. 'ffn.experts.5.w1.weight') is a routed expert another replica holds."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "ffn" or parts[1] != "experts":
        return False
    return not layout.experts[0] <= int(parts[2]) < layout.experts[1]


def plan_layout(config: ModelConfig, tp: int, pp: int, rank: int,
                stage_layers: list[int] | None = None, cp: int = 1, ep: int = 1) -> RankLayout:
    """The layout of `rank` in a TP x PP x CP (or TP x EP) world (checked with `check_parallel_config` first)."""
    check_parallel_config(config, tp, pp, None, stage_layers, cp, ep)
    sizes = stage_layers or balanced_stages(config, pp)
    stage, tp_rank = divmod(rank % (tp * pp), tp)
    start = sum(sizes[:stage])
    kv = split_range(config.n_kv_heads, tp)[tp_rank]
    group = config.n_heads // config.n_kv_heads
    shard = -(-config.vocab_size // tp)
    vstart = min(tp_rank * shard, config.vocab_size)
    f = config.moe
    per = f.n_experts // ep
    replica = rank // (tp * pp) if ep > 1 else 0
    return RankLayout(
        rank=rank, tp=tp, pp=pp, layers=(start, start + sizes[stage]), kv_heads=kv,
        q_heads=(kv[0] * group, kv[1] * group), ff=split_range(config.d_ff, tp)[tp_rank],
        vocab=(vstart, min(vstart + shard, config.vocab_size)), vocab_shard=shard, cp=cp, ep=ep,
        experts=(replica * per, (replica + 1) * per),
        expert_ff=split_range(config.d_expert, tp)[tp_rank] if f.n_experts else (0, 0),
        shared_ff=split_range(f.d_shared, tp)[tp_rank] if f.d_shared else (0, 0),
    )


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint from its header only (no weights read; GGUF metadata is parsed)."""
    from scratchlm.model.loading import detect_format

    path = Path(path)
    kind = detect_format(path)
    if kind == "hf":  # every declared size checked against the safetensors headers (model/loading/guard.py)
        from scratchlm.model.loading.hf import checked_config

        return checked_config(path).config
    if kind == "gguf":
        from scratchlm.model.loading.gguf_file import config_from_gguf
        from scratchlm.model.loading.gguf_reader import read_gguf

        meta, tensors = read_gguf(path)
        return config_from_gguf(meta, tensors, str(path))[0]
    if kind == "llama2c":
        from scratchlm.model.loading.llama2c import read_header

        return read_header(path)[0]
    from scratchlm.model.loading.checkpoint import read_checkpoint_config

    return read_checkpoint_config(path)  # weights-only: no code in the file runs (docs/training.md)


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
