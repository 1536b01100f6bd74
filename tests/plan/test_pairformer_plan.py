"""The Pairformer workload of `scratchlm plan`: the model's shape and the CLI's boundary checks."""

from __future__ import annotations

import argparse

import pytest

from scratchlm.fold.dap import block_comm_bytes
from scratchlm.fold.pairformer import PairformerConfig
from scratchlm.plan.cli import add_arguments, run
from scratchlm.plan.pairformer import PairformerRates, plan_pairformer, predict_block

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
