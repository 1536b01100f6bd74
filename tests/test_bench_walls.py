"""benchmarks/walls.py's I/O wall: the two-process link measurement and the per-step communication it reads from
rank 0's `Comm` (real gloo processes, stories260K): bytes and calls per TP step equal the ring all-reduce formula."""

from __future__ import annotations

import pytest

walls = pytest.importorskip("benchmarks.walls")


@pytest.mark.distributed
def test_link_curve_and_tp_step_bytes(data_dir):
    links = walls.measure_links([4, 4096, 1 << 16], repeats=3)
    sizes, p2p, ar = walls.link_curve(links)
    assert sizes == [4, 4096, 1 << 16] and all(r > 0 for r in p2p + ar)
    assert walls.bandwidth_at(sizes, p2p, 4096) == pytest.approx(p2p[1])

    model = str(data_dir / "models/stories260K/stories260K.bin")
    points, info = walls.comm_points(model, {"one rank": {}, "TP=2": {"tensor_parallel_size": 2}}, prefill=32,
                                     batch=2, rounds=1)
    cfg = info["cfg"]
    by = {p.workload: p for p in points}
    assert {p.layout for p in points} == {"TP=2"} and set(by) == {"prefill 32", "decode, batch 1", "decode, batch 2"}
    for p in points:
        calls, nbytes = p.kinds["all_reduce"][1:]
        # 2 all-reduces per layer + the vocabulary-parallel embedding's; a ring all-reduce of (tokens, d) fp32 over
        # 2 ranks sends tokens * d * 4 bytes
        assert calls == 2 * cfg.n_layers + 1
        assert nbytes == calls * p.tokens * cfg.d_model * 4
        assert p.world == 2 and p.single_s > 0 and 0 < p.comm_s < p.seconds
        assert p.sent >= nbytes and p.calls >= calls
    assert by["prefill 32"].tokens == 32 and by["decode, batch 2"].tokens == 2
