"""`model.moe.route` against HF's router modules themselves (transformers' MixtralTopKRouter, Qwen2MoeTopKRouter,
Qwen3MoeTopKRouter, DeepseekV2TopkRouter greedy and group_limited_greedy, DeepseekV3TopkRouter noaux_tc), with
random weights, exact ties (duplicated gate rows: equal logits, so equal scores) and group-limited configs: per
token, the chosen expert ids are the same set and each one's weight is equal (HF's DeepSeek routers return them in
torch.topk(sorted=False) order, ours by score; the experts' outputs are summed in expert-id order either way).
"""

from __future__ import annotations

import pytest
import torch

from scratchlm.model.config import MoEFeatures
from scratchlm.model.moe import route

D, N = 16, 64


def _hf_router(kind: str, n_experts: int, top_k: int, **kw):
    """(HF router module, our MoEFeatures) for the same routing."""
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        cfg = MixtralConfig(hidden_size=D, num_local_experts=n_experts, num_experts_per_tok=top_k)
        return MixtralTopKRouter(cfg), MoEFeatures(n_experts=n_experts, top_k=top_k, norm_topk=True)
    if kind in ("qwen2_moe", "qwen3_moe"):
        from transformers import Qwen2MoeConfig, Qwen3MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        config_cls, router_cls = ((Qwen2MoeConfig, Qwen2MoeTopKRouter) if kind == "qwen2_moe" else
                                  (Qwen3MoeConfig, Qwen3MoeTopKRouter))
        norm = kw.get("norm_topk", False)
        cfg = config_cls(hidden_size=D, num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
        return router_cls(cfg), MoEFeatures(n_experts=n_experts, top_k=top_k, norm_topk=norm)
    if kind == "deepseek_v2":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        groups, topk_groups = kw.get("groups", 1), kw.get("topk_groups", 1)
        cfg = DeepseekV2Config(hidden_size=D, num_attention_heads=4, n_routed_experts=n_experts,
                               num_experts_per_tok=top_k, n_group=groups, topk_group=topk_groups,
                               routed_scaling_factor=kw.get("scale", 1.0),
                               topk_method="group_limited_greedy" if groups > 1 else "greedy")
        return DeepseekV2TopkRouter(cfg), MoEFeatures(
            n_experts=n_experts, top_k=top_k, norm_topk=False, routed_scale=kw.get("scale", 1.0), n_groups=groups,
            topk_groups=topk_groups, group_score="max")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    groups, topk_groups = kw.get("groups", 1), kw.get("topk_groups", 1)
    cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=4, n_routed_experts=n_experts,
                           num_experts_per_tok=top_k, n_group=groups, topk_group=topk_groups,
                           routed_scaling_factor=kw.get("scale", 1.0), norm_topk_prob=kw.get("norm_topk", True))
    return DeepseekV3TopkRouter(cfg), MoEFeatures(
        n_experts=n_experts, top_k=top_k, scoring="sigmoid", norm_topk=kw.get("norm_topk", True),
        routed_scale=kw.get("scale", 1.0), n_groups=groups, topk_groups=topk_groups, group_score="top2",
        score_bias=True)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) sorted by expert id."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


CASES = [
    ("mixtral", 8, 2, {}),
    ("qwen2_moe", 8, 3, {"norm_topk": False}),
    ("qwen2_moe", 8, 3, {"norm_topk": True}),
    ("qwen3_moe", 16, 4, {"norm_topk": True}),
    ("deepseek_v2", 8, 3, {"scale": 1.0}),
    ("deepseek_v2", 16, 3, {"groups": 4, "topk_groups": 2, "scale": 16.0}),
    ("deepseek_v3", 16, 4, {"groups": 4, "topk_groups": 2, "scale": 2.5}),
    ("deepseek_v3", 16, 3, {"groups": 1, "topk_groups": 1, "norm_topk": False}),
    ("deepseek_v3", 32, 6, {"groups": 8, "topk_groups": 3, "scale": 2.5}),
]


@pytest.mark.parametrize(("kind", "n_experts", "top_k", "kw"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("ties", [False, True, "saturated"], ids=["random", "ties", "saturated"])
@torch.no_grad()
def test_route_equals_hf_router(kind, n_experts, top_k, kw, ties):
    """Same gate weights (and DeepSeek-V3's correction bias), same tokens: equal ids and weights. `ties`: every
    other expert duplicates the gate row (and bias) of the one before it, so every score is tied with another's
    exactly, inside and across groups; and some tokens are all zeros (every expert tied). `saturated`: logits so
    large that most softmax scores underflow to exactly 0 (tied with the ones group-limited routing masks out)."""
    router, features = _hf_router(kind, n_experts, top_k, **kw)
    g = torch.Generator().manual_seed(n_experts * 31 + top_k)
    weight = torch.randn(n_experts, D, generator=g)
    bias = torch.randn(n_experts, generator=g) * 0.1 if features.score_bias else None
    if ties == "saturated":
        weight *= 200.0
    elif ties:
        weight[1::2] = weight[0::2]
        if bias is not None:
            bias[1::2] = bias[0::2]
    router.weight.copy_(weight)
    if bias is not None:
        router.e_score_correction_bias.copy_(bias)
    x = torch.randn(N, D, generator=g)
    if ties is True:
        x[::7] = 0.0
    _, hf_weights, hf_ids = router(x)
    weights, ids = route(x @ weight.t(), features, bias)
    got_ids, got_w = _by_id(weights, ids)
    want_ids, want_w = _by_id(hf_weights, hf_ids)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_route_is_deterministic_under_ties():
    """All experts tied (a zero token): the choice repeats call after call and does not depend on the batch."""
    f = MoEFeatures(n_experts=8, top_k=2)
    logits = torch.zeros(5, 8)
    first = route(logits, f)[1]
    assert all(torch.equal(route(logits, f)[1], first) for _ in range(5))
    assert torch.equal(route(logits[:1], f)[1], first[:1])


@pytest.mark.parametrize("group_score", ["max", "top2"])
def test_route_takes_zero_rows(group_score: str) -> None:
    """A step where a rank has no tokens (expert parallelism's idle replica) routes zero rows, groups included."""
    f = MoEFeatures(n_experts=8, top_k=2, n_groups=4, topk_groups=2, group_score=group_score)
    weights, ids = route(torch.zeros(0, 8), f)
    assert weights.shape == ids.shape == (0, 2)
