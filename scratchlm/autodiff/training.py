"""The trainer's gradient engine backed by this package (`scratchlm train --engine autodiff`).

`scratchlm.training.engines` defines the contract: ``loss_and_grads(model, x, y, loss_scale) -> loss``
accumulates d(loss * loss_scale)/d(param) into ``param.grad`` and returns the detached float32 loss.
Here the loss and every gradient come from the LM's ad graph (`scratchlm.autodiff.lm`); torch.autograd
is not involved.
"""

from __future__ import annotations

import torch

from .lm import LMGraph, build_lm_graph, model_params


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The TransformerLM inside `torch.compile(...)` (`_orig_mod`) or DistributedDataParallel (`module`)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None:
            return model
        model = inner


class AutodiffEngine:
    """Keeps one LM graph per model config, so the graph is built once and reused every step.

    The graph computes in the parameters' dtype: an enclosing autocast region is switched off for it.
    """

    def __init__(self) -> None:
        self._graphs: dict[str, LMGraph] = {}

    def graph_for(self, model: torch.nn.Module) -> LMGraph:
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"the autodiff engine needs a scratchlm TransformerLM (with .config), "
                            f"got {type(model).__name__}")
        key = repr(config)
        if key not in self._graphs:
            self._graphs[key] = build_lm_graph(config)
        return self._graphs[key]

    def __call__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_scale: float) -> torch.Tensor:
        model = unwrap_model(model)
        graph = self.graph_for(model)
        with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
            params = model_params(model)
            loss, grads = graph.loss_and_grads(params, x, y)
            # a gradient tensor may be handed over as .grad unless it shares memory with a fed tensor
            taken = {t.untyped_storage().data_ptr() for t in (*params.values(), x, y)}
            for name, param in model.named_parameters():
                g = grads[name].to(param.dtype)
                if param.grad is not None:
                    param.grad.add_(g, alpha=loss_scale)
                    continue
                if loss_scale != 1.0:
                    g = g * loss_scale
                elif g.untyped_storage().data_ptr() in taken:
                    g = g.clone()
                taken.add(g.untyped_storage().data_ptr())
                param.grad = g
        return loss.detach().float()


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """One call of the engine contract; builds the graph for this call (use `AutodiffEngine` to reuse it)."""
    return AutodiffEngine()(model, x, y, loss_scale)
