"""The planner's counts on every family's config (`tests/model/families/tiny.py`), against the models themselves:
parameters per rank equal what `TransformerLM` builds (one rank) and what tensor parallelism's shard plan holds
(TP = 2, TP = 2 x PP = 2); sliding windows shrink the KV cache and the attention work; context parallelism is
infeasible for what it does not implement."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scratchlm.model import families
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.layout import plan_layout
from scratchlm.parallel.tensor import shard_plan
from scratchlm.plan import ClusterSpec, Layout, Workload, predict
from scratchlm.plan.cost import rank_parameters
from tests.model.families.tiny import FAMILIES, MLA_FAMILIES, MOE_FAMILIES

BIG = ClusterSpec(name="big", nodes=1, devices_per_node=4, flops=1e10, mem_bw=1e10, mem_capacity=1e12,
                  softmax_rate=1e9, intra_bw=1e9, intra_latency=1e-5, inter_bw=1e8, inter_latency=1e-4)


def _config(name: str):
    return families.config_from_hf((FAMILIES | MOE_FAMILIES | MLA_FAMILIES | {"gpt_oss": _gpt_oss})[name]().to_dict(),
                                   name)


def _held(config, tp: int, pp: int, rank: int, ep: int = 1) -> int:
    """Elements the rank's shard plan holds (every tensor's slice)."""
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in TransformerLM(config).state_dict().items()}
    total = 0
    for name, (dim, start, stop) in shard_plan(config, plan_layout(config, tp, pp, rank, ep=ep)).items():
        n = 1
        for i, size in enumerate(shapes[name]):
            n *= (stop - start) if i == dim else size
        total += n
    return total


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parameter_counts_equal_the_models(name) -> None:
    c = _config(name)
    with torch.device("meta"):
        actual = sum(p.numel() for p in TransformerLM(c).parameters())
    assert rank_parameters(c) == [actual] == [c.num_parameters()]
    w = Workload(prompt_len=32, output_len=8, concurrency=1)
    assert predict(c, w, BIG, Layout()).weights_bytes == actual * BIG.dtype_bytes
    assert rank_parameters(c, tp=2) == [_held(c, 2, 1, 0)]
    assert predict(c, w, BIG, Layout(tp=2)).weights_bytes == _held(c, 2, 1, 0) * BIG.dtype_bytes
    assert rank_parameters(c, tp=2, pp=2) == [_held(c, 2, 2, 0), _held(c, 2, 2, 2)]


def _without_window(c):
    return dataclasses.replace(c, attn=dataclasses.replace(c.attn, sliding_window=None))


def test_sliding_windows_shrink_kv_and_attention_work() -> None:
    """Every layer windowed (Mistral, window 8): the KV cache keeps the window, as the engine frees blocks; mixed
    windowed / full layers (Gemma 2, window 6 on every other layer): the whole context (one block table serves
    every layer), but the windowed layers' attention work shrinks."""
    w = Workload(prompt_len=512, output_len=64, concurrency=4)
    mistral = _config("mistral")
    a, b = predict(mistral, w, BIG, Layout()), predict(_without_window(mistral), w, BIG, Layout())
    kv_layer = 2 * mistral.n_kv_heads * mistral.head_dim * BIG.kv_dtype_bytes * 4  # per token kept, batch 4
    assert b.kv_bytes == pytest.approx(mistral.n_layers * kv_layer * (512 + 64))
    assert a.kv_bytes == pytest.approx(mistral.n_layers * kv_layer * 8)
    assert a.prefill.compute < b.prefill.compute and a.decode.total < b.decode.total
    assert a.activation_bytes < b.activation_bytes  # every layer's scores are narrowed to the window
    gemma2 = _config("gemma2")
    a, b = predict(gemma2, w, BIG, Layout()), predict(_without_window(gemma2), w, BIG, Layout())
    assert a.kv_bytes == b.kv_bytes
    assert a.prefill.compute < b.prefill.compute and a.decode.total < b.decode.total
    assert a.activation_bytes == pytest.approx(b.activation_bytes)  # a full layer's scores are still the peak


def test_context_parallel_is_infeasible_for_what_it_does_not_implement() -> None:
    p = predict(_config("gemma2"), Workload(prompt_len=512), BIG, Layout(cp=2))
    assert not p.feasible and "soft-cap" in p.reason and "sliding window" in p.reason
    assert predict(_config("llama3"), Workload(prompt_len=512), BIG, Layout(cp=2)).feasible


def _gpt_oss():
    from tests.model.families.test_gpt_oss import _hf_config

    return _hf_config()


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES | MLA_FAMILIES) + ["gpt_oss"])
def test_moe_and_mla_parameter_counts_equal_the_models(name) -> None:
    """One rank: the planner's count of `TransformerLM`'s parameters; EP = 2 and EP = 2 x TP = 2: the parameters
    each rank holds in expert parallelism's shard plan (MLA: heads split, the latent projections whole)."""
    c = _config(name)
    with torch.device("meta"):
        actual = sum(p.numel() for p in TransformerLM(c).parameters())
    assert rank_parameters(c) == [actual] == [c.num_parameters()]
    assert rank_parameters(c, ep=2) == [_held(c, 1, 1, 0, ep=2)]
    assert rank_parameters(c, tp=2, ep=2) == [_held(c, 2, 1, 0, ep=2)] == [_held(c, 2, 1, 3, ep=2)]
