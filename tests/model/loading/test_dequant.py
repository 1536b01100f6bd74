"""The torch GGUF dequantizers against `gguf.quants.dequantize` (numpy, the oracle): bit-equal float32 for every
supported type, on random valid blocks, on blocks gguf's quantizer made, on the tensors of real llama.cpp files,
and on edge shapes; unsupported types are errors naming the type (and the tensor, raised before any work)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scratchlm.model import CheckpointError, load
from scratchlm.model.loading.dequant import (
    CHUNK_WEIGHTS,
    SUPPORTED_TYPES,
    TYPE_INFO,
    dequantize,
    dequantize_blocks,
    dequantize_rows,
)
from tests.conftest import REPO_ROOT

gguf = pytest.importorskip("gguf")

# byte offsets of the fp16 fields (scales, mins) in each block, from ggml-common.h's block structs: random
# bytes there would be NaN/inf, which torch.equal cannot compare
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
              "TQ1_0": [52], "TQ2_0": [64], "MXFP4": [], "NVFP4": [], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0],
              "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0], "IQ1_M": []}
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = [t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES]
# ggml types no GGUF weight file uses (Q8_K/Q8_1: activation formats) or gguf.quants cannot read: clear errors
UNSUPPORTED = ["Q8_K", "Q8_1", "Q1_0", "I8", "I32", "F64"]


def oracle(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(shape))


def random_raw(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, block_bytes) random valid blocks: random bytes, finite fp16 fields of every magnitude."""
    bw, bb = TYPE_INFO[type_name]
    if type_name in FLOAT_TYPES:
        w = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-8, 4, n_blocks)).astype(np.float32)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        raw = w.view(np.uint8).reshape(n_blocks, 4)
        return raw if type_name == "F32" else np.ascontiguousarray(raw[:, 2:4])  # BF16: the high half
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        scale = rng.standard_normal((n_blocks, 1)) * 10.0 ** rng.integers(-7, 3, (n_blocks, 1))  # subnormals too
        raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":
        raw[:, 0] = rng.integers(0, 250, n_blocks)  # e8m0 exponents whose products stay finite
    if type_name == "IQ1_M":  # its fp16 d is spread over the top nibbles of the four u16 scale fields
        d = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)).astype(np.float16).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16)  # (n, 4)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = sc.view(np.uint8)
    return raw


def test_type_table_matches_ggml():
    for name in SUPPORTED_TYPES:
        assert TYPE_INFO[name] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]], name


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_random_blocks_bit_equal_to_gguf(type_name):
    """Random valid blocks, more than two CPU chunks of them (the chunk loop and its last, partial chunk)."""
    bw, bb = TYPE_INFO[type_name]
    rng = np.random.default_rng(sum(map(ord, type_name)))
    n_blocks = 2 * CHUNK_WEIGHTS // bw + 7
    raw = random_raw(type_name, n_blocks, rng)
    shape = (n_blocks, bw)
    want = oracle(raw, type_name, shape)
    assert torch.isfinite(want).all()
    got = dequantize(raw, type_name, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want)
    assert torch.equal(dequantize_blocks(torch.from_numpy(raw), type_name), want)  # torch input, no copy


def _quantizable() -> list[str]:
    ok = []
    for name in SUPPORTED_TYPES:
        try:
            gguf.quants.quantize(np.zeros((1, 256), np.float32), gguf.GGMLQuantizationType[name])
        except NotImplementedError:
            continue
        ok.append(name)
    return ok


