"""The model runner: one forward per step over a flattened, unpadded batch with explicit metadata.

`ModelInput` is plain Python data (lists of ints), built by the engine from the scheduler's plan,
so a runner could live in another process (the parallelism work ships it over a pipe). The runner
turns it into tensors, copies forked blocks, runs the model once with the paged-attention backend
and returns logits only for the positions that are sampled, and those of the prompt chunks whose prompt
logprobs are asked for (`ModelInput.logits_indices`: vocab x rows, only the rows that need them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.engine_ops import RowPagedAttention, use_engine_ops
from scratchlm.inference.fast_linear import PanelEmbedding, PanelLinear, SkinnyLinear, skinny_linear, use_skinny_linears
from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.scheduler import SchedulerOutput
from scratchlm.model.moe import MoE
from scratchlm.model.transformer import TransformerLM

log = logging.getLogger("scratchlm.inference.runner")


@dataclass
class ModelInput:
    """Everything one forward needs. Rows: decode tokens first, then prefill chunks."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decode_tokens: int
    decode_block_tables: list[list[int]]
    decode_context_lens: list[int]
    prefills: list[tuple[int, int, int, list[int]]]  # (query_start, query_len, context_len, block_table)
    logits_indices: list[int]  # rows whose logits are returned, in order
    block_copies: list[tuple[int, int]] = field(default_factory=list)


def build_model_input(plan: SchedulerOutput, block_size: int) -> tuple[ModelInput, list[int]]:
    """The runner input of a plan, and for each scheduled entry its first logits row (-1 if it has none).

    An entry's logits rows are its `num_prompt_logits` first positions (prompt logprobs: every position of a prefill
    chunk that scores a prompt token), then, when it samples, its last `num_logits` positions (1; k + 1 for a
    speculative verify); so the sampled row of an entry is its first row + `num_prompt_logits`."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    prefills: list[tuple[int, int, int, list[int]]] = []
    logits_indices: list[int] = []
    # Decodes (one new token) first, then chunks: the attention backend relies on this order.
    order = sorted(range(len(plan.scheduled)), key=lambda i: plan.scheduled[i].num_new_tokens != 1)
    row_of = [-1] * len(plan.scheduled)
    num_decode = 0
    for i in order:
        s = plan.scheduled[i]
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        table = seq.block_table
        q_start = len(token_ids)
        token_ids.extend(seq.token_ids[start : start + n])
        positions.extend(range(start, start + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if n == 1:
            num_decode += 1
            dec_tables.append(table)
            dec_lens.append(start + 1)
        else:
            prefills.append((q_start, n, start + n, list(table)))
        first = len(logits_indices)
        logits_indices.extend(range(q_start, q_start + s.num_prompt_logits))  # prompt logprobs: positions in order
        if s.samples:  # its num_logits last rows (speculative verify: k + 1)
            logits_indices.extend(range(len(token_ids) - s.num_logits, len(token_ids)))
        if len(logits_indices) > first:
            row_of[i] = first
    width = max((len(t) for t in dec_tables), default=0)
    dec_tables = [t + [0] * (width - len(t)) for t in dec_tables]
    inp = ModelInput(token_ids, positions, slots, num_decode, dec_tables, dec_lens, prefills, logits_indices,
                     list(plan.block_copies))
    return inp, row_of


# Prefill chunks whose context (cached prefix + chunk) is at most this long run in the fused C++ step (each row one
# query of the paged attention kernel, a chunk's rows in tiles); None: every chunk, however long its context.
# Longer ones take the Python path, whose attention is torch SDPA. Since the tiles (csrc/paged_attention.h) the
# fused step is the faster one at every length measured (benchmarks/prefill_attention.py --engine, SmolLM2-135M,
# one core: 1024-, 2048- and 4000-token prompts), so there is no limit; the benchmark sets 512, the limit of
# before, for its side-by-side.
FUSED_PREFILL_MAX_CONTEXT: int | None = None


def _short_contexts(inp: ModelInput) -> bool:
    """Whether every prefill chunk's context is at most FUSED_PREFILL_MAX_CONTEXT (what the fused step runs)."""
    limit = FUSED_PREFILL_MAX_CONTEXT
    return limit is None or all(cl <= limit for _, _, cl, _ in inp.prefills)


