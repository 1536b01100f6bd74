"""The graph API (CSE234 PA1 shape), the evaluator's errors, the iterative topological sort, and the
rule that the engine never calls torch.autograd."""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest
import torch

import scratchlm.autodiff as ad

F64 = torch.float64


def test_node_fields_and_variable():
    x, y = ad.Variable("x"), ad.Variable("y")
    z = x + y
    assert z.inputs == [x, y] and z.op is ad.add and isinstance(z.attrs, dict) and z.name == "(x+y)"
    assert x.inputs == [] and x.op is ad.placeholder and x.name == "x"
    assert ad.add_by_const(x, 3).attrs["constant"] == 3


@pytest.mark.parametrize(
    "expr,ref",
    [
        (lambda x, y: x + y, lambda x, y: x + y),
        (lambda x, y: x + 2, lambda x, y: x + 2),
        (lambda x, y: 2 + x, lambda x, y: 2 + x),
        (lambda x, y: x - y, lambda x, y: x - y),
        (lambda x, y: x - 3, lambda x, y: x - 3),
        (lambda x, y: 3 - x, lambda x, y: 3 - x),
        (lambda x, y: x * y, lambda x, y: x * y),
        (lambda x, y: x * 1.5, lambda x, y: x * 1.5),
        (lambda x, y: 1.5 * x, lambda x, y: 1.5 * x),
        (lambda x, y: x / y, lambda x, y: x / y),
        (lambda x, y: x / 4, lambda x, y: x / 4),
        (lambda x, y: 4 / y, lambda x, y: 4 / y),
        (lambda x, y: -x, lambda x, y: -x),
        (lambda x, y: y**2, lambda x, y: y**2),
        (lambda x, y: 2**x, lambda x, y: 2**x),
        (lambda x, y: y**x, lambda x, y: y**x),
        (lambda x, y: x @ ad.transpose(y, 0, 1), lambda x, y: x @ y.T),
    ],
)
def test_operator_overloads_value_and_gradient(expr, ref):
    x, y = ad.Variable("x"), ad.Variable("y")
    xv = torch.randn(3, 4, dtype=F64)
    yv = torch.rand(3, 4, dtype=F64) + 0.5
    out = expr(x, y)
    gx, gy = ad.gradients(ad.sum_op(out), [x, y])
    v, gxv, gyv = ad.Evaluator([out, gx, gy]).run({x: xv, y: yv})
    xr, yr = xv.clone().requires_grad_(), yv.clone().requires_grad_()
    r = ref(xr, yr)
    rx, ry = torch.autograd.grad(r.sum(), [xr, yr], allow_unused=True)
    torch.testing.assert_close(v, r.detach())
    torch.testing.assert_close(gxv, rx if rx is not None else torch.zeros_like(xv))
    torch.testing.assert_close(gyv, ry if ry is not None else torch.zeros_like(yv))


def test_bad_operand_types_are_clear():
    x = ad.Variable("x")
    with pytest.raises(TypeError, match="expected a Node or a Python int/float"):
        _ = x + "a"
    with pytest.raises(TypeError, match="feed tensors through a Variable"):
        _ = x * torch.ones(2)
    with pytest.raises(TypeError, match="@ needs a Node"):
        _ = x @ 2


def test_missing_input_is_named():
    x, w, b = ad.Variable("x"), ad.Variable("weight"), ad.Variable("bias")
    ev = ad.Evaluator([x @ w + b])
    with pytest.raises(ValueError, match=r"no value fed for Variable\(s\) \['weight', 'bias'\]"):
        ev.run({x: torch.ones(2, 2)})


def test_shape_mismatch_names_op_and_shapes():
    x, w = ad.Variable("x"), ad.Variable("w")
    ev = ad.Evaluator([ad.matmul(x, w)])
    with pytest.raises(ad.GraphRunError, match=r"op 'matmul'.*\[\(2, 3\) float32, \(4, 5\) float32\].*inner"):
        ev.run({x: torch.ones(2, 3), w: torch.ones(4, 5)})
    ev = ad.Evaluator([x + w])
    with pytest.raises(ad.GraphRunError, match=r"op 'add'.*\(2, 3\).*\(4, 5\)"):
        ev.run({x: torch.ones(2, 3), w: torch.ones(4, 5)})


