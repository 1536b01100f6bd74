"""`scratchlm bench all --quick --report`: every benchmark's smoke run (or its reason to skip), a dated summary,
and the figures of a docs folder rebuilt from the results between their markers, with the index's listing."""

from __future__ import annotations

import re
import shutil

import pytest

from scratchlm import bench
from tests.conftest import REPO_ROOT


def test_tables_and_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-01-01-demo.md").write_text("# old\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (results / "2026-02-01-demo.md").write_text(
        "# Demo\n\n**First table**\n\n| a | b |\n|---|---|\n| 3 | 4 |\n\ntext\n\n**Second, with caption**\n\n"
        "| x |\n|---|\n| 9 |\n")
    (results / "2026-03-01-demo-other.md").write_text("| not | this |\n|---|---|\n| 0 | 0 |\n")
    assert bench.latest_result(results, "demo").name == "2026-02-01-demo.md"
    assert [c for c, _ in bench.tables((results / "2026-02-01-demo.md").read_text())] == [
        "First table", "Second, with caption"]
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "page.md"
    page.write_text("intro\n<!-- figure: demo-second -->\nstale 1 2 3\n<!-- /figure -->\nafter\n"
                    "<!-- figure: nope -->\nkept\n<!-- /figure -->\n")
    (docs / "index.md").write_text("# index\n<!-- figures -->\nold\n<!-- /figures -->\nend\n")
    figures = dict(bench.FIGURES)
    try:
        bench.FIGURES["demo-second"] = bench.Figure("demo", "Second", page="page.md")
        built = bench.rebuild_figures(results, docs, log=lambda *a: None)
    finally:
        bench.FIGURES.clear()
        bench.FIGURES.update(figures)
    assert built == {"demo-second": "2026-02-01-demo.md"}
    text = page.read_text()
    assert "stale" not in text and "| 9 |" in text and "(../results/2026-02-01-demo.md)" in text
    assert "kept" in text and text.startswith("intro\n") and text.endswith("kept\n<!-- /figure -->\n")
    index = (docs / "index.md").read_text()
    assert "| [demo-second](page.md#demo-second) | page.md | [2026-02-01-demo.md](../results/2026-02-01-demo.md) |" \
        in index and "old" not in index


def test_every_benchmark_is_planned():
    names = bench.available()
    plan = bench._plan(names, quick=True)
    assert {n for n, _, _ in plan} == set(names)
    for name, argv, why in plan:
        assert argv is not None or why, f"{name}: skipped in --quick without a reason"


def test_quick_refuses_to_overwrite_the_docs(capsys):
    with pytest.raises(SystemExit):
        bench.run_all_command(["--quick", "--report"])
    assert "must not replace the docs" in capsys.readouterr().err


def test_bench_all_quick_report(tmp_path, data_dir):
    results, docs = tmp_path / "results", tmp_path / "docs"
    shutil.copytree(REPO_ROOT / "docs", docs)
    (docs / "quick.md").write_text("<!-- figure: walls-peaks -->\n<!-- /figure -->\n"
                                   "<!-- figure: autodiff-lm-step -->\n<!-- /figure -->\n")
    rc = bench.run_all_command(["--quick", "--report", "--results-dir", str(results), "--docs-dir", str(docs)])
    assert rc == 0
    [summary] = results.glob("*-bench_all-quick.md")
    text = summary.read_text()
    ran = [n for n, argv, _ in bench._plan(bench.available(), quick=True) if argv is not None]
    assert ran and text.count("| ok |") == len(ran), text
    for name in set(ran):
        assert f"`{name}`" in text
    assert list(results.glob("*-walls.png")) and list(results.glob("*-walls.md"))
    quick = (docs / "quick.md").read_text()
    assert "compute (fp32 GEMM)" in quick and "torch.autograd" in quick
    assert re.search(r"\]\(\.\./results/\d{4}-\d{2}-\d{2}-walls\.md\)", quick)


def test_bench_all_quick_writes_into_the_working_folder_and_lists_the_skipped(tmp_path):
    """Results land under the current working folder, not next to the package; skipped benchmarks are printed
    with their reason (issue 30, item 14)."""
    import os
    import subprocess
    import sys

    repo_quick = REPO_ROOT / "benchmarks" / "results" / "quick"
    before = {p.name: p.stat().st_mtime for p in repo_quick.glob("*")} if repo_quick.is_dir() else {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("SCRATCHLM_BENCH_RESULTS", None)
    out = subprocess.run([sys.executable, "-m", "scratchlm", "bench", "all", "--quick", "--only", "dequant_speed",
                          "kv_cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    results = tmp_path / "benchmarks" / "results" / "quick"
    assert list(results.glob("*-bench_all-quick.md")) and list(results.glob("*-dequant_speed*.md")), out.stdout
    after = {p.name: p.stat().st_mtime for p in repo_quick.glob("*")} if repo_quick.is_dir() else {}
    assert after == before, "bench all --quick wrote into the package's folder"
    assert "1 run(s), 1 skipped" in out.stdout and "skipped kv_cache: even its --quick" in out.stdout, out.stdout