class ModelRunner:
    """Holds the model and its KV cache; `execute(ModelInput)` -> logits (len(logits_indices), vocab)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        use_skinny_linears(model)  # fp32 linears as panels (one copy) through the C++ panel kernel
        if cache.k.device.type == "cpu":  # the unfused path runs the fused step's row ops (engine_ops.py)
            use_engine_ops(model)
        self._plain_lm = type(model) is TransformerLM  # its tied/untied head also goes through the kernel
        self.fused_decoder = fused_decoder_for(model, cache)  # every layer of a step in one C++ call

    def _runs_fused(self, inp: ModelInput) -> bool:
        """Whether the fused C++ step runs `inp`: decode rows, and prefill chunks of short enough context."""
        return self.fused_decoder is not None and _short_contexts(inp)

    def _row_tables(self, inp: ModelInput, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A block table and a context length for every row of the step, (N, max_blocks) and (N,): a decode row
        attends to its whole context, row j of a prefill chunk to the tokens up to its own (causal)."""
        if not inp.prefills:
            return meta.decode_block_tables, meta.decode_context_lens
        width = max([len(t) for t in inp.decode_block_tables] + [len(bt) for _, _, _, bt in inp.prefills])
        tables = torch.zeros(len(inp.token_ids), width, dtype=torch.long)
        lens = torch.empty(len(inp.token_ids), dtype=torch.long)
        nd = inp.num_decode_tokens
        if nd:
            tables[:nd, : len(inp.decode_block_tables[0])] = torch.tensor(inp.decode_block_tables)
            lens[:nd] = torch.tensor(inp.decode_context_lens)
        for qs, ql, cl, bt in inp.prefills:
            tables[qs : qs + ql, : len(bt)] = torch.tensor(bt)
            torch.arange(cl - ql + 1, cl + 1, out=lens[qs : qs + ql])
        return tables.to(self.device), lens.to(self.device)

    def _rope_lengths(self, inp: ModelInput) -> torch.Tensor | None:
        """Each row's sequence length in this step (a decode row: its context; a prefill chunk's rows: the chunk's
        context), for RoPE scalings that depend on it (dynamic NTK, LongRoPE: `RotaryEmbedding.cos_sin` then
        computes each row's frequencies from its own sequence, as HF does for that sequence alone); None for the
        others. The fused and the Python step both use it."""
        ropes = (getattr(self.model, "rope", None), getattr(self.model, "local_rope", None))
        if not any(getattr(r, "length_dependent", False) for r in ropes):
            return None
        lengths = list(inp.decode_context_lens)
        for _, ql, cl, _ in inp.prefills:
            lengths += [cl] * ql
        return self._tensor(lengths)

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        self.cache.copy_blocks(inp.block_copies)
        if not inp.token_ids:
            return torch.empty(0, 0, device=self.device)
        nd = inp.num_decode_tokens
        meta = AttentionMetadata(
            slot_mapping=self._tensor(inp.slot_mapping),
            num_decode_tokens=nd,
            decode_block_tables=self._tensor(inp.decode_block_tables) if nd else None,
            decode_context_lens=self._tensor(inp.decode_context_lens) if nd else None,
            prefills=[PrefillChunk(qs, ql, cl, self._tensor(bt)) for qs, ql, cl, bt in inp.prefills],
        )
        tokens = self._tensor(inp.token_ids)[None, :]  # (1, N)
        positions = self._tensor(inp.positions)  # (N,)
        index = self._tensor(inp.logits_indices)
        if self._runs_fused(inp):
            x = self.model.embed(tokens[0], positions)  # (N, d): embedding scale and learned positions included
            lengths = self._rope_lengths(inp)
            cos, sin = self.model.rope.cos_sin(positions, x.dtype, lengths)  # (N, 1, R/2) each
            cos, sin = cos[:, 0], sin[:, 0]  # (N, R/2)
            local = getattr(self.model, "local_rope", None)
            cos2 = sin2 = None
            if local is not None:
                cos2, sin2 = (t[:, 0] for t in local.cos_sin(positions, x.dtype, lengths))  # (N, R/2) each
            tables, lens = self._row_tables(inp, meta)
            c = self.cache
            h = self.fused_decoder.forward(x, c.k, c.v, meta.slot_mapping, cos, sin, tables, lens, c.k_scale,
                                           c.v_scale, cos2, sin2)  # (N, d)
            return self.model.finish_logits(self._logits(self.model.norm(h.index_select(0, index))))
        if _short_contexts(inp) and self.cache.k.device.type == "cpu":  # the fused step's attention, row by row
            attn = RowPagedAttention(self.cache, meta, *self._row_tables(inp, meta))
        else:
            attn = PagedAttention(self.cache, meta)
        if not self._plain_lm:
            return self.model(tokens, positions, attn=attn, logits_index=index, rope_lengths=self._rope_lengths(inp))
        h = self.model.hidden_states(tokens, positions, attn, self._rope_lengths(inp))  # (1, N, d)
        h = self.model.norm(h.reshape(-1, h.shape[-1]).index_select(0, index))  # (len(index), d)
        return self.model.finish_logits(self._logits(h))  # (len(index), vocab)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """(rows, d) normed hidden states -> (rows, vocab): a quantized head through its kernel, else skinny GEMM."""
        head = getattr(self.model, "output_head", None)
        if head is not None:
            return head(h)
        lm_head = getattr(self.model, "lm_head", None)
        if isinstance(lm_head, PanelLinear):
            return lm_head(h)
        emb = getattr(self.model, "tok_embeddings", None)
        if lm_head is None and isinstance(emb, PanelEmbedding):  # tied: the table's panels
            return emb.head(h)
        return skinny_linear(h, self.model.output_weight)


