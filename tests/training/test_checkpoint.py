import io

import pytest
import torch

from scratchlm.training import AdamW, CheckpointError, load_checkpoint, save_checkpoint
from scratchlm.training.checkpoint import atomic_torch_save, read_checkpoint


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_a_bit(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("to_file_object", [False, True])
def test_save_load_round_trip(tmp_path, to_file_object):
    model, opt = _model_and_opt(0)
    _train_a_bit(model, opt)
    target = io.BytesIO() if to_file_object else tmp_path / "c.pt"
    save_checkpoint(model, opt, 3, target)
    if to_file_object:
        target.seek(0)
    model2, opt2 = _model_and_opt(1)
    assert load_checkpoint(target, model2, opt2) == 3
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _train_a_bit(model, opt, 1)
    _train_a_bit(model2, opt2, 1)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_atomic_write_leaves_no_temp_and_replaces(tmp_path):
    path = tmp_path / "sub" / "x.pt"
    atomic_torch_save({"a": 1}, path)
    atomic_torch_save({"a": 2}, path)
    assert torch.load(path)["a"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["x.pt"]


def test_atomic_write_keeps_old_file_when_write_fails(tmp_path):
    path = tmp_path / "x.pt"
    atomic_torch_save({"a": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"a": Unpicklable()}, path)
    assert torch.load(path)["a"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_corrupt_checkpoints_get_clear_errors(tmp_path):
    model, opt = _model_and_opt(0)
    good = tmp_path / "good.pt"
    save_checkpoint(model, opt, 1, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated.pt: not a readable checkpoint"):
        load_checkpoint(truncated, model, opt)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        read_checkpoint(garbage)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        read_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not found"):
        read_checkpoint(tmp_path / "nope.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a checkpoint dict"):
        read_checkpoint(tmp_path / "list.pt")
    torch.save({"model": {}}, tmp_path / "nostep.pt")
    with pytest.raises(CheckpointError, match=r"lacks \['step'\]"):
        load_checkpoint(tmp_path / "nostep.pt", model)
