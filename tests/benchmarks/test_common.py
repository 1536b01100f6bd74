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


def test_isa_env_sets_the_cap_and_drops_stale_caps():
    import pytest

    from benchmarks.common import CAP_VARIABLES, isa_env

    base = {"PATH": "/bin", "SCRATCHLM_ISA": "scalar", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    avx2 = isa_env("avx2", base)
    assert avx2 == {"PATH": "/bin", "SCRATCHLM_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    native = isa_env("native", base)
    assert native["SCRATCHLM_ISA"] == "native" and not set(CAP_VARIABLES) - {"SCRATCHLM_ISA"} & set(native)
    assert base["SCRATCHLM_ISA"] == "scalar"  # the base is not modified
    with pytest.raises(ValueError, match="'avx9'"):
        isa_env("avx9", base)


def test_machine_info_names_simd_flags_and_cap():
    info = machine_info()
    assert "SIMD flags" in info and "ISA cap" in info


def test_type_mix_counts_types_per_tensor_kind(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from benchmarks.llamacpp_decode import leading_equal, type_mix

    path = tmp_path / "mix.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 64), np.float32))
    w.add_tensor("blk.1.ffn_down.weight", np.zeros((4, 34 * 2), np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)  # 2 blocks of 34 bytes per row: 64 weights
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    total, kinds = type_mix(path)
    assert total == {"F32": 2, "Q8_0": 1}
    assert kinds["ffn_down"] == {("F32", 64): 1, ("Q8_0", 64): 1} and kinds["output_norm"] == {("F32", 64): 1}
    assert leading_equal([1, 2, 3], [1, 2, 4]) == "2/3" and leading_equal([1], None) == ""


def test_llamacpp_f16_kv_bytes_of_smollm2():
    from benchmarks.gguf_load import kv_bytes_f16
    from scratchlm.defaults import default_model_path

    # SmolLM2-135M: 30 layers, 3 KV heads of 64; K and V, 2 bytes each
    assert kv_bytes_f16(default_model_path(), 2048) == 2 * 30 * 3 * 64 * 2048 * 2


def _echo_client(conn, name: str) -> None:
    """A contender for `interleaved_clients`: a ready line, then {"wall", "name", "kind"} per kind, None stops."""
    conn.send(f"{name} ready")
    while (kind := conn.recv()) is not None:
        conn.send({"wall": 0.0, "name": name, "kind": kind})


def test_interleaved_clients_keeps_every_round_but_the_warm_up() -> None:
    from benchmarks.common import interleaved_clients

    results = interleaved_clients(_echo_client, {"a": ("a",), "b": ("b",)}, ("x", "y"), repeats=2)
    assert set(results) == {"a", "b"}
    for name, kinds in results.items():
        assert {k: [(r["name"], r["kind"]) for r in rs] for k, rs in kinds.items()} == {
            "x": [(name, "x")] * 2, "y": [(name, "y")] * 2}
