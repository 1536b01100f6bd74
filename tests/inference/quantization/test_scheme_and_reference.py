"""Scheme names, format checks, and the pure-torch reference: error bounds (hypothesis) and packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.inference.quantization import LayerFormat, parse_scheme
from scratchlm.inference.quantization import reference as ref


def test_scheme_names():
    assert parse_scheme("int8").linear == LayerFormat(8, None, True)
    s = parse_scheme("int4")
    assert (s.linear.bits, s.linear.group_size, s.linear.symmetric, s.name) == (4, 32, False, "int4-g32-asym")
    s = parse_scheme("INT4-g128-sym+emb+nohead")
    assert s.linear == LayerFormat(4, 128, True) and s.quantize_embedding and not s.quantize_head
    s = parse_scheme("int4-g32-sym+head8")
    assert s.head == LayerFormat(8) and s.linear.bits == 4


@pytest.mark.parametrize("name, words", [
    ("int3", "unknown quantization scheme"), ("int4-g48", "multiple of 32"), ("int8-asym", "symmetric only"),
    ("fp8", "expected int8"), ("int4-g0", "multiple of 32"),
    ("int4+head8+nohead", "exclude each other"),
])
def test_bad_scheme_names(name, words):
    with pytest.raises(ValueError, match=words):
        parse_scheme(name)


def test_group_size_errors_name_the_dims():
    with pytest.raises(ValueError, match="does not divide d_in=100"):
        LayerFormat(8, 32).check(100, "layer")
    with pytest.raises(ValueError, match="d_in to be a multiple of 32, got d_in=172"):
        LayerFormat(4, 32).check(172, "w2")
    with pytest.raises(ValueError, match="positive multiple of 32"):
        LayerFormat(4, 48).check(96, "w")


shapes = st.tuples(st.integers(1, 6), st.integers(1, 5)).map(lambda t: (t[0], 32 * t[1]))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), scale=st.floats(1e-3, 10.0), group=st.sampled_from([32, 64, None]))
def test_int8_error_bound(shape, seed, scale, group):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    if group is not None and shape[1] % group:
        group = 32
    q, s = ref.quantize_int8(w, group)
    err = (ref.dequantize_int8(q, s) - w).abs()
    g = group or shape[1]
    bound = s.repeat_interleave(g, dim=1)[:, : shape[1]] * 0.5
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), scale=st.floats(1e-2, 10.0), group=st.sampled_from([32, 64, 128]),
       symmetric=st.booleans())
def test_int4_error_bound(shape, seed, scale, group, symmetric):
    """Sym (Q4_0 rule): |err| <= amax/8 of the group; asym: |err| <= d/2 (+ float16 rounding of d and m)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    q, d, m = ref.quantize_int4(w, group, symmetric)
    deq = ref.dequantize_int4(q, d, m, group)
    k = shape[1]
    err = (deq - w).abs()
    wg, _ = ref._grouped(w, group)
    amax = wg.abs().amax(-1).repeat_interleave(group, dim=1)[:, :k]
    if symmetric:
        assert (err <= amax / 8 * (1 + 2e-3) + 1e-6).all()
    else:
        span = (wg.amax(-1) - wg.amin(-1)).repeat_interleave(group, dim=1)[:, :k]
        assert (err <= span / 30 + span * 2e-3 + amax * 1e-3 + 1e-6).all()


def test_nibble_packing_round_trip_and_gguf_layout():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = ref.pack_nibbles(q)
    assert packed.shape == (3, 32)
    assert torch.equal(ref.unpack_nibbles(packed), q)
    # GGUF: byte i of a 32-weight block = weight i (low nibble) | weight i + 16 (high nibble)
    assert int(packed[1, 3]) == int(q[1, 3]) | (int(q[1, 19]) << 4)
    assert int(packed[2, 16 + 5]) == int(q[2, 32 + 5]) | (int(q[2, 32 + 21]) << 4)


def test_ragged_last_group():
    """g = 128 on d_in = 576 (SmolLM2): 4 groups of 128 and one of 64, each with its own scale."""
    w = torch.randn(4, 576)
    q, d, m = ref.quantize_int4(w, 128, symmetric=False)
    assert d.shape == (4, 5)
    assert torch.allclose(m[:, 4].float(), w[:, 512:].amin(-1), atol=1e-2)
    assert (ref.dequantize_int4(q, d, m, 128) - w).abs().max() < 0.5
