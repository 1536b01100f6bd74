"""The planner's cost model against hand-computed figures, its layouts and ranking, the cluster files
and the `scratchlm plan` command."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scratchlm.cli import main
from scratchlm.model.config import ModelConfig
from scratchlm.plan import ClusterSpec, Layout, Workload, enumerate_layouts, load_cluster, plan, predict
from scratchlm.plan.cluster import cluster_to_toml
from scratchlm.plan.cost import ring_score_elements

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = REPO / "recipes" / "clusters"

TINY = ModelConfig(vocab_size=1000, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=256, max_seq_len=4096)
BOX = ClusterSpec(name="box", nodes=1, devices_per_node=4, flops=1e10, mem_bw=1e10, mem_capacity=1e9,
                  softmax_rate=1e9, intra_bw=1e9, intra_latency=1e-5, inter_bw=1e8, inter_latency=1e-4)


def test_single_rank_prediction_matches_hand_computation():
    w = Workload(prompt_len=256, output_len=16, concurrency=2)
    p = predict(TINY, w, BOX, Layout())
    c = TINY
    layer = c.d_model * c.head_dim * (2 * 8 + 2 * 4) + 3 * c.d_model * c.d_ff + 2 * c.d_model
    assert p.weights_bytes == pytest.approx((4 * layer + 1000 * 64) * 4)  # tied head: one copy
    assert p.kv_bytes == pytest.approx(2 * (256 + 16) * 2 * 4 * 4 * 8 * 4)  # batch 2, K+V, 4 layers, 4 heads, D 8
    gemm = 2 * 256 * 4 * layer + 2 * 64 * 1000
    score = 8 * 256 * 256  # one rank computes the full square
    compute = (gemm + 4 * score * 8 * 4) / 1e10 + 4 * score / 1e9 + 4 * 256 * (6 * 64 + 4 * 256) * 12 / 1e10
    assert p.prefill.compute == pytest.approx(compute)
    assert p.prefill.network == 0 and p.decode.network == 0
    assert p.feasible and p.throughput == pytest.approx(2 * 16 / p.total_s)
    slow = ClusterSpec(**{**BOX.__dict__, "layer_overhead": 1e-3})
    assert predict(TINY, w, slow, Layout()).decode.total == pytest.approx(p.decode.total + 4e-3)


def test_splitting_divides_memory_and_adds_communication():
    w = Workload(prompt_len=1024, output_len=32, concurrency=1)
    one = predict(TINY, w, BOX, Layout())
    cp2 = predict(TINY, w, BOX, Layout(cp=2))
    tp2 = predict(TINY, w, BOX, Layout(tp=2))
    assert cp2.kv_bytes == pytest.approx(one.kv_bytes / 2)
    assert cp2.activation_bytes < one.activation_bytes / 2  # attention scores fall as 1/P^2
    assert cp2.prefill.overlapped_network > 0 and one.prefill.overlapped_network == 0
    assert tp2.weights_bytes < 0.6 * one.weights_bytes
    assert tp2.prefill.network > 0 and tp2.decode.network > 0
    assert cp2.prefill.compute < one.prefill.compute


def test_ring_score_elements_counts_the_chunk_pairs():
    t = 64
    for cp in (2, 4, 8):
        c = t // (2 * cp)
        chunks = 2 * cp
        pairs = chunks + chunks * (chunks - 1) // 2  # diagonal + strictly lower chunk pairs
        assert ring_score_elements(t, cp) == pytest.approx(pairs * c * c / cp)
    assert ring_score_elements(t, 1) == t * t


def test_layouts_cover_every_factorisation_and_infeasible_ones_explain_why():
    lays = enumerate_layouts(8)
    assert all(lay.world == 8 for lay in lays)
    assert len(set(lays)) == len(lays) == 20  # ordered factorisations of 2^3 into 4 factors
    p = predict(TINY, Workload(concurrency=1), BOX, Layout(tp=8))
    assert not p.feasible and "KV heads" in p.reason
    big = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=11008)
    p = predict(big, Workload(concurrency=1), BOX, Layout())
    assert not p.feasible and "GiB per rank" in p.reason


def test_ranking_prefers_replicas_for_short_prompts_and_context_parallel_for_ttft():
    short = plan(TINY, Workload(prompt_len=64, output_len=64, concurrency=4), BOX)
    assert short[0].layout == Layout(dp=4)  # no communication at all
    long = plan(TINY, Workload(prompt_len=4096, output_len=4, concurrency=1), BOX, objective="ttft")
    assert long[0].feasible and long[0].layout.cp > 1
    with pytest.raises(ValueError, match="objective"):
        plan(TINY, Workload(), BOX, objective="cost")
    with pytest.raises(ValueError, match="4 devices"):
        plan(TINY, Workload(), BOX, world=16)


def test_network_overtakes_compute_on_a_slow_link():
    w = Workload(prompt_len=256, output_len=64, concurrency=1)
    slow = ClusterSpec(**{**BOX.__dict__, "intra_bw": 1e6, "intra_latency": 1e-2})
    assert predict(TINY, w, slow, Layout(tp=4)).bottleneck == "network"
    assert predict(TINY, w, BOX, Layout(tp=1, dp=1)).bottleneck != "network"


@pytest.mark.parametrize("name", ["cpu16_25gbe.toml", "h100x8_nvlink.toml", "gpu1000_ib.toml"])
def test_cluster_files_load(name):
    spec = load_cluster(CLUSTERS / name)
    assert spec.devices >= 8 and spec.flops > 0


def test_cluster_toml_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(cluster_to_toml(BOX, "comment"))
    back = load_cluster(path)
    for f in ("nodes", "devices_per_node", "flops", "mem_bw", "intra_latency", "softmax_rate"):
        assert math.isclose(getattr(back, f), getattr(BOX, f), rel_tol=1e-3)
    with pytest.raises(ValueError, match="flops"):
        ClusterSpec(flops=0)
    with pytest.raises(ValueError, match="prompt_len"):
        Workload(prompt_len=0)


def test_plan_command(capsys, tmp_path):
    rc = main(["plan", "--model", str(CLUSTERS / "models" / "llama3-70b.toml"), "--cluster",
               str(CLUSTERS / "h100x8_nvlink.toml"), "--prompt-len", "4096", "--output-len", "256",
               "--concurrency", "64", "--top", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Best for throughput" in out and "DP" in out and "bottleneck" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = 1\nflopz = 3\n")
    rc = main(["plan", "--model", str(CLUSTERS / "models" / "llama3-8b.toml"), "--cluster", str(bad)])
    assert rc == 2 and "flopz" in capsys.readouterr().err


def test_calibration_measures_positive_figures():
    from scratchlm.plan.calibrate import measure_gemm, measure_gemv, measure_layer_overhead, measure_softmax_rate

    assert 0 < measure_layer_overhead(layers=2) < 1
    f = measure_gemm(256)
    assert f > 1e6  # loose: the machine is shared, figures swing several-fold
    assert measure_gemv(256, 128, total_bytes=4e6) > 1e6
    assert measure_softmax_rate(f, t=128) > 1e3


@pytest.mark.slow
def test_calibration_network():
    from scratchlm.plan.calibrate import measure_allreduce

    lat, bw = measure_allreduce(large=2**20, repeats=5)
    assert 0 < lat < 0.1 and bw > 1e6