@pytest.mark.parametrize("type_name", _quantizable())
def test_blocks_from_gguf_quantizer_bit_equal(type_name):
    """Blocks as a quantizer writes them (real scales, all-zero and constant blocks), for the types gguf quantizes."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 512)) * rng.uniform(0.001, 3.0, (24, 1))).astype(np.float32)
    w[3] = 0.0
    w[4] = 0.25
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantize(raw, type_name, w.shape), oracle(raw, type_name, w.shape))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_edge_shapes_and_rows(type_name):
    bw, bb = TYPE_INFO[type_name]
    rng = np.random.default_rng(2)
    one = random_raw(type_name, 1, rng)  # a single block
    assert torch.equal(dequantize(one, type_name, (1, bw)), oracle(one, type_name, (1, bw)))
    rows, per_row = 300, 3  # many short rows
    raw = random_raw(type_name, rows * per_row, rng).reshape(rows, per_row * bb)
    K = per_row * bw
    want = oracle(raw, type_name, (rows, K))
    assert torch.equal(dequantize(raw, type_name, (rows, K)), want)
    t = torch.from_numpy(raw)
    assert torch.equal(dequantize_rows(t, type_name, K), want)
    ids = torch.tensor([299, 0, 17, 17, 150])  # a lookup: some rows, repeated, out of order
    assert torch.equal(dequantize_rows(t.index_select(0, ids), type_name, K), want[ids])
    assert torch.equal(dequantize_rows(t[::2], type_name, K), want[::2])  # a strided view
    assert dequantize_rows(t[:0], type_name, K).shape == (0, K)


def test_real_llama_cpp_files_bit_equal(default_model_path):
    """The smallest tensor of each type of the default model and of the K-quant files llama.cpp's quantizer made."""
    peers = [REPO_ROOT / ".peers" / f"SmolLM2-135M-Instruct.{q}.gguf" for q in ("Q4_K_M", "Q5_K_M")]  # (--setup-peers)
    files = [default_model_path, *(p for p in peers if p.is_file())]  # Q4_1 Q8_0, Q4_K Q5_0 Q6_K, Q5_1 Q5_K
    from scratchlm.model.loading.gguf_reader import read_gguf

    seen = set()
    for path in files:
        _, tensors = read_gguf(path)
        for t in sorted(tensors.values(), key=lambda t: t.data.size):
            if t.type_name in seen or t.type_name == "F32":
                continue
            seen.add(t.type_name)
            assert torch.equal(dequantize(t.data, t.type_name, t.shape), oracle(t.data, t.type_name, t.shape)), \
                (path.name, t.name)
    assert {"Q4_1", "Q8_0"} <= seen


@pytest.mark.parametrize("type_name", UNSUPPORTED + ["NOPE"])
def test_unsupported_type_is_a_clear_error(type_name):
    with pytest.raises(ValueError, match=f"type {type_name} is not supported .*supported: F32, F16"):
        dequantize(np.zeros((1, 66), np.uint8), type_name, (1, 256))
    with pytest.raises(ValueError, match=f"type {type_name} is not supported"):
        dequantize_rows(torch.zeros(1, 66, dtype=torch.uint8), type_name, 256)


def test_wrong_sizes_are_errors():
    with pytest.raises(ValueError, match=r"Q4_K tensor of shape \(2, 256\) needs 288 bytes"):
        dequantize(np.zeros(144, np.uint8), "Q4_K", (2, 256))
    with pytest.raises(ValueError, match="not a multiple of the 256-weight block"):
        dequantize_rows(torch.zeros(1, 144, dtype=torch.uint8), "Q4_K", 200)
    with pytest.raises(ValueError, match=r"take 144 bytes, got \(1, 143\)"):
        dequantize_rows(torch.zeros(1, 143, dtype=torch.uint8), "Q4_K", 256)


def test_iq_grids_match_llama_cpp_header():
    """The grids transcribed into iq_grids.py against the tables of llama.cpp's source, when it is present."""
    import re

    from scratchlm.model.loading import iq_grids

    header = REPO_ROOT / ".peers/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-common.h"
    if not header.is_file():
        pytest.skip(f"llama.cpp's source is not at {header}")
    text = header.read_text()
    for name, (n, per, _, _, _) in iq_grids.GRIDS.items():
        body = re.search(rf"GGML_TABLE_BEGIN\(\w+, {name}, \w+\)(.*?)GGML_TABLE_END", text, re.S).group(1)
        words = [int(v, 16) for v in re.findall(r"0x[0-9a-fA-F]+", body)]
        want = np.array(words, dtype=np.uint64 if per == 8 else np.uint32).view(np.int8).reshape(n, per)
        assert np.array_equal(iq_grids.grid(name).numpy(), want), name


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_gguf_with_an_unsupported_tensor_type_fails_before_any_work(tmp_path, arch):
    """The type check runs right after the header is read: before the architecture and the config (the file has
    no config metadata, and bert is not a supported architecture: either would be a different error), and
    before any tensor is dequantized."""
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    q8k = np.zeros((4, 292), np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", q8k, raw_shape=q8k.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    writer.add_tensor("blk.0.attn_k.weight", np.zeros((4, 8), np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert "tensor blk.0.attn_q.weight has type Q8_K, which scratchlm cannot read" in msg
    assert "(and 1 more tensor of type F64)" in msg and "supported: F32, F16, BF16, Q4_0" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_on_cuda(type_name):
    bw, bb = TYPE_INFO[type_name]
    raw = random_raw(type_name, 4096, np.random.default_rng(3))
    got = dequantize_rows(torch.from_numpy(raw).cuda(), type_name, bw)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), oracle(raw, type_name, (4096, bw)))
