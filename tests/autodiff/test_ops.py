"""Every op's value and gradient against torch.autograd in float64 (the oracle), on random shapes
including broadcasting; finite differences on a sample; second-order gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scratchlm.autodiff as ad

F64 = torch.float64


def rand(*shape, positive=False, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else sum(shape) + 17 * len(shape))
    t = torch.randn(tuple(shape), dtype=F64, generator=gen)
    return t.abs() + 0.5 if positive else t


def check_op(ad_fn, torch_fn, inputs, int_inputs=(), rtol=1e-9, atol=1e-10):
    """ad_fn(*nodes) and torch_fn(*tensors) must agree in value and in the gradient of sum(out * c)."""
    nodes = [ad.Variable(f"x{i}") for i in range(len(inputs))]
    out = ad_fn(*nodes)
    ref_in = [t.clone() if i in int_inputs else t.clone().requires_grad_(True) for i, t in enumerate(inputs)]
    ref = torch_fn(*ref_in)
    cot = rand(*ref.shape, seed=7)
    c = ad.Variable("cotangent")
    diff_nodes = [n for i, n in enumerate(nodes) if i not in int_inputs]
    grads = ad.gradients(ad.sum_op(ad.mul(out, c)), diff_nodes)
    feed = dict(zip(nodes, inputs)) | {c: cot}
    value, *grad_values = ad.Evaluator([out, *grads]).run(feed)
    torch.testing.assert_close(value, ref.detach(), rtol=rtol, atol=atol)
    diff_ref = [t for i, t in enumerate(ref_in) if i not in int_inputs]
    ref_grads = torch.autograd.grad(ref, diff_ref, cot, allow_unused=True)
    for node, g, rg, t in zip(diff_nodes, grad_values, ref_grads, diff_ref):
        rg = torch.zeros_like(t) if rg is None else rg
        assert g.shape == t.shape, f"gradient of {node.name} has shape {tuple(g.shape)}, input {tuple(t.shape)}"
        torch.testing.assert_close(g, rg, rtol=rtol, atol=atol)


# (name, ad function, torch function, input shapes, positive inputs)
UNARY = [
    ("neg", ad.neg, torch.neg),
    ("relu", ad.relu, torch.relu),
    ("exp", ad.exp, torch.exp),
    ("sigmoid", ad.sigmoid, torch.sigmoid),
    ("silu", ad.silu, torch.nn.functional.silu),
    ("add_by_const", lambda x: ad.add_by_const(x, 2.5), lambda x: x + 2.5),
    ("mul_by_const", lambda x: ad.mul_by_const(x, -1.5), lambda x: x * -1.5),
    ("div_by_const", lambda x: ad.div_by_const(x, 4.0), lambda x: x / 4.0),
    ("transpose", lambda x: ad.transpose(x, 0, 2), lambda x: x.transpose(0, 2)),
    ("reshape", lambda x: ad.reshape(x, (3, -1)), lambda x: x.reshape(3, -1)),
    ("sum_all", ad.sum_op, torch.sum),
    ("sum_dim", lambda x: ad.sum_op(x, 1), lambda x: x.sum(1)),
    ("sum_dims_keep", lambda x: ad.sum_op(x, (0, 2), keepdim=True), lambda x: x.sum((0, 2), keepdim=True)),
    ("mean_all", ad.mean, torch.mean),
    ("mean_dim", lambda x: ad.mean(x, -1), lambda x: x.mean(-1)),
    ("mean_dim_keep", lambda x: ad.mean(x, 1, keepdim=True), lambda x: x.mean(1, keepdim=True)),
    ("softmax", lambda x: ad.softmax(x, -1), lambda x: torch.softmax(x, -1)),
    ("softmax_dim1", lambda x: ad.softmax(x, 1), lambda x: torch.softmax(x, 1)),
    ("log_softmax", lambda x: ad.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1)),
    ("layernorm", lambda x: ad.layernorm(x, (5,), 1e-5),
     lambda x: torch.nn.functional.layer_norm(x, (5,), eps=1e-5)),
    ("layernorm_2d", lambda x: ad.layernorm(x, (4, 5), 1e-5),
     lambda x: torch.nn.functional.layer_norm(x, (4, 5), eps=1e-5)),
    ("broadcast", lambda x: ad.broadcast(ad.sum_op(x, 0), (4, 5), (2, 4, 5)),
     lambda x: x.sum(0).expand(2, 4, 5)),
    ("causal_mask_softmax", lambda x: ad.softmax(ad.causal_mask(x), -1),
     lambda x: torch.softmax(x.masked_fill(torch.ones(4, 5, dtype=torch.bool).triu(2), float("-inf")), -1)),
    ("split_merge_heads", lambda x: ad.mul(ad.split_heads(x, 5), ad.split_heads(x, 5)),
     lambda x: x.unflatten(-1, (5, 1)) ** 2),
    ("rms_normalize", lambda x: ad.rms_normalize(x, 1e-5),
     lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
    ("rotate_pairs_adjacent", lambda x: ad.rotate_pairs(ad.reshape(x, (3, 2, 10)), "adjacent"),
     lambda x: torch.stack((-x.reshape(3, 2, 5, 2)[..., 1], x.reshape(3, 2, 5, 2)[..., 0]), -1).flatten(-2)),
    ("zeros_like", lambda x: ad.add(x, ad.zeros_like(x)), lambda x: x + 0),
    ("ones_like", lambda x: ad.mul(x, ad.ones_like(x)), lambda x: x * 1),
    ("greater", lambda x: ad.mul(x, ad.greater(x, 0.3)), lambda x: x * (x > 0.3)),
]

POSITIVE_UNARY = [
    ("sqrt", ad.sqrt, torch.sqrt),
    ("log", ad.log, torch.log),
    ("power_3", lambda x: ad.power(x, 3), lambda x: x**3),
    ("power_-0.5", lambda x: ad.power(x, -0.5), lambda x: x**-0.5),
    ("rdiv_by_const", lambda x: ad.rdiv_by_const(x, 2.0), lambda x: 2.0 / x),
]


@pytest.mark.parametrize("name,ad_fn,torch_fn", UNARY, ids=[u[0] for u in UNARY])
def test_unary_ops(name, ad_fn, torch_fn):
    check_op(ad_fn, torch_fn, [rand(3, 4, 5)])


@pytest.mark.parametrize("name,ad_fn,torch_fn", POSITIVE_UNARY, ids=[u[0] for u in POSITIVE_UNARY])
def test_positive_unary_ops(name, ad_fn, torch_fn):
    check_op(ad_fn, torch_fn, [rand(3, 4, 5, positive=True)])


BINARY = {
    "add": (ad.add, torch.add),
    "sub": (ad.sub, torch.sub),
    "mul": (ad.mul, torch.mul),
    "div": (ad.div, torch.div),
}

# Pairs of broadcast-compatible shapes: draw a target shape, then drop leading dims / set dims to 1.
shape_st = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@st.composite
def broadcast_pair(draw):
    full = draw(shape_st)
    shapes = []
    for _ in range(2):
        drop = draw(st.integers(0, len(full) - 1))
        s = [1 if draw(st.booleans()) else d for d in full[drop:]]
        shapes.append(tuple(s))
    return shapes


@pytest.mark.parametrize("op", sorted(BINARY))
@settings(max_examples=25, deadline=None)
@given(shapes=broadcast_pair())
def test_binary_broadcasting(op, shapes):
    ad_fn, torch_fn = BINARY[op]
    a, b = rand(*shapes[0], seed=1), rand(*shapes[1], positive=(op == "div"), seed=2)
    check_op(ad_fn, torch_fn, [a, b])


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)),
                                    ((2, 1, 3, 4), (5, 4, 6)), ((2, 3, 4), (2, 4, 2))])
def test_matmul_shapes_with_batch_broadcasting(shapes):
    check_op(ad.matmul, torch.matmul, [rand(*shapes[0], seed=3), rand(*shapes[1], seed=4)])


@pytest.mark.parametrize("shapes", [((6, 4), (5, 4)), ((2, 3, 4), (5, 4))])
def test_linear(shapes):
    check_op(ad.linear, torch.nn.functional.linear, [rand(*shapes[0], seed=3), rand(*shapes[1], seed=4)])
    check_op(ad.linear, torch.nn.functional.linear,
             [rand(*shapes[0], seed=3), rand(*shapes[1], seed=4), rand(shapes[1][0], seed=5)])


def test_expand_as_and_sum_to():
    check_op(lambda x, y: ad.mul(ad.expand_as(x, y), y), lambda x, y: x.expand_as(y) * y, [rand(4, 1), rand(3, 4, 5)])
    check_op(lambda x, y: ad.sum_to(x, y), lambda x, y: x.sum(0).sum(-1, keepdim=True) + 0 * y,
             [rand(3, 4, 5), rand(4, 1)])
    check_op(lambda x, y: ad.reshape_as(x, y), lambda x, y: x.reshape(y.shape) + 0 * y, [rand(3, 4), rand(2, 6)])


def test_greater_between_nodes():
    check_op(lambda a, b: ad.mul(a, ad.greater(a, b)), lambda a, b: a * (a > b), [rand(3, 4), rand(4)])


def test_matmul_layernorm_and_softmax_fused():
    a, b = rand(2, 3, 4, seed=1), rand(4, 6, seed=2)
    check_op(lambda x, y: ad.matmul_layernorm(x, y, (6,), 1e-5),
             lambda x, y: torch.nn.functional.layer_norm(x @ y, (6,), eps=1e-5), [a, b])
    check_op(lambda x, y: ad.matmul_softmax(x, y, -1), lambda x, y: torch.softmax(x @ y, -1), [a, b])


def test_embedding_gather_scatter_add():
    weight = rand(7, 3)
    ids = torch.tensor([[1, 3, 1], [6, 0, 1]])  # repeated ids must accumulate
    check_op(ad.embedding, lambda w, i: w[i], [weight, ids], int_inputs=(1,))


def test_cross_entropy_integer_targets():
    logits = rand(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(0))
    check_op(ad.cross_entropy, lambda x, t: torch.nn.functional.cross_entropy(x.reshape(-1, 7), t.reshape(-1)),
             [logits, targets], int_inputs=(1,))


def test_rmsnorm_with_weight():
    check_op(lambda x, w: ad.rmsnorm(x, w, 1e-6),
             lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, [rand(2, 3, 8), rand(8)])


def _rope_ref(x, cos, sin, layout):
    # reference formulas written out pair by pair
    if layout == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        c, s = cos[..., :h], sin[..., :h]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    p = x.unflatten(-1, (-1, 2))
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack((p[..., 0] * c - p[..., 1] * s, p[..., 0] * s + p[..., 1] * c), -1).flatten(-2)


@pytest.mark.parametrize("layout", ["adjacent", "half"])
def test_rotary(layout):
    cos, sin = ad.rotary_tables(torch.arange(5), 8, 10000.0, layout, dtype=F64)  # (5, 1, 8)
    check_op(lambda x, c, s: ad.rotary(x, c, s, layout), lambda x, c, s: _rope_ref(x, c, s, layout),
             [rand(2, 5, 3, 8), cos, sin], int_inputs=(1, 2))


def test_rotary_cos_sin_gradients():
    # the tables are graph inputs too: their gradients (summed over broadcast dims) must be right
    check_op(lambda x, c, s: ad.rotary(x, c, s, "half"),
             lambda x, c, s: x * c + torch.cat((-x[..., 4:], x[..., :4]), -1) * s,
             [rand(2, 5, 3, 8), rand(5, 1, 8, seed=5), rand(5, 1, 8, seed=6)])


def test_repeat_kv_matches_repeat_interleave():
    check_op(lambda x: ad.repeat_kv(x, 3), lambda x: x.repeat_interleave(3, dim=-2), [rand(2, 4, 2, 5)])


# --------------------------------------------------------------------------------------------- finite differences
@pytest.mark.parametrize("name", ["softmax", "layernorm", "silu", "log_softmax", "rms_normalize", "sigmoid"])
def test_finite_differences(name):
    fn = dict((u[0], u[1]) for u in UNARY)[name]
    x = ad.Variable("x")
    c = rand(3, 4, 5, seed=11)
    cn = ad.Variable("c")
    loss = ad.sum_op(ad.mul(fn(x), cn))
    (grad,) = ad.gradients(loss, [x])
    run = ad.Evaluator([loss, grad])
    x0 = rand(3, 4, 5, seed=12)
    _, g = run.run({x: x0, cn: c})
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        idx = tuple(int(torch.randint(0, s, (1,), generator=gen)) for s in x0.shape)
        eps = 1e-6
        xp, xm = x0.clone(), x0.clone()
        xp[idx] += eps
        xm[idx] -= eps
        fd = (run.run({x: xp, cn: c})[0] - run.run({x: xm, cn: c})[0]) / (2 * eps)
        assert math.isclose(float(fd), float(g[idx]), rel_tol=1e-5, abs_tol=1e-8), (name, idx, float(fd), float(g[idx]))


# --------------------------------------------------------------------------------------------- second order
SECOND_ORDER = {
    "mul": (lambda a, b: ad.mul(ad.mul(a, b), a), lambda a, b: a * b * a, [(3, 4), (4,)]),
    "div": (lambda a, b: ad.div(a, b), lambda a, b: a / b, [(3, 4), (3, 4)]),
    "exp": (lambda a: ad.exp(ad.mul(a, a)), lambda a: torch.exp(a * a), [(3, 4)]),
    "matmul": (lambda a, b: ad.matmul(ad.matmul(a, b), ad.transpose(b, 0, 1)), lambda a, b: a @ b @ b.T,
               [(3, 4), (4, 5)]),
    "softmax": (lambda a: ad.softmax(a, -1), lambda a: torch.softmax(a, -1), [(3, 4)]),
    "layernorm": (lambda a: ad.layernorm(a, (4,), 1e-5),
                  lambda a: torch.nn.functional.layer_norm(a, (4,), eps=1e-5), [(3, 4)]),
    "log_softmax": (lambda a: ad.log_softmax(a, -1), lambda a: torch.log_softmax(a, -1), [(3, 4)]),
    "silu": (lambda a: ad.silu(a), torch.nn.functional.silu, [(3, 4)]),
    "rms_normalize": (lambda a: ad.rms_normalize(a, 1e-5),
                      lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5), [(3, 4)]),
    "matmul_softmax": (lambda a, b: ad.matmul_softmax(a, b), lambda a, b: torch.softmax(a @ b, -1), [(3, 4), (4, 5)]),
    "matmul_layernorm": (lambda a, b: ad.matmul_layernorm(a, b, (5,)),
                         lambda a, b: torch.nn.functional.layer_norm(a @ b, (5,)), [(3, 4), (4, 5)]),
    "cross_entropy": (lambda a, t: ad.cross_entropy(a, t),
                      lambda a, t: torch.nn.functional.cross_entropy(a, t), [(3, 4), "targets"]),
}


@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_second_order(name):
    """Hessian-vector products: grad of sum(grad(sum(f * c)) * v) against torch.autograd with create_graph."""
    ad_fn, torch_fn, shapes = SECOND_ORDER[name]
    ints = {i for i, s in enumerate(shapes) if s == "targets"}
    vals = [torch.tensor([0, 3, 1]) if s == "targets" else rand(*s, seed=20 + i) for i, s in enumerate(shapes)]
    if name == "div":
        vals[1] = vals[1].abs() + 0.5
    nodes = [ad.Variable(f"x{i}") for i in range(len(vals))]
    diff = [n for i, n in enumerate(nodes) if i not in ints]
    out = ad_fn(*nodes)
    ref_in = [v if i in ints else v.clone().requires_grad_(True) for i, v in enumerate(vals)]
    ref_out = torch_fn(*ref_in)
    c = rand(*ref_out.shape, seed=30)
    vs = [rand(*vals[i].shape, seed=40 + i) for i in range(len(vals)) if i not in ints]
    cn, vn = ad.Variable("c"), [ad.Variable(f"v{i}") for i in range(len(vs))]
    first = ad.gradients(ad.sum_op(ad.mul(out, cn)), diff)
    hvp_scalar = first[0] * vn[0]
    hvp_scalar = ad.sum_op(hvp_scalar)
    for g, v in zip(first[1:], vn[1:]):
        hvp_scalar = ad.add(hvp_scalar, ad.sum_op(ad.mul(g, v)))
    second = ad.gradients(hvp_scalar, diff)
    feed = dict(zip(nodes, vals)) | {cn: c} | dict(zip(vn, vs))
    got = ad.Evaluator(second).run(feed)
    diff_ref = [t for i, t in enumerate(ref_in) if i not in ints]
    ref_first = torch.autograd.grad(ref_out, diff_ref, c, create_graph=True)
    ref_scalar = sum((g * v).sum() for g, v in zip(ref_first, vs))
    ref_second = torch.autograd.grad(ref_scalar, diff_ref, allow_unused=True)
    for g, r, t in zip(got, ref_second, diff_ref):
        r = torch.zeros_like(t) if r is None else r
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)
    assert any(float(r.abs().max()) > 1e-6 for r in ref_second if r is not None), "test must exercise curvature"


def test_third_order_exp_chain():
    x = ad.Variable("x")
    y = ad.exp(ad.mul_by_const(x, 2.0))  # d^3/dx^3 = 8 exp(2x)
    g = y
    for _ in range(3):
        (g,) = ad.gradients(ad.sum_op(g), [x])
    x0 = rand(4)
    torch.testing.assert_close(ad.Evaluator([g]).run({x: x0})[0], 8 * torch.exp(2 * x0))


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_reductions_on_random_shapes_and_dims(shape, data):
    nd = len(shape)
    dims = data.draw(st.lists(st.integers(-nd, nd - 1), min_size=1, max_size=nd, unique_by=lambda d: d % nd))
    keep = data.draw(st.booleans())
    x = rand(*shape, seed=9)
    check_op(lambda a: ad.sum_op(a, tuple(dims), keep), lambda a: a.sum(tuple(dims), keepdim=keep), [x])
    check_op(lambda a: ad.mean(a, tuple(dims), keep), lambda a: a.mean(tuple(dims), keepdim=keep), [x])


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_normalisations_on_random_shapes(shape, data):
    x = rand(*shape, seed=10)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_op(lambda a: ad.softmax(a, dim), lambda a: torch.softmax(a, dim), [x])
    check_op(lambda a: ad.log_softmax(a, dim), lambda a: torch.log_softmax(a, dim), [x])
    n = data.draw(st.integers(1, len(shape)))
    norm = tuple(shape[-n:])
    check_op(lambda a: ad.layernorm(a, norm, 1e-5), lambda a: torch.nn.functional.layer_norm(a, norm, eps=1e-5), [x],
             rtol=1e-7, atol=1e-8)