def test_cross_entropy_target_errors():
    logits, t = ad.Variable("logits"), ad.Variable("t")
    ev = ad.Evaluator([ad.cross_entropy(logits, t)])
    with pytest.raises(ad.GraphRunError, match="targets must lie in"):
        ev.run({logits: torch.zeros(2, 3), t: torch.tensor([0, 3])})
    with pytest.raises(ad.GraphRunError, match="integer"):
        ev.run({logits: torch.zeros(2, 3), t: torch.tensor([0.0, 1.0])})


def test_chain_of_100k_nodes():
    x = ad.Variable("x")
    y = x
    for _ in range(100_000):
        y = y + 1.0
    assert len(y.name) <= 80
    order = ad.topological_sort([y])
    assert len(order) == 100_001 and order[0] is x and order[-1] is y
    (g,) = ad.gradients(y, [x])
    out, gv = ad.Evaluator([y, g]).run({x: torch.zeros(3)})
    torch.testing.assert_close(out, torch.full((3,), 100_000.0))
    torch.testing.assert_close(gv, torch.ones(3))


def test_topological_order_on_a_dag():
    a, b = ad.Variable("a"), ad.Variable("b")
    c = a * b
    d = c + a
    e = d * c
    order = ad.topological_sort([e])
    pos = {n: i for i, n in enumerate(order)}
    for n in order:
        for inp in n.inputs:
            assert pos[inp] < pos[n]
    assert len(order) == len(set(order)) == 5


def test_weight_gradient_through_broadcast_has_weight_shape():
    x, w, b = ad.Variable("x"), ad.Variable("w"), ad.Variable("b")
    loss = ad.sum_op(ad.relu(x @ w + b))
    gw, gb = ad.gradients(loss, [w, b])
    xv, wv, bv = torch.randn(2, 5, 3, 4), torch.randn(4, 6), torch.randn(6)
    gwv, gbv = ad.Evaluator([gw, gb]).run({x: xv, w: wv, b: bv})
    assert gwv.shape == (4, 6) and gbv.shape == (6,)
    mask = ((xv @ wv + bv) > 0).float()
    torch.testing.assert_close(gbv, mask.sum((0, 1, 2)))


def test_gradients_are_graphs_and_unrelated_nodes_get_zeros():
    x, y = ad.Variable("x"), ad.Variable("y")
    z = x * x
    gx, gy = ad.gradients(z, [x, y])
    assert isinstance(gx, ad.Node) and isinstance(gy, ad.Node)
    (gxx,) = ad.gradients(gx, [x])
    vals = ad.Evaluator([gx, gy, gxx]).run({x: torch.tensor([3.0]), y: torch.tensor([1.0, 2.0])})
    torch.testing.assert_close(vals[0], torch.tensor([6.0]))
    torch.testing.assert_close(vals[1], torch.zeros(2))
    torch.testing.assert_close(vals[2], torch.tensor([2.0]))


def test_feeding_an_intermediate_node_overrides_it():
    x = ad.Variable("x")
    h = ad.exp(x)
    y = h * 2
    assert float(ad.Evaluator([y]).run({x: torch.tensor(0.0), h: torch.tensor(5.0)})[0]) == 10.0


def test_constant_node():
    x = ad.Variable("x")
    c = ad.constant(torch.tensor([1.0, 2.0]), "c")
    (g,) = ad.gradients(ad.sum_op(x * c), [x])
    torch.testing.assert_close(ad.Evaluator([g]).run({x: torch.ones(2)})[0], torch.tensor([1.0, 2.0]))


def _code_tokens(path: Path) -> str:
    """The source without comments and strings (docstrings may mention autograd)."""
    with path.open("rb") as f:
        toks = [t for t in tokenize.tokenize(f.readline) if t.type not in (tokenize.COMMENT, tokenize.STRING)]
    return " ".join(t.string for t in toks)


def test_engine_never_uses_torch_autograd():
    src = Path(ad.__file__).parent
    pattern = re.compile(r"autograd|\.\s*backward\s*\(|requires_grad|enable_grad|grad_fn")
    offenders = [p.name for p in src.rglob("*.py") if pattern.search(_code_tokens(p))]
    assert not offenders, f"torch.autograd used inside the engine: {offenders}"
    assert pattern.search("torch . autograd . grad ( y , x )")  # the check itself can fire


def test_engine_output_carries_no_autograd_graph():
    x = ad.Variable("x")
    (g,) = ad.gradients(ad.sum_op(ad.softmax(x, -1) * x), [x])
    out = ad.Evaluator([g]).run({x: torch.randn(3, 4)})[0]
    assert out.grad_fn is None and not out.requires_grad
