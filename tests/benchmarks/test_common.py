import time

from benchmarks.common import Report, compare, machine_info, markdown_table


def test_compare_interleaves_and_ratios():
    order = []
    res = compare(
        {"a": lambda: (order.append("a"), time.sleep(0.002)), "b": lambda: (order.append("b"), time.sleep(0.02))},
        warmup=1, repeats=3, progress=False,
    )
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert len(res["a"].times) == 3
    assert res.ratio("b", "a") > 2  # b sleeps 10x longer
    rows = res.rows(work=10.0, work_unit="tok")
    assert rows[0][-1] == "1.000" and float(rows[1][-1]) > 2


def test_report_writes_machine_and_table(tmp_path):
    r = Report("unit", "Unit report", argv=["--x", "1"])
    r.table(["a", "b"], [[1, 2]])
    path = r.write(tmp_path)
    text = path.read_text()
    assert "python -m benchmarks.unit --x 1" in text and "| 1 | 2 |" in text
    for key in ("cpu", "cores", "torch", "git commit"):
        assert f"- {key}:" in text
    assert set(machine_info()) >= {"cpu", "cores", "load average"}


def test_markdown_table():
    assert markdown_table(["x"], [[1]]) == "| x |\n|---|\n| 1 |"


def test_thread_cpu_clock_ignores_waiting():
    def busy():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.02:
            pass

    res = compare({"sleep": lambda: time.sleep(0.02), "busy": busy}, warmup=0, repeats=3, progress=False,
                  clock="thread_cpu")
    assert res["sleep"].median < 0.005 < res["busy"].median


def test_unknown_clock_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="clock='gpu'"):
        compare({"a": lambda: None}, clock="gpu")
