"""Pipeline parallelism: layers split into P stages, several micro-batches in flight per step.

The engine's step is one batch of disjoint sequences (decode tokens first, then prefill chunks).
`split_model_input` cuts it into M disjoint micro-batches (whole sequences, balanced by token
count). Stage s runs micro-batch m as soon as it has received m's activations from stage s-1, and
sends its output on with a non-blocking send, so while stage 1 computes micro-batch 0, stage 0
already computes micro-batch 1: with P stages and M micro-batches a step takes about
(M + P - 1) / M stage-times of one micro-batch instead of P (the bubble is (P - 1) / (M + P - 1)).
A single sequence cannot be split this way: with one running request the pipeline has no overlap.

Stage sizes are balanced by parameter count (`layout.balanced_stages`) or given explicitly
(`EngineConfig.pipeline_stage_layers`, e.g. "3,2").
"""

from __future__ import annotations

from scratchlm.inference.runner import ModelInput
from scratchlm.parallel.layout import balanced_stages, parse_stage_layers

__all__ = ["balanced_stages", "parse_stage_layers", "split_model_input"]


def split_model_input(inp: ModelInput, num_microbatches: int) -> list[tuple[ModelInput, list[int]]]:
    """Cut `inp` into at most `num_microbatches` disjoint micro-batches of whole sequences.

    Returns [(sub-input, positions in `inp.logits_indices` of its logits rows, in order)].
    Block copies go with the first micro-batch (every stage runs it first).
    """
    nd = inp.num_decode_tokens
    # items: (rows start, rows stop, decode index or -1, prefill index or -1)
    items = [(i, i + 1, i, -1) for i in range(nd)]
    items += [(qs, qs + ql, -1, j) for j, (qs, ql, _, _) in enumerate(inp.prefills)]
    m = max(1, min(num_microbatches, len(items)))
    if m == 1:
        return [(inp, list(range(len(inp.logits_indices))))]
    # Longest-first onto the lightest micro-batch, then each micro-batch in its original order.
    loads = [0] * m
    groups: list[list[int]] = [[] for _ in range(m)]
    for k in sorted(range(len(items)), key=lambda k: items[k][0] - items[k][1]):
        g = loads.index(min(loads))
        groups[g].append(k)
        loads[g] += items[k][1] - items[k][0]
    where = {row: pos for pos, row in enumerate(inp.logits_indices)}
    out = []
    for g, ks in enumerate(groups):
        ks.sort()
        sub = ModelInput([], [], [], 0, [], [], [], [], list(inp.block_copies) if g == 0 else [])
        positions = []
        for k in ks:
            start, stop, di, pj = items[k]
            q_start = len(sub.token_ids)
            sub.token_ids += inp.token_ids[start:stop]
            sub.positions += inp.positions[start:stop]
            sub.slot_mapping += inp.slot_mapping[start:stop]
            if di >= 0:
                sub.num_decode_tokens += 1
                sub.decode_block_tables.append(inp.decode_block_tables[di])
                sub.decode_context_lens.append(inp.decode_context_lens[di])
            else:
                _, ql, cl, table = inp.prefills[pj]
                sub.prefills.append((q_start, ql, cl, table))
            for row in range(start, stop):  # its sampled row, or every row of a prompt-logprobs chunk
                if row in where:
                    sub.logits_indices.append(q_start + row - start)
                    positions.append(where[row])
        out.append((sub, positions))
    return out