def _linear_tensors(m: torch.nn.Module | None) -> tuple[list[torch.Tensor], int] | None:
    """A linear layer as the fused step takes it: ([panels], 0) for a PanelLinear, ([weight], 0) for a float32
    SkinnyLinear, ([qweight, scales (, mins)], group size) for a CPU QuantLinear the integer kernels take,
    ([qweight], -ggml type id) for a CPU QuantLinear holding a GGUF weight raw (csrc/qlinear.h), ([], 0) for an
    absent one (the up projection of a plain MLP); None otherwise."""
    if m is None:
        return [], 0
    if type(m) is PanelLinear:
        return ([m.panels], 0) if m.panels.is_contiguous() else None
    if type(m) is SkinnyLinear:
        w = m.weight.detach()
        ok = w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
        return ([w], 0) if ok else None
    from scratchlm.inference.quantization.kernels import int8_takes
    from scratchlm.inference.quantization.modules import QuantLinear

    if type(m) is not QuantLinear or m.qweight.device.type != "cpu":
        return None
    if m.fmt.raw:
        from scratchlm.inference.quantization.scheme import GGUF_RAW_TYPES

        return ([m.qweight], -GGUF_RAW_TYPES[m.fmt.gguf_type][0]) if m.qweight.is_contiguous() else None
    if m.fmt.bits == 8 and not int8_takes(m.d_in, m.group_size):
        return None
    ts = [m.qweight, m.scales] + ([] if m.mins is None else [m.mins])
    if not all(t.is_contiguous() for t in ts):
        return None
    return ts, m.group_size


