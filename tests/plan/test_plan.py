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
    lin = c.d_model * c.head_dim * (2 * 8 + 2 * 4) + 3 * c.d_model * c.d_ff  # linear weights of one layer
    layer = lin + 2 * c.d_model
    assert p.weights_bytes == pytest.approx((4 * layer + 1000 * 64 + 64) * 4)  # tied head: one copy; final norm
    assert p.kv_bytes == pytest.approx(2 * (256 + 16) * 2 * 4 * 4 * 8 * 4)  # batch 2, K+V, 4 layers, 4 heads, D 8
    # Prefill, op by op, each at the larger of its compute and memory times (no measured curve: roofline).
    score = 8 * 256 * 256  # one rank computes the full square
    ew = 4 * 64 + (8 + 4) * 8 + 256  # norms + adds, RoPE on q and k, SiLU x up
    compute = 2 * 256 * 4 * lin / 1e10 + (4 * score * 8 * 4 / 1e10 + 4 * score / 1e9)
    memory = 1000 * 64 * 4 / 1e10 + 4 * 256 * ew / (1e10 / 12)  # the last token's logits (a GEMV), elementwise
    assert p.prefill.compute == pytest.approx(compute)
    assert p.prefill.memory == pytest.approx(memory)
    assert p.prefill.total == pytest.approx(compute + memory)
    # Decode: 2 rows per linear (compute-bound at 2 FLOPs per byte here), KV read, elementwise.
    s_avg = 256 + 8
    dec_compute = 2 * 2 * (4 * lin + 1000 * 64) / 1e10 + 4 * 2 * s_avg * 8 * (4 * 8 / 1e10 + 1 / 1e9)
    dec_memory = 4 * 2 * ew / (1e10 / 12)
    assert p.decode.compute == pytest.approx(dec_compute)
    assert p.decode.memory == pytest.approx(dec_memory)
    assert p.prefill.network == 0 and p.decode.network == 0
    assert p.feasible and p.throughput == pytest.approx(2 * 16 / p.total_s)
    assert p.ttft_s == pytest.approx(p.batch_prefill.total)  # both prompts in one forward
    slow = ClusterSpec(**{**BOX.__dict__, "layer_overhead": 1e-3, "step_overhead": 2e-3, "seq_overhead": 1e-4})
    assert predict(TINY, w, slow, Layout()).decode.total == pytest.approx(p.decode.total + 4e-3 + 2e-3 + 2e-4)


def test_linear_curve_interpolates_in_log_rows():
    box = ClusterSpec(**{**BOX.__dict__, "linear_rows": [1, 4, 16], "linear_rate": [1e9, 2e9, 1e9]})
    assert box.linear_time(1e6, 1) == pytest.approx(1e-3)
    assert box.linear_time(1e6, 4) == pytest.approx(0.5e-3)
    assert box.linear_time(1e6, 2) == pytest.approx((1e-3 + 0.5e-3) / 2)  # halfway in log(rows)
    assert box.linear_time(1e6, 64) == pytest.approx(1e-3 * 64 / 16)  # past the curve: compute-bound
    assert box.linear_time(1e6, 0.5) == pytest.approx(1e-3)
    assert BOX.linear_time(1e6, 1) == pytest.approx(4e6 / 1e10)  # no curve: roofline, memory-bound
    assert BOX.linear_time(1e6, 100) == pytest.approx(2e8 / 1e10)  # compute-bound
    with pytest.raises(ValueError, match="same length"):
        ClusterSpec(linear_rows=[1, 2], linear_rate=[1e9])
    with pytest.raises(ValueError, match="increasing"):
        ClusterSpec(linear_rows=[4, 2], linear_rate=[1e9, 1e9])


