"""The planner on mixture-of-experts and MLA models: expert parallelism's memory per rank, all-to-all bytes and time
against hand computation, the expected number of experts a decode step touches against a simulation of the
routing, MLA's latent KV cache, the layout search with EP, and `scratchlm plan` on DeepSeek-V3 / Kimi K2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scratchlm.cli import main
from scratchlm.model.config import MLAFeatures, ModelConfig, MoEFeatures
from scratchlm.plan import ClusterSpec, Layout, Workload, enumerate_layouts, load_cluster, plan, predict
from scratchlm.plan.cli import load_model_config
from scratchlm.plan.cost import experts_touched, rank_parameters

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = REPO / "recipes" / "clusters"

# 4 blocks, the first dense; 8 experts of width 32, top-2, a shared expert of width 16
MOE = ModelConfig(vocab_size=500, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=128, tie_embeddings=False,
                  moe=MoEFeatures(n_experts=8, top_k=2, d_expert=32, d_shared=16, dense_layers=[0]))
BOX = ClusterSpec(name="box", nodes=1, devices_per_node=4, flops=1e10, mem_bw=1e10, mem_capacity=1e9,
                  softmax_rate=1e9, intra_bw=1e9, intra_latency=1e-5, inter_bw=1e8, inter_latency=1e-4)
EXPERT = 3 * 64 * 32


def test_experts_touched_equals_a_simulated_routing() -> None:
    g = torch.Generator().manual_seed(0)
    for n_experts, k, batch in [(8, 2, 1), (8, 2, 3), (64, 6, 16), (256, 8, 32)]:
        trials = 400
        chosen = torch.rand(trials, batch, n_experts, generator=g).topk(k, dim=-1).indices  # uniform k-subsets
        distinct = torch.tensor([t.unique().numel() for t in chosen.view(trials, -1)], dtype=torch.float64)
        assert experts_touched(n_experts, k, batch) == pytest.approx(distinct.mean().item(), rel=0.03)
    assert experts_touched(8, 2, 1) == pytest.approx(2) and experts_touched(8, 2, 10_000) == pytest.approx(8)


def test_memory_per_rank_splits_the_experts_over_ep() -> None:
    total = MOE.num_parameters()
    assert rank_parameters(MOE) == [total]
    n_moe = 3
    # EP = 2 over two data-parallel replicas: each rank keeps half of every MoE block's experts, the rest whole
    assert rank_parameters(MOE, ep=2) == [total - n_moe * 4 * EXPERT]
    assert rank_parameters(MOE, ep=8) == [total - n_moe * 7 * EXPERT]
    # EP = 2 over two TP = 2 replicas: half of the experts, each at half its width
    assert rank_parameters(MOE, tp=2, ep=2) == [rank_parameters(MOE, tp=2)[0] - n_moe * 4 * EXPERT // 2]
    p = predict(MOE, Workload(32, 8, 2), BOX, Layout(dp=2, ep=2))
    assert p.feasible and p.weights_bytes == (total - n_moe * 4 * EXPERT) * 4
    # scratchlm's EP keeps the whole KV pool in each replica; a deployment may keep each replica's own sequences
    sharded = predict(MOE, Workload(32, 8, 2), BOX, Layout(dp=2, ep=2), ep_kv="sharded")
    assert p.kv_bytes == pytest.approx(2 * sharded.kv_bytes) and sharded.decode.network < p.decode.network


def test_all_to_all_bytes_and_time_against_hand_computation() -> None:
    w = Workload(prompt_len=16, output_len=4, concurrency=6)
    p = predict(MOE, w, BOX, Layout(dp=2, ep=2))
    rows, d, k, n_moe = 3, 64, 2, 3  # 3 sequences per replica
    sent = rows * k * d * 4  # bytes one rank sends in one all-to-all (half of them to itself)
    one = 1e-5 + sent / (2 * 1e9)  # (p - 1) (latency + n / (p bandwidth)) with p = 2
    assert p.decode_a2a_s == pytest.approx(n_moe * 2 * one)  # dispatch + combine in every MoE block
    counts = 1e-5 + 2 * 8 * 8 / 2e9  # the per-expert row counts all-gathered (int64) in every MoE block
    kv = 1e-5 + 2 * rows * (2 * 4 * 8 * 4) / 2e9  # every layer's new K/V rows all-gathered (4 heads of 8, fp32)
    logits = 1e-5 + rows * 500 * 4 / 1e9  # replica 1's logits to rank 0
    assert p.decode.network == pytest.approx(p.decode_a2a_s + n_moe * counts + 4 * kv + logits)
    sent_prefill = 16 * k * d * 4
    assert p.prefill_a2a_s == pytest.approx(n_moe * 2 * (1e-5 + sent_prefill / 2e9))
    # the tokens of both replicas reach each rank's experts: 6 tokens touch E (1 - (1 - k/E)^6), half on each rank
    assert p.experts_touched == pytest.approx(experts_touched(8, 2, 6) / 2)
    assert p.expert_bytes == pytest.approx(n_moe * p.experts_touched * EXPERT * 4)
    single = predict(MOE, w, BOX, Layout(dp=2))
    assert single.decode_a2a_s == 0 and single.experts_touched == pytest.approx(experts_touched(8, 2, 3))
    # across nodes: the peers on other nodes over the inter-node link (2 ranks per node, EP = 4)
    two_nodes = ClusterSpec(**{**BOX.__dict__, "nodes": 2, "devices_per_node": 2})
    p4 = predict(MOE, Workload(16, 4, 8), two_nodes, Layout(dp=4, ep=4))
    sent = 2 * k * d * 4
    inter = 2 * (1e-4 + sent / (4 * 1e8))  # two peers off the node
    assert p4.decode_a2a_s == pytest.approx(n_moe * 2 * inter)


def test_decode_streams_only_the_touched_experts() -> None:
    """Batch 1: the top_k experts of each MoE block, not all of them, as the step's routed-expert weight traffic;
    more sequences touch more experts (the step's expert bytes grow toward all of them)."""
    one = predict(MOE, Workload(16, 4, 1), BOX, Layout())
    assert one.experts_touched == pytest.approx(2) and one.expert_bytes == pytest.approx(3 * 2 * EXPERT * 4)
    many = predict(MOE, Workload(16, 4, 64), BOX, Layout())
    assert many.experts_touched == pytest.approx(8, rel=1e-3)
    dense_equivalent = ModelConfig(**{**MOE.__dict__, "moe": MoEFeatures()})  # d_ff 128 everywhere
    assert one.decode.memory < predict(dense_equivalent, Workload(16, 4, 1), BOX, Layout()).decode.memory * 2


def test_ep_layouts_and_what_makes_them_infeasible() -> None:
    lays = enumerate_layouts(4, n_experts=8)
    assert Layout(dp=4, ep=4) in lays and Layout(dp=2, tp=2, ep=2) in lays and Layout(dp=4, ep=2) in lays
    assert all(lay.dp % lay.ep == 0 and (lay.ep == 1 or lay.pp == lay.cp == 1) for lay in lays)
    assert len([lay for lay in enumerate_layouts(4) if lay.ep > 1]) == 0  # a dense model: no EP
    w = Workload(16, 4, 4)
    assert "divide the 8 experts" in predict(MOE, w, BOX, Layout(dp=3, ep=3)).reason
    dense = ModelConfig(vocab_size=500, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4)
    assert "mixture-of-experts" in predict(dense, w, BOX, Layout(dp=2, ep=2)).reason
    assert "pipeline" in predict(MOE, w, BOX, Layout(pp=2, dp=2, ep=2)).reason
    assert "must divide DP=2" in predict(MOE, w, BOX, Layout(dp=2, tp=2, ep=4)).reason


def test_mla_keeps_one_latent_per_token_on_every_tp_rank() -> None:
    c = ModelConfig(vocab_size=500, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8,
                    mla=MLAFeatures(kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                    v_head_dim=8))
    w = Workload(prompt_len=100, output_len=28, concurrency=2)
    latent = 2 * 128 * 2 * (24 + 8) * 4  # batch 2, 128 tokens, 2 layers, latent + RoPE key, float32
    assert predict(c, w, BOX, Layout()).kv_bytes == pytest.approx(latent)
    assert predict(c, w, BOX, Layout(tp=4)).kv_bytes == pytest.approx(latent)  # not split by head
    assert predict(c, w, BOX, Layout(tp=4)).feasible  # TP splits MLA by query head (8 of them)
    assert predict(c, w, BOX, Layout(tp=2)).weights_bytes < predict(c, w, BOX, Layout()).weights_bytes
    assert not predict(c, w, BOX, Layout(tp=2)).note  # scratchlm runs it (parallel/tensor.py shards MLA)


@pytest.mark.parametrize("name, total, active", [("deepseek-v3", 671.03e9, 37.55e9), ("kimi-k2", 1026.41e9, 32.86e9)])
def test_shipped_moe_shapes(name, total, active) -> None:
    c = load_model_config(str(CLUSTERS / "models" / f"{name}.toml"))
    assert c.num_parameters() == pytest.approx(total, rel=1e-3)
    assert c.active_parameters() == pytest.approx(active, rel=1e-3)


def test_deepseek_v3_needs_expert_parallelism_on_two_fp8_nodes() -> None:
    c = load_model_config(str(CLUSTERS / "models" / "deepseek-v3.toml"))
    cluster = load_cluster(CLUSTERS / "h100x8_ib_fp8.toml")
    cluster.nodes = 2
    ranked = plan(c, Workload(prompt_len=1024, output_len=256, concurrency=128), cluster)
    best = ranked[0]
    assert best.feasible and best.layout.ep > 1 and best.decode_a2a_s > 0
    cluster.nodes = 1
    assert not plan(c, Workload(prompt_len=1024, output_len=256, concurrency=128), cluster)[0].feasible  # 671 GB


def test_plan_command_on_a_moe_model(capsys) -> None:
    rc = main(["plan", "--model", "kimi-k2", "--cluster", "h100x8_ib_fp8", "--nodes", "4", "--concurrency", "256",
               "--top", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1026.41B parameters, 32.86B active per token" in out and "MLA latent" in out
    assert "a2a dec" in out and "xEP" in out and "4 node(s)" in out


def test_moe_overheads_enter_prefill_and_decode() -> None:
    """The routing's fixed cost per MoE block and the cost per expert run, in both phases."""
    w = Workload(prompt_len=16, output_len=4, concurrency=1)
    slow = ClusterSpec(**{**BOX.__dict__, "moe_overhead": 1e-3, "expert_overhead": 1e-4})
    a, b = predict(MOE, w, BOX, Layout()), predict(MOE, w, slow, Layout())
    assert b.decode.overhead - a.decode.overhead == pytest.approx(3 * (1e-3 + 2 * 1e-4))  # top_k experts at batch 1
    touched = experts_touched(8, 2, 16)
    assert b.prefill.overhead - a.prefill.overhead == pytest.approx(3 * (1e-3 + touched * 1e-4))


def test_plan_reads_an_hf_config_json(tmp_path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_experts=8, num_experts_per_tok=2)
    path = tmp_path / "config.json"
    path.write_text(hf.to_json_string())
    c = load_model_config(str(path))
    assert c.moe.n_experts == 8 and c.d_expert == 24
    with torch.device("meta"):
        assert c.num_parameters() == sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf)
                                         .parameters())
    assert main(["plan", "--model", str(path), "--cluster", "h100x8_ib", "--concurrency", "16", "--top", "3"]) == 0
    assert "top-2" in capsys.readouterr().out