def fused_step_unsupported(config) -> list[str]:
    """The model features the C++ fused step (csrc/decoder.h) does not implement; empty when it runs the model.
    A model with any of them takes the Python step (the same paged-attention kernels, one layer op at a time).

    The fused step implements every feature of `ModelConfig`'s block (`_layer_features` hands them over per
    layer); the embedding (scale, learned positions), the final norm, logit scale and final soft-cap stay in
    Python around it (`TransformerLM.embed` / `finish_logits`), and sequence-length dependent RoPE (dynamic,
    LongRoPE) gets per-row cos/sin tables (`ModelRunner._rope_lengths`). What is left: an odd head dim or an odd
    number of rotated dims (without RoPE too: the kernel's cos/sin tables are R/2 wide), and gpt-oss's features
    (attention sinks, the clamped SwiGLU, expert biases, its router). The mixture-of-experts feed-forward runs there
    too (csrc/moe.h, `_moe_layer`)."""
    missing = []
    if config.mla.kv_lora_rank:
        missing.append("multi-head latent attention")
    if config.attn.sinks:
        missing.append("attention sinks (attn.sinks)")
    m, e = config.mlp, config.moe
    if m.swiglu_limit is not None or m.swiglu_alpha != 1.0:
        missing.append("gpt-oss's clamped SwiGLU (mlp.swiglu_alpha / swiglu_limit)")
    if e.n_experts and m.bias:
        missing.append("MoE experts with biases (mlp.bias)")
    if e.n_experts and e.scoring == "topk_softmax":
        missing.append("the top-k-then-softmax router (moe.scoring='topk_softmax')")
    if e.n_experts and e.router_bias:
        missing.append("a router bias (moe.router_bias)")
    if config.head_dim % 2 or config.rotary_dim % 2:
        missing.append(f"an odd head dim or rotary dims ({config.head_dim}, {config.rotary_dim})")
    return missing


_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # decoder.h's Act


