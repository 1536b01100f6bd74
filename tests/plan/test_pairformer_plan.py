"""The Pairformer workload of `scratchlm plan`: the model's shape and the CLI's boundary checks."""

from __future__ import annotations

import argparse

import pytest

from scratchlm.fold.dap import block_comm_bytes
from scratchlm.fold.pairformer import PairformerConfig
from scratchlm.plan.cli import add_arguments, run
from scratchlm.plan.pairformer import PairformerRates, dap_cpu_terms, measure_dap_cpu, plan_pairformer, predict_block

CFG = PairformerConfig(n_blocks=1)
RATES = PairformerRates(gemm_flops=5e10, bmm_flops=5e10, softmax_rate=2e8, elementwise_rate=1e9, op_overhead=1e-5,
                        latency=5e-5,
                        bandwidth=1e9, cores=8)


def test_memory_per_rank_scales_with_one_over_p():
    one = predict_block(CFG, 1024, 1, RATES, chunk_rows=8)
    four = predict_block(CFG, 1024, 4, RATES, chunk_rows=2)
    assert 0.2 < four.activation_bytes / one.activation_bytes < 0.3
    assert one.comm_s == 0 and four.comm_s > 0


def test_time_is_cubic_in_n_and_split_over_ranks():
    a, b = predict_block(CFG, 256, 1, RATES), predict_block(CFG, 512, 1, RATES)
    assert 4 < b.block_s / a.block_s < 8.5
    p4 = predict_block(CFG, 512, 4, RATES)
    assert p4.block_s < b.block_s / 2
    over = predict_block(CFG, 512, 4, PairformerRates(**{**vars(RATES), "cores": 2}))
    assert over.oversubscription == 2.0


def test_budget_picks_a_chunk_that_fits():
    (p,) = plan_pairformer(CFG, 512, [2], RATES, budget_bytes=0.3 * 2**30)
    assert p.fits and p.chunk_rows and p.memory_bytes <= 0.3 * 2**30
    (q,) = plan_pairformer(CFG, 4096, [1], RATES, budget_bytes=2**20)
    assert q.fits is False


def test_dap_cpu_terms_count_calls_bytes_and_padding():
    n, p, k = 101, 4, 16  # N padded to 104: R = 26 rows of N' = 104
    shard = 26 * 104 * CFG.c_z * 4
    t = dap_cpu_terms(CFG, n, p, overlap=True, channel_chunks=k)
    assert t["messages"] == (p - 1) * (4 * k + 2 * k + 3)  # a2a chunks, ring steps, 2 bias + 1 s gathers
    assert t["sent_bytes"] == sum(block_comm_bytes(CFG, n, p, overlap=True).values())
    assert t["packing_bytes"] == 4 * 2 * 2 * shard  # 4 transposes x (pack, unpack) x (read, write)
    bias = CFG.pair_heads * 26 * 104 * 4
    assert t["fresh_bytes"] == 12 * shard + 2 * (p - 1) * shard + 4 * p * bias
    assert dap_cpu_terms(CFG, n, p, overlap=False)["fresh_bytes"] == t["fresh_bytes"] + 4 * p * shard
    assert dap_cpu_terms(CFG, 104, p) == t  # the padding: N = 101 costs what N' = 104 does
    assert set(dap_cpu_terms(CFG, n, 1).values()) == {0.0}


def test_dap_cpu_prices_each_term_outside_the_kernel_efficiency():
    base = PairformerRates(**{**vars(RATES), "efficiency": 1.7})
    pred = predict_block(CFG, 192, 4, base, chunk_rows=1)
    t = dap_cpu_terms(CFG, 192, 4)
    want = (t["messages"] * base.message_cpu + t["sent_bytes"] * base.byte_cpu
            + t["packing_bytes"] / base.copy_rate + t["fresh_bytes"] * base.alloc_cpu)
    assert pred.dap_cpu_s == pytest.approx(want)
    kernels = pred.gemm_s + pred.bmm_s + pred.softmax_s + pred.elementwise_s + pred.overhead_s
    assert pred.compute_s == pytest.approx(kernels * 1.7 + want)  # measured directly: not scaled by efficiency
    dearer = predict_block(CFG, 192, 4, PairformerRates(**{**vars(base), "message_cpu": 2 * base.message_cpu}), 1)
    assert dearer.dap_cpu_s - pred.dap_cpu_s == pytest.approx(t["messages"] * base.message_cpu)
    assert predict_block(CFG, 192, 1, base).dap_cpu_s == 0


def test_measure_dap_cpu_gives_positive_rates_without_a_network():
    rates = measure_dap_cpu(CFG, n=64, world=2, network=False)
    assert set(rates) == {"message_cpu", "byte_cpu", "alloc_cpu", "copy_rate"}
    assert all(v > 0 for v in rates.values())


def test_comm_formula_counts_every_kind():
    sent = block_comm_bytes(CFG, 100, 4, overlap=True)
    assert set(sent) == {"all_to_all", "all_gather", "ring"}
    assert block_comm_bytes(CFG, 100, 1) == {}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_prints_a_table_from_a_cluster_file(capsys):
    assert run(_args("--pairformer-tokens", "256", "--cluster", "recipes/clusters/cpu16_25gbe.toml",
                     "--budget-gib", "1")) == 0
    out = capsys.readouterr().out
    assert "N = 256" in out and "GiB/rank" in out and len(out.strip().splitlines()) == 6  # title, header, rule, 3 rows


@pytest.mark.parametrize("argv, message", [
    (("--pairformer-tokens", "0"), "positive token count"),
    (("--pairformer-tokens", "64", "--pairformer-world", "2,x"), "comma-separated"),
    (("--pairformer-tokens", "64", "--pairformer-world", "0"), "must be positive"),
])
def test_cli_rejects_bad_values(argv, message, capsys):
    assert run(_args(*argv)) == 2
    assert message in capsys.readouterr().err