def test_softmax_rate_depends_on_whether_the_scores_fit_in_cache():
    from scratchlm.plan.calibrate import softmax_lengths

    box = ClusterSpec(**{**BOX.__dict__, "softmax_rate": 1e8, "softmax_rate_cached": 2e8, "cache_bytes": 2**20})
    assert box.softmax_for(2**18) == 2e8 and box.softmax_for(2**18 + 1) == 1e8
    assert BOX.softmax_for(1) == BOX.softmax_rate  # no cache given: one rate
    w = Workload(prompt_len=64, output_len=4, concurrency=1)  # 8 x 64^2 floats = 128 KiB: in cache
    fast = predict(TINY, w, box, Layout())
    slow = predict(TINY, w, ClusterSpec(**{**box.__dict__, "softmax_rate_cached": 1e8}), Layout())
    assert fast.prefill.compute < slow.prefill.compute
    t_in, t_out = softmax_lengths(9, 32 * 2**20)
    assert 9 * t_in**2 * 4 <= 16 * 2**20 and 9 * t_out**2 * 4 >= 4 * 32 * 2**20


def test_pipeline_stages_follow_the_engine_and_micro_batches_overlap():
    from scratchlm.parallel.layout import balanced_stages

    w = Workload(prompt_len=64, output_len=16, concurrency=8)
    one, pp2 = predict(TINY, w, BOX, Layout()), predict(TINY, w, BOX, Layout(pp=2))
    assert pp2.stage_layers == balanced_stages(TINY, 2)
    assert pp2.microbatches == 2 and len(pp2.decode_stages) == 2
    # A step: one micro-batch through both stages, plus (m - 1) more of the slowest stage.
    st = pp2.decode_stages
    slowest = max(st, key=lambda t: t.work)
    assert pp2.decode.compute + pp2.decode.memory == pytest.approx(
        sum(t.compute + t.memory for t in st) + slowest.compute + slowest.memory)
    assert pp2.decode_rank.work < one.decode.work  # each rank does about half the work
    batch1 = predict(TINY, Workload(prompt_len=64, output_len=16, concurrency=1), BOX, Layout(pp=2))
    assert batch1.microbatches == 1  # one sequence cannot be split


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


@pytest.mark.parametrize("name", ["cpu16_25gbe.toml", "h100x8_nvlink.toml", "gpu1000_ib.toml", "h100x8_ib.toml",
                                  "h100x8_ib_fp8.toml"])
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
    from scratchlm.plan.calibrate import (
        measure_elementwise,
        measure_engine_overhead,
        measure_gemm,
        measure_gemv,
        measure_layer_overhead,
        measure_linear_curve,
        measure_ring_step_overhead,
        measure_softmax_rate,
    )

    assert 0 < measure_layer_overhead(layers=2) < 1
    f = measure_gemm(256)
    assert f > 1e6  # loose: the machine is shared, figures swing several-fold
    assert measure_gemv(256, 128, total_bytes=4e6) > 1e6
    assert measure_softmax_rate(f, t=128) > 1e3
    rows, rates = measure_linear_curve(TINY, rows=(1, 8, 128), total_bytes=2e6)
    assert rows == [1, 8, 128] and all(r > 1e5 for r in rates)
    assert measure_elementwise(TINY, t=32) > 1e5
    assert 0 < measure_ring_step_overhead(8, 4, 8) < 1
    per_layer, per_step, per_seq = measure_engine_overhead(layers=(1, 3))
    assert 0 <= per_layer < 1 and 0 <= per_step < 1 and 0 <= per_seq < 1


@pytest.mark.slow
def test_activation_memory_calibration():
    from scratchlm.plan.calibrate import measure_activation_memory

    token_bytes, score_bytes = measure_activation_memory(TINY, lengths=(256, 512))
    # Between a bare float32 score matrix and a few of them; per token: some d_model-wide fp32 buffers.
    assert 1 <= score_bytes <= 16 and token_bytes > 4 * TINY.d_model


@pytest.mark.slow
def test_calibration_network():
    from scratchlm.plan.calibrate import measure_allreduce

    lat, bw = measure_allreduce(large=2**20, repeats=5)
    assert 0 < lat < 0.1 and bw > 1e6