def _layer_features(model: torch.nn.Module, i: int) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """Layer i's norms, biases and features as decoder.h's FusedDecoder takes them (its `tensors` and `values`
    maps; see the constructor there), read off the block's modules and the config; None when a tensor is not a
    contiguous float32 CPU tensor."""
    c, block = model.config, model.layers[i]
    a, f = block.attn, block.ffn
    tensors: dict[str, torch.Tensor | None] = {}
    for key, norm in (("attn_norm", block.attn_norm), ("attn_post_norm", block.attn_post_norm),
                      ("ffn_norm", block.ffn_norm), ("ffn_post_norm", block.ffn_post_norm)):
        if norm is not None:
            tensors[key] = norm.weight
            tensors[key + "_b"] = getattr(norm, "bias", None)  # LayerNorm's (None: without bias)
    tensors |= {"bq": a.q_bias, "bk": a.k_bias, "bv": a.v_bias, "bo": a.o_bias}
    tensors |= {k: getattr(f, k, None) for k in ("b1", "b2", "b3")}  # an MoE's experts have none
    if a.q_norm is not None:
        tensors |= {"q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}
    tensors = {k: t.detach() for k, t in tensors.items() if t is not None}
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        return None
    rope = model.layer_rope(i)
    spec = a.spec
    values = {
        "scale": spec.scale,
        "softcap": spec.softcap or 0.0,
        "window": spec.window or 0,
        "rope": -1 if rope is None or rope.layout == "none" else 0 if rope is model.rope else 1,
        "rotary_dim": c.rotary_dim,
        "act": _ACTS[f.act],
        "gated": float(getattr(f, "gated", True)),  # MoE experts are gated
        "layer_norm": float(c.norm.kind == "layer"),
        "residual_multiplier": block.residual_multiplier,
    }
    return tensors, values


_SCORING = {"softmax": 0, "sigmoid": 1}
_GROUP_SCORE = {"max": 0, "top2": 1}


def _moe_layer(ext, moe: MoE, config):
    """An `MoE` feed-forward as csrc/moe.h's `MoELayer` (over its weights, no copies), or None when a linear is in
    a form the fused step does not take or the router is not float32 (`_linear_tensors`)."""
    f = moe.features
    gate = _linear_tensors(moe.gate)
    experts = [[_linear_tensors(m) for m in (e.w1, e.w2, e.w3)] for e in moe.experts]
    shared = [_linear_tensors(m) for m in (moe.shared.w1, moe.shared.w2, moe.shared.w3)] if moe.shared else []
    shared_gate = _linear_tensors(moe.shared_gate) if moe.shared_gate is not None else ([], 0)
    lins = [gate, shared_gate, *shared] + [t for e in experts for t in e]
    if any(t is None for t in lins) or gate[1] != 0 or shared_gate[1] != 0:
        return None
    bias = moe.score_bias.detach() if moe.score_bias is not None else None
    values = {"n_experts": f.n_experts, "top_k": f.top_k, "d_model": config.d_model, "d_expert": config.d_expert,
              "d_shared": f.d_shared if moe.shared else 0, "scoring": _SCORING[f.scoring],
              "norm_topk": float(f.norm_topk), "routed_scale": f.routed_scale, "n_groups": f.n_groups,
              "topk_groups": f.topk_groups, "group_score": _GROUP_SCORE[f.group_score], "act": _ACTS[moe.act]}
    return ext.MoELayer(gate[0], 0, [[t for t, _ in e] for e in experts], [[g for _, g in e] for e in experts],
                        [t for t, _ in shared], [g for _, g in shared], shared_gate[0], bias, values)


def fused_decoder_for(model: torch.nn.Module, cache: KVCache):
    """The C++ `FusedDecoder` (every layer of a step in one call) over `model`'s weights (no copies), or None
    where it does not apply: a model that is not a plain or quantized `TransformerLM`, features the fused step
    does not implement (`fused_step_unsupported`), layers the kernels do not take, a non-CPU device, no built
    kernels. The cache may be float32, bf16, fp16 or int8 (kv_cache.py). Logs (INFO) which decode path the
    model takes and why."""
    plain = type(model) is TransformerLM
    if not plain and type(model).__name__ != "QuantizedTransformerLM":
        log.info("decode path: the Python step (layer by layer): the fused C++ step takes TransformerLM models, "
                 "not %s", type(model).__name__)
        return None
    if cache.k.device.type != "cpu":
        log.info("decode path: the Python step (layer by layer): the fused C++ step runs on the CPU, the cache is "
                 "on %s", cache.k.device)
        return None
    missing = fused_step_unsupported(model.config)
    if missing:
        log.info("decode path: the Python step (layer by layer); the fused C++ step does not implement: %s",
                 "; ".join(missing))
        return None
    ext = load_engine_kernels()
    if ext is None:
        log.info("decode path: the Python step (layer by layer): the C++ kernels are not built")
        return None
    linears, group_sizes, tensors, values, moe = [], [], [], [], {}
    for i, block in enumerate(model.layers):
        a, f = block.attn, block.ffn
        mlp = (None, None, None) if isinstance(f, MoE) else (f.w1, f.w2, f.w3)  # an MoE layer's: moe[i]
        lin = [_linear_tensors(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, *mlp)]
        feats = _layer_features(model, i)
        if isinstance(f, MoE):
            moe[i] = _moe_layer(ext, f, model.config)
            if moe[i] is None:
                log.info("decode path: the Python step (layer by layer): layer %d's experts or router have weights "
                         "the fused C++ step does not take", i)
                return None
        if any(t is None for t in lin) or feats is None:  # e.g. int8 groups of 16, another layer type, bf16
            log.info("decode path: the Python step (layer by layer): layer %d has weights the fused C++ step does "
                     "not take (%s)", i, "linears" if feats is not None else "norms or biases not float32")
            return None
        linears.append([t for t, _ in lin])
        group_sizes.append([g for _, g in lin])
        tensors.append(feats[0])
        values.append(feats[1])
    if not linears:
        return None
    c = model.config
    fused = ext.FusedDecoder([[] for _ in linears], c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps,
                             c.rope_layout == "half", True, linears, group_sizes, tensors, values, moe)
    features = c.features()
    log.info("decode path: the fused C++ step (every layer in one call)%s",
             f"; block features: {', '.join(features)}" if features else " (the Llama block)")
    return fused
