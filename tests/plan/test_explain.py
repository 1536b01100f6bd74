"""`scratchlm plan`'s explanation names the phase its bottleneck belongs to and never prints a small term as
0.00 ms (issue 17, item 10); shipped cluster and model files are found by name from any folder."""

from __future__ import annotations

from scratchlm.cli import main
from scratchlm.plan import ClusterSpec, Workload, plan
from scratchlm.plan.cost import _ms, explain
from tests.plan.test_plan import TINY


def test_ms_keeps_small_terms_visible():
    assert _ms(0) == "0 ms" and _ms(2.5e-6) == "0.0025 ms" and _ms(0.01234) == "12.3 ms" and _ms(8.2448) == "8245 ms"


def test_explanation_names_the_phase_of_the_bottleneck():
    # slow compute, fast memory: prefill is compute-bound and dominates; decode ops are memory-bound (compute 0)
    box = ClusterSpec(name="box", nodes=1, devices_per_node=1, flops=1e8, mem_bw=1e12, mem_capacity=1e10,
                      softmax_rate=1e9, intra_bw=1e9, intra_latency=1e-5, inter_bw=1e8, inter_latency=1e-4)
    ranked = plan(TINY, Workload(prompt_len=2048, output_len=2, concurrency=1), box)
    text = explain(ranked)
    assert "limited by compute in prefill (prefill is" in text, text
    assert "0.00 ms" not in text


def test_plan_finds_shipped_files_by_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the names resolve to package data
    assert main(["plan", "--model", "llama3-8b", "--cluster", "h100x8_nvlink", "--top", "2"]) == 0
    assert "Best for throughput" in capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", "--cluster", "no_such_cluster"]) == 2
    err = capsys.readouterr().err
    assert "shipped recipe (recipes: cpu16_25gbe, gpu1000_ib, h100x8_ib, h100x8_ib_fp8, h100x8_nvlink)" in err
