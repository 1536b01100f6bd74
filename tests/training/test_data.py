import json

import numpy as np
import pytest
import torch

from scratchlm.training import RandomWindowSampler, TokenFile, TokenFileError, get_batch
from scratchlm.training.data import sequential_windows, windows_to_batch

from .corpus import write_token_file


def test_get_batch_windows_are_contiguous_and_shifted():
    data = np.arange(100)
    x, y = get_batch(data, batch_size=32, context_length=8, device="cpu", rng=np.random.default_rng(0))
    assert x.shape == y.shape == (32, 8) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert int(x.min()) >= 0 and int(y.max()) <= 99


def test_get_batch_covers_every_start():
    data = np.arange(20)
    starts = set()
    rng = np.random.default_rng(0)
    for _ in range(200):
        x, _ = get_batch(data, 4, 5, "cpu", rng=rng)
        starts.update(x[:, 0].tolist())
    assert starts == set(range(20 - 5))


def test_get_batch_rejects_short_data():
    with pytest.raises(ValueError, match="context_length"):
        get_batch(np.arange(5), 2, 8, "cpu")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_reads_sidecar_dtype(tmp_path, dtype):
    ids = np.array([1, 70000 if dtype == "uint32" else 60000, 3, 4])
    path = write_token_file(tmp_path / "a.bin", ids, vocab_size=70001, n_bytes=10, dtype=dtype)
    tf = TokenFile.open(path)
    assert tf.tokens.dtype == np.dtype(dtype)
    assert tf.tokens.tolist() == ids.tolist()
    assert tf.vocab_size == 70001 and tf.bytes_per_token == pytest.approx(2.5)


def test_token_file_errors(tmp_path):
    with pytest.raises(TokenFileError, match="not found"):
        TokenFile.open(tmp_path / "missing.bin")
    empty = write_token_file(tmp_path / "empty.bin", np.array([], dtype=np.uint16))
    with pytest.raises(TokenFileError, match="empty"):
        TokenFile.open(empty)
    (tmp_path / "nosidecar.bin").write_bytes(b"\x00\x01")
    with pytest.raises(TokenFileError, match="sidecar"):
        TokenFile.open(tmp_path / "nosidecar.bin")
    bad = write_token_file(tmp_path / "bad.bin", np.arange(4))
    bad.with_name("bad.bin.json").write_text(json.dumps({"dtype": "float64", "count": 4}))
    with pytest.raises(TokenFileError, match="dtype 'float64'"):
        TokenFile.open(bad)
    bad.with_name("bad.bin.json").write_text(json.dumps({"dtype": "uint16", "count": 5}))
    with pytest.raises(TokenFileError, match="sidecar says 5 tokens but the file holds 4"):
        TokenFile.open(bad)
    bad.with_name("bad.bin.json").write_text("{not json")
    with pytest.raises(TokenFileError, match="not valid JSON"):
        TokenFile.open(bad)
    short = TokenFile.open(write_token_file(tmp_path / "short.bin", np.arange(4)))
    with pytest.raises(TokenFileError, match="fewer than context_length"):
        short.check_fits(8)


def test_sampler_is_deterministic_and_state_restores():
    tokens = np.arange(1000)
    a = RandomWindowSampler(tokens, 16, seed=3)
    b = RandomWindowSampler(tokens, 16, seed=3)
    assert np.array_equal(a.next_starts(8), b.next_starts(8))
    state = a.state_dict()
    expected = [a.next_starts(8) for _ in range(3)]
    c = RandomWindowSampler(tokens, 16, seed=99)
    c.load_state_dict(state)
    assert all(np.array_equal(e, c.next_starts(8)) for e in expected)
    with pytest.raises(ValueError, match="same corpus"):
        RandomWindowSampler(np.arange(500), 16, seed=3).load_state_dict(state)


def test_sequential_windows_predict_each_token_once():
    n, t = 103, 10
    starts = sequential_windows(n, t)
    x, y = windows_to_batch(np.arange(n), starts, t, "cpu")
    predicted = y.reshape(-1).tolist()
    assert predicted == list(range(1, 1 + len(predicted)))
    assert n - 1 - len(predicted) < t  # only a tail shorter than one window is left (the evaluator adds it)
