import copy
import math

import pytest
import torch

from scratchlm.training import AdamW, get_lr_cosine_schedule, gradient_clipping, weight_decay_groups


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(wd):
    ours, ref = _params(), _params()
    opt = AdamW([{"params": [ours[0]], "weight_decay": wd}, {"params": [ours[1]], "weight_decay": 0.0}],
                lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": wd}, {"params": [ref[1]], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, q, gr in zip(ours, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        if step == 10:  # a learning-rate change mid-run (as the schedule does)
            for o in (opt, ref_opt):
                for group in o.param_groups:
                    group["lr"] = 3e-3
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_adamw_state_dict_round_trip_continues_identically():
    a, b = _params(), _params()
    opt_a = AdamW(a, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p in a:
            p.grad = torch.ones_like(p)
        opt_a.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    opt_b = AdamW(b, lr=1e-2, weight_decay=0.1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through a file: no shared tensors
    for p, q in zip(a, b):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_adamw_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        AdamW(_params(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="learning rate"):
        AdamW(_params(), lr=-1)


def test_weight_decay_groups_by_rank():
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3, 3))
    model.gain = torch.nn.Parameter(torch.ones(3))
    model.emb = torch.nn.Parameter(torch.zeros(10, 3))
    decay, no_decay = weight_decay_groups(model.named_parameters(), 0.1)
    assert {id(p) for p in decay["params"]} == {id(model.w), id(model.emb)}
    assert [id(p) for p in no_decay["params"]] == [id(model.gain)]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_cosine_schedule_cs336_reference_values():
    expected = [0, 0.14285714285714285, 0.2857142857142857, 0.42857142857142855, 0.5714285714285714,
                0.7142857142857143, 0.8571428571428571, 1.0, 0.9887175604818206, 0.9554359905560885,
                0.9018241671106134, 0.8305704108364301, 0.7452476826029011, 0.6501344202803414, 0.55,
                0.44986557971965857, 0.3547523173970989, 0.26942958916356996, 0.19817583288938662,
                0.14456400944391146, 0.11128243951817937, 0.1, 0.1, 0.1, 0.1]
    got = [get_lr_cosine_schedule(it, 1.0, 0.1, 7, 21) for it in range(25)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_gradient_clipping_matches_torch():
    for max_norm in (0.5, 1e3):
        ours, ref = _params(), _params()
        g = torch.Generator().manual_seed(3)
        for p, q in zip(ours, ref):
            gr = torch.randn(p.shape, generator=g)
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = gradient_clipping(ours, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch.testing.assert_close(norm, ref_norm)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ours))
        assert clipped <= max_norm + 1e-4


def test_gradient_clipping_skips_params_without_grad():
    p = torch.nn.Parameter(torch.ones(3))
    assert float(gradient_clipping([p], 1.0)) == 0.0


def test_time_budget_drives_the_cosine():
    from types import SimpleNamespace

    from scratchlm.training import TrainConfig
    from scratchlm.training.trainer import Trainer

    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=1000, max_time_s=100.0)
    lr_at = lambda step, elapsed: Trainer.lr_at(SimpleNamespace(cfg=cfg), step, elapsed)  # noqa: E731
    assert lr_at(5, 50.0) == pytest.approx(0.5)  # warm-up follows steps only
    assert lr_at(20, 0.0) == pytest.approx(get_lr_cosine_schedule(20, 1.0, 0.1, 10, 1000))  # steps lead
    assert lr_at(20, 50.0) == pytest.approx(0.55)  # half the time gone: half-way down the cosine
    assert lr_at(20, 100.0) == pytest.approx(0.1) and lr_at(20, 500.0) == pytest.approx(0.1)
    untimed = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=1000)
    assert Trainer.lr_at(SimpleNamespace(cfg=untimed), 20, 1e9) == get_lr_cosine_schedule(20, 1.0, 0.1, 10, 1000)
