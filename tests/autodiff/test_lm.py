"""The project's TransformerLM as an ad graph: loss and every parameter gradient against torch.autograd
on the module (float64), and the `--engine autodiff` hook of the trainer tracking the torch run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import scratchlm.model.layers as layers
from scratchlm.autodiff.lm import build_lm_graph, lm_parameter_names, model_params
from scratchlm.autodiff.training import AutodiffEngine, loss_and_grads
from scratchlm.model import ModelConfig, TransformerLM

CONFIGS = {
    "tied_half_mha": dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, rope_layout="half"),
    "untied_adjacent_gqa_bias": dict(vocab_size=53, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                                     rope_layout="adjacent", tie_embeddings=False, qkv_bias=True),
    "untied_nope": dict(vocab_size=47, d_model=32, n_layers=1, n_heads=4, rope_layout="none", tie_embeddings=False),
}


def _model(name: str, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(max_seq_len=16, **CONFIGS[name])).double()
    with torch.no_grad():  # move norms and biases off their init so their gradients are generic
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(vocab: int, seed: int = 1, b: int = 3, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


class _Float64RMSNorm:
    """The module's RMSNorm runs in float32 by design; for a float64 oracle we run its math in float64."""

    @staticmethod
    def apply(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _torch_reference(model, x, y):
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_lm_graph_loss_and_every_gradient_match_autograd_float64(name, monkeypatch):
    model = _model(name)
    monkeypatch.setattr(layers, "_RMSNormFunction", _Float64RMSNorm)
    x, y = _batch(model.config.vocab_size)
    ref_loss, ref_grads = _torch_reference(model, x, y)
    graph = build_lm_graph(model.config)
    assert sorted(graph.params) == sorted(n for n, _ in model.named_parameters())
    assert lm_parameter_names(model.config) == [n for n, _ in model.named_parameters()]
    loss, grads = graph.loss_and_grads(model_params(model), x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():
        assert grads[n].shape == g.shape, n
        torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=n)
    logits = graph.logits_value(model_params(model), x)
    torch.testing.assert_close(logits, model(x).detach(), rtol=1e-9, atol=1e-9)


def test_lm_graph_matches_unmodified_module_to_float32_precision():
    model = _model("untied_adjacent_gqa_bias", seed=3)  # its RMSNorm and loss compute in float32
    x, y = _batch(model.config.vocab_size, seed=4)
    ref_loss, ref_grads = _torch_reference(model, x, y)
    loss, grads = build_lm_graph(model.config).loss_and_grads(model_params(model), x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=n)


def test_graph_is_shape_dynamic_and_positions_are_honoured(monkeypatch):
    model = _model("tied_half_mha")
    monkeypatch.setattr(layers, "_RMSNormFunction", _Float64RMSNorm)
    graph = build_lm_graph(model.config, with_grads=False)
    params = model_params(model)
    for b, t in [(1, 3), (2, 11)]:
        x, _ = _batch(model.config.vocab_size, b=b, t=t)
        torch.testing.assert_close(graph.logits_value(params, x), model(x).detach(), rtol=1e-7, atol=1e-7)
    x, _ = _batch(model.config.vocab_size, b=2, t=5)
    pos = torch.tensor([0, 2, 3, 7, 8])  # uneven gaps: RoPE only sees relative offsets
    shifted = graph.logits_value(params, x, positions=pos)
    torch.testing.assert_close(shifted, model(x, positions=pos).detach(), rtol=1e-7, atol=1e-7)
    assert not torch.allclose(shifted, graph.logits_value(params, x))


def test_engine_accumulates_scaled_gradients_into_param_grad():
    model = _model("tied_half_mha").float()
    x, y = _batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    engine = AutodiffEngine()
    loss1 = engine(model, x, y, 0.5)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss2 = loss_and_grads(model, x, y, 0.5)  # second call accumulates, like loss.backward()
    assert loss1.dtype == torch.float32 and float(loss1) == pytest.approx(float(loss2))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n])
    ref_loss, ref_grads = _torch_reference(model, x, y)
    for n, g in ref_grads.items():
        torch.testing.assert_close(first[n], 0.5 * g, rtol=2e-4, atol=2e-6, msg=n)
    with pytest.raises(TypeError, match="needs a scratchlm TransformerLM"):
        engine(torch.nn.Linear(2, 2), x, y, 1.0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised by torch's own import of torch._dynamo
def test_engine_unwraps_compiled_model_and_ignores_autocast():
    model = _model("tied_half_mha").float()
    x, y = _batch(model.config.vocab_size)
    AutodiffEngine()(model, x, y, 1.0)
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)  # lazy: nothing is compiled unless it is called, and the engine never calls it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = AutodiffEngine()(compiled, x, y, 1.0)
    assert loss.dtype == torch.float32
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_trainer_engine_autodiff_tracks_torch_loss_curve(data_dir, tmp_path):
    from scratchlm.training import TrainConfig
    from scratchlm.training.trainer import Trainer
    from tests.training.corpus import byte_corpus

    train, val = byte_corpus(data_dir, tmp_path / "corpus")
    model = {"d_model": 32, "n_layers": 2, "n_heads": 4, "rope_layout": "adjacent"}

    def run(engine):
        cfg = TrainConfig(train_data=train, val_data=val, out_dir=tmp_path / engine, batch_size=8, context_length=32,
                          max_steps=15, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=0, log_every=1,
                          checkpoint_every=0, progress=False, sample_tokens=0, seed=7, threads=1, engine=engine)
        return Trainer(cfg, model).train().losses

    torch_losses, ad_losses = run("torch"), run("autodiff")
    assert len(ad_losses) == 15 and ad_losses[-1] < ad_losses[0] - 0.5  # it learns
    np.testing.assert_allclose(ad_losses, torch_losses, rtol=2e-4, atol=2e-4)
