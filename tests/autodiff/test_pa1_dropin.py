"""`scratchlm.autodiff` as a drop-in for CSE234 PA1's `auto_diff` module.

Written in PA1's calling conventions (`import ... as auto_diff`, `Variable(name=...)`, direct
`node.op.compute(node, [values])`, `node.op.gradient(node, grad_node)` whose list is fed to an `Evaluator`,
`Node(inputs=..., op=..., attrs=..., name=...)` in user-written ops, attribute access such as `node.constant`),
with our own cases; torch.autograd is the gradient oracle.
"""

from __future__ import annotations

import re

import pytest
import torch

import scratchlm.autodiff as auto_diff

ad = auto_diff
F64 = torch.float64


def rand(*shape, seed=0, positive=False):
    t = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return t.abs() + 0.5 if positive else t


def check_compute_output(node, input_values, expected_output):
    output = node.op.compute(node, input_values)
    torch.testing.assert_close(output, expected_output, atol=1e-8, rtol=1e-8)


def check_evaluator_output(evaluator, input_values, expected_outputs):
    output_values = evaluator.run(input_values)
    assert len(output_values) == len(expected_outputs)
    for output_val, expected_val in zip(output_values, expected_outputs):
        torch.testing.assert_close(output_val, expected_val, atol=1e-8, rtol=1e-8)


def torch_vjp(fn, inputs, grad):
    """The oracle: d(fn)/d(inputs) contracted with `grad`, by torch.autograd."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return list(torch.autograd.grad(out, leaves, grad, allow_unused=True, materialize_grads=True))


# ----------------------------------------------------------------------------------------------- Variable, Node
def test_variable_is_a_class_and_callable_with_name():
    x = auto_diff.Variable(name="x")
    assert isinstance(x, auto_diff.Variable)
    assert isinstance(x, auto_diff.Node)
    assert x.inputs == [] and x.op is auto_diff.placeholder and x.name == "x"
    y = auto_diff.add(x, x)
    assert not isinstance(y, auto_diff.Variable)
    # placeholder(name) gives the same kind of node
    assert isinstance(auto_diff.placeholder("p"), auto_diff.Variable)


def test_node_attributes_forward_to_attrs():
    x = ad.Variable("x")
    y = ad.add_by_const(x, 2.5)
    assert y.constant == 2.5 and y.attrs["constant"] == 2.5
    s = ad.sum_op(x, dim=(1,), keepdim=True)
    assert s.keepdim is True and tuple(s.dim) == (1,)
    ln = ad.layernorm(x, normalized_shape=[3], eps=1e-3)
    assert ln.eps == 1e-3 and list(ln.normalized_shape) == [3]
    t = ad.transpose(x, 1, 0)
    assert (t.dim0, t.dim1) == (1, 0)
    assert not hasattr(y, "no_such_attr")
    with pytest.raises(AttributeError, match="no_such_attr"):
        _ = y.no_such_attr
    with pytest.raises(KeyError):  # PA1's Node.__getattr__ raises KeyError; code catching that still works
        _ = y.no_such_attr


class CubeOp(ad.Op):
    """A user-written op in PA1's style: it builds its Node with keyword arguments."""

    def __call__(self, node_A, scale):
        return ad.Node(inputs=[node_A], op=self, attrs={"scale": scale}, name=f"Cube({node_A.name})")

    def compute(self, node, input_values):
        assert len(input_values) == 1
        return node.scale * input_values[0] ** 3

    def gradient(self, node, output_grad):
        x = node.inputs[0]
        return [output_grad * ad.mul_by_const(x * x, 3.0 * node.scale)]


def test_user_written_op_in_pa1_style():
    cube = CubeOp()
    x, w = ad.Variable("x"), ad.Variable("w")
    y = ad.sum_op(cube(ad.matmul(x, w), 0.5), dim=(0, 1))
    xv, wv = rand(3, 4, seed=1), rand(4, 2, seed=2)
    gx, gw = ad.gradients(y, [x, w])
    out = ad.Evaluator([y, gx, gw]).run({x: xv, w: wv})
    ref = torch_vjp(lambda a, b: (0.5 * (a @ b) ** 3).sum(), [xv, wv], torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(out[0], (0.5 * (xv @ wv) ** 3).sum())
    torch.testing.assert_close(out[1], ref[0])
    torch.testing.assert_close(out[2], ref[1])


PA1_OP_CLASSES = {
    "PlaceholderOp": "placeholder", "AddOp": "add", "AddByConstOp": "add_by_const", "MulOp": "mul",
    "MulByConstOp": "mul_by_const", "DivOp": "div", "DivByConstOp": "div_by_const", "SubOp": "sub",
    "GreaterThanOp": "greater", "ZerosLikeOp": "zeros_like", "OnesLikeOp": "ones_like", "SumOp": "sum_op",
    "MeanOp": "mean", "ExpandAsOp": "expand_as", "ExpandAsOp3d": "expand_as_3d", "BroadcastOp": "broadcast",
    "LogOp": "log", "TransposeOp": "transpose", "MatMulOp": "matmul", "SoftmaxOp": "softmax",
    "LayerNormOp": "layernorm", "ReLUOp": "relu", "SqrtOp": "sqrt", "PowerOp": "power",
    "MatMulLayerNormOp": "matmul_layernorm", "MatMulSoftmaxOp": "matmul_softmax",
}


@pytest.mark.parametrize("cls_name", sorted(PA1_OP_CLASSES))
def test_pa1_op_classes_exported_at_top_level(cls_name):
    cls = getattr(ad, cls_name)
    assert issubclass(cls, ad.Op)
    assert isinstance(getattr(ad, PA1_OP_CLASSES[cls_name]), cls)


def test_fused_ops_and_auto_diff_modules_like_pa1():
    """PA1's two module names: `auto_diff` has every name of scratchlm.autodiff, with PA1's layernorm instances."""
    from scratchlm.autodiff import auto_diff as pa1
    from scratchlm.autodiff.fused_ops import matmul_layernorm, matmul_softmax

    assert matmul_softmax is ad.matmul_softmax
    assert matmul_layernorm is pa1.matmul_layernorm and isinstance(matmul_layernorm, ad.MatMulLayerNormOp)
    assert not matmul_layernorm.strict_shape and ad.matmul_layernorm.strict_shape
    assert isinstance(pa1.layernorm, ad.LayerNormOp) and not pa1.layernorm.strict_shape and ad.layernorm.strict_shape
    assert set(ad.__all__) <= set(pa1.__all__)
    assert all(getattr(pa1, n) is getattr(ad, n) for n in ad.__all__ if n not in ("layernorm", "matmul_layernorm"))


# ----------------------------------------------------------------------------------------------- fused ops
FUSED_CASES = [
    ("layernorm_2d", lambda a, b: ad.matmul_layernorm(a, b, normalized_shape=[5]),
     lambda a, b: torch.nn.functional.layer_norm(a @ b, [5]), (4, 3), (3, 5)),
    ("layernorm_3d", lambda a, b: ad.matmul_layernorm(a, b, normalized_shape=[6], eps=1e-3),
     lambda a, b: torch.nn.functional.layer_norm(a @ b, [6], eps=1e-3), (2, 4, 3), (2, 3, 6)),
    ("layernorm_2_dims", lambda a, b: ad.matmul_layernorm(a, b, normalized_shape=[4, 5]),
     lambda a, b: torch.nn.functional.layer_norm(a @ b, [4, 5]), (2, 4, 3), (3, 5)),
    ("softmax_2d", lambda a, b: ad.matmul_softmax(a, b, dim=-1),
     lambda a, b: torch.softmax(a @ b, -1), (4, 3), (3, 5)),
    ("softmax_3d_dim1", lambda a, b: ad.matmul_softmax(a, b, dim=1),
     lambda a, b: torch.softmax(a @ b, 1), (2, 4, 3), (2, 3, 6)),
]


@pytest.mark.parametrize("name,fused,ref,sa,sb", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_compute_takes_exactly_two_inputs(name, fused, ref, sa, sb):
    x1, x2 = ad.Variable("x1"), ad.Variable("x2")
    y = fused(x1, x2)
    assert y.inputs == [x1, x2]
    av, bv = rand(*sa, seed=3), rand(*sb, seed=4)
    check_compute_output(y, [av, bv], ref(av, bv))
    check_evaluator_output(ad.Evaluator([y]), {x1: av, x2: bv}, [ref(av, bv)])


@pytest.mark.parametrize("name,fused,ref,sa,sb", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_gradient_returns_two_nodes_matching_autograd(name, fused, ref, sa, sb):
    x1, x2, y_grad = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("y_grad")
    y = fused(x1, x2)
    grads = y.op.gradient(y, y_grad)
    assert len(grads) == 2 and all(isinstance(g, ad.Node) for g in grads)
    av, bv = rand(*sa, seed=5), rand(*sb, seed=6)
    gv = rand(*ref(av, bv).shape, seed=7)
    expected = torch_vjp(ref, [av, bv], gv)
    check_evaluator_output(ad.Evaluator(grads), {x1: av, x2: bv, y_grad: gv}, expected)
    # the same through ad.gradients on a scalar loss, and against the unfused pair
    ga, gb = ad.gradients(ad.sum_op(y * y_grad), [x1, x2])
    check_evaluator_output(ad.Evaluator([ga, gb]), {x1: av, x2: bv, y_grad: gv}, expected)


def test_fused_layernorm_gradient_when_its_value_is_fed():
    """The saved statistics are an optimisation only: overriding the fused node's value still gives
    the right gradient (the backward recomputes what it needs)."""
    x1, x2, y_grad = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("y_grad")
    y = ad.matmul_layernorm(x1, x2, normalized_shape=[5])
    av, bv, gv = rand(4, 3, seed=8), rand(3, 5, seed=9), rand(4, 5, seed=10)
    yv = torch.nn.functional.layer_norm(av @ bv, [5])
    expected = torch_vjp(lambda a, b: torch.nn.functional.layer_norm(a @ b, [5]), [av, bv], gv)
    check_evaluator_output(ad.Evaluator(y.op.gradient(y, y_grad)), {x1: av, x2: bv, y_grad: gv, y: yv.clone()},
                           expected)


def test_fused_shape_checks_stay_strict():
    x1, x2 = ad.Variable("x1"), ad.Variable("x2")
    y = ad.matmul_layernorm(x1, x2, normalized_shape=[3])  # A @ B is (3, 4): the trailing dim is 4, not 3
    with pytest.raises(ValueError, match=r"normalized_shape \(3,\) does not match .*auto_diff"):
        y.op.compute(y, [rand(3, 3), rand(3, 4)])
    with pytest.raises(ValueError, match=r"normalized_shape \(3,\) does not match"):
        ad.layernorm.compute(ad.layernorm(x1, [3]), [rand(3, 4)])
    with pytest.raises(ValueError, match="inner dimensions"):
        y.op.compute(y, [rand(3, 2), rand(3, 3)])


# ----------------------------------------------------------------------------------------------- PA1's mismatch
# PA1's public fused-op tests pass normalized_shape=[3] for a (3, 3) @ (3, 4) product and compare the fused op with
# its own unfused layernorm, both normalising over the last dim. Our cases of that kind, torch as the oracle.
MISMATCH_CASES = [  # (A shape, B shape, normalized_shape, the trailing dims really normalised)
    ((3, 3), (3, 4), [3], [4]),
    ((2, 4, 3), (3, 6), [5, 7], [4, 6]),
    ((2, 5, 3), (2, 3, 4), [-1], [4]),  # PA1's staff once tried [-1] for "the last dim"
]


@pytest.mark.parametrize("sa,sb,declared,real", MISMATCH_CASES)
def test_pa1_interface_normalises_the_last_dims_with_a_warning(sa, sb, declared, real):
    from scratchlm.autodiff import auto_diff as pa1
    from scratchlm.autodiff.fused_ops import matmul_layernorm

    x1, x2, g = pa1.Variable("x1"), pa1.Variable("x2"), pa1.Variable("g")
    fused = matmul_layernorm(x1, x2, normalized_shape=declared)
    separate = pa1.layernorm(pa1.matmul(x1, x2), normalized_shape=declared)
    av, bv = rand(*sa, seed=30), rand(*sb, seed=31)

    def ref(a, b):
        return torch.nn.functional.layer_norm(a @ b, real)

    want = ref(av, bv)
    gv = rand(*want.shape, seed=32)
    expected = torch_vjp(ref, [av, bv], gv)
    shown = re.escape(f"normalized_shape {tuple(declared)} does not match the trailing dims {tuple(real)}")
    for node in (fused, separate):
        with pytest.warns(pa1.NormalizedShapeWarning, match=shown):
            check_evaluator_output(pa1.Evaluator([node]), {x1: av, x2: bv}, [want])
        with pytest.warns(pa1.NormalizedShapeWarning):
            grads = pa1.gradients(pa1.sum_op(node * g), [x1, x2])
            check_evaluator_output(pa1.Evaluator(grads), {x1: av, x2: bv, g: gv}, expected)
    with pytest.warns(pa1.NormalizedShapeWarning):
        check_compute_output(fused, [av, bv], want)
        check_evaluator_output(pa1.Evaluator(fused.op.gradient(fused, g)), {x1: av, x2: bv, g: gv}, expected)


def test_pa1_interface_still_refuses_what_no_layernorm_means():
    from scratchlm.autodiff import auto_diff as pa1

    x = pa1.Variable("x")
    with pytest.raises(ValueError, match=r"normalized_shape \(3, 3, 3\) needs 1 to 2 dims"):
        pa1.Evaluator([pa1.layernorm(x, [3, 3, 3])]).run({x: rand(3, 3)})


# ----------------------------------------------------------------------------------------------- fused backward
def _fused_as_torch_function(make):
    """A torch.autograd.Function whose forward and backward are the ad graph's (so torch.autograd.gradcheck can
    compare our backward with finite differences)."""
    x1, x2, g = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("g")
    y = make(x1, x2)
    ga, gb = y.op.gradient(y, g)

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return ad.Evaluator([y]).run({x1: a, x2: b})[0]

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return tuple(ad.Evaluator([ga, gb]).run({x1: a, x2: b, g: grad}))

    return Fused.apply


@pytest.mark.parametrize("name,fused,ref,sa,sb", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_backward_by_hand_passes_gradcheck(name, fused, ref, sa, sb):
    """float64, torch.autograd.gradcheck's finite differences (its default tolerances) against our backward."""
    a = rand(*sa, seed=40).requires_grad_(True)
    b = rand(*sb, seed=41).requires_grad_(True)
    assert torch.autograd.gradcheck(_fused_as_torch_function(fused), (a, b))


@pytest.mark.parametrize("name,fused,ref,sa,sb", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_ops_run_no_aten_backward_kernel(name, fused, ref, sa, sb):
    """The backward is written out by hand: no native_layer_norm(_backward), _softmax(_backward_data) runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x1, x2, g = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("g")
    y = fused(x1, x2)
    av, bv = rand(*sa, seed=42), rand(*sb, seed=43)
    with Record() as rec:
        yv = ad.Evaluator([y]).run({x1: av, x2: bv})[0]
        ad.Evaluator(y.op.gradient(y, g)).run({x1: av, x2: bv, g: torch.ones_like(yv)})
    assert "mm" in rec.ops or "bmm" in rec.ops  # the recorder sees the graph's ops
    assert not rec.ops & {"native_layer_norm", "native_layer_norm_backward", "_softmax_backward_data"}, rec.ops


# ----------------------------------------------------------------------------------------------- gradient lists
def _gradient_cases():
    x1, x2, ids, t = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("ids"), ad.Variable("targets")
    feed = {x1: rand(3, 4, seed=11), x2: rand(3, 4, seed=12), ids: torch.tensor([[0, 2, 1], [3, 3, 0]]),
            t: torch.tensor([0, 3, 1])}
    w = ad.Variable("w")
    feed[w] = rand(4, 4, seed=13)
    cases = [
        ad.greater(x1, x2), ad.greater(x1, 0.0), ad.zeros_like(x1), ad.ones_like(x1), ad.power(x1, 0),
        ad.reshape_as(x1, x2), ad.sum_to(x1, x2), ad.expand_as(ad.sum_op(x1, dim=(0,), keepdim=True), x2),
        ad.embedding(w, ids), ad.cross_entropy(x1, t),
        ad.relu(x1), ad.matmul_layernorm(x1, w, normalized_shape=[4]), ad.matmul_softmax(x1, w, dim=-1),
    ]
    return cases, feed


def test_every_gradient_entry_is_a_node_that_an_evaluator_can_run():
    cases, feed = _gradient_cases()
    for y in cases:
        g = ad.Variable("g")
        yv = ad.Evaluator([y]).run(feed)[0]
        grads = y.op.gradient(y, g)
        assert len(grads) == len(y.inputs), y.name
        assert all(isinstance(n, ad.Node) for n in grads), f"{y.name}: {grads}"
        values = ad.Evaluator(grads).run(feed | {g: torch.ones_like(yv)})
        inputs = ad.Evaluator(y.inputs).run(feed)
        for v, inp in zip(values, inputs):
            assert v.shape == inp.shape, y.name


def test_zero_gradients_are_zeros_like_nodes():
    x1, x2, g = ad.Variable("x1"), ad.Variable("x2"), ad.Variable("g")
    y = ad.greater(x1, x2)
    grads = y.op.gradient(y, g)
    assert [n.op for n in grads] == [ad.zeros_like, ad.zeros_like] and grads[0].inputs == [x1]
    a, b = rand(2, 3, seed=14), rand(2, 3, seed=15)
    check_evaluator_output(ad.Evaluator(grads), {x1: a, x2: b, g: torch.ones(2, 3, dtype=F64)},
                           [torch.zeros_like(a), torch.zeros_like(b)])


def test_expand_as_3d():
    x, like, g = ad.Variable("x"), ad.Variable("like"), ad.Variable("g")
    y = ad.expand_as_3d(x, like)
    xv, lv, gv = rand(2, 4, seed=16), rand(2, 3, 4, seed=17), rand(2, 3, 4, seed=18)
    check_compute_output(y, [xv, lv], xv.unsqueeze(1).expand_as(lv))
    gx, glike = y.op.gradient(y, g)
    check_evaluator_output(ad.Evaluator([gx, glike]), {x: xv, like: lv, g: gv}, [gv.sum(1), torch.zeros_like(lv)])


# ----------------------------------------------------------------------------------------------- a PA1-style graph
def test_pa1_style_graph_gradients_match_autograd():
    """One attention-like layer from PA1's op set, differentiated w.r.t. every input."""
    X, Wq, Wk, Wv, W1 = (ad.Variable(name=n) for n in ("X", "Wq", "Wk", "Wv", "W1"))
    q, k, v = ad.matmul(X, Wq), ad.matmul(X, Wk), ad.matmul(X, Wv)
    scores = ad.div_by_const(ad.matmul(q, ad.transpose(k, -1, -2)), 2.0)
    att = ad.matmul(ad.softmax(scores, dim=-1), v)
    h = ad.matmul_layernorm(att, W1, normalized_shape=[4])
    h = ad.relu(h) + ad.sqrt(ad.power(h, 2) + 1.0) / 3.0
    loss = ad.mean(ad.sum_op(h * h, dim=(1, 2)), dim=(0,))
    grads = ad.gradients(loss, [X, Wq, Wk, Wv, W1])
    vals = [rand(2, 5, 4, seed=20), rand(4, 4, seed=21), rand(4, 4, seed=22), rand(4, 4, seed=23),
            rand(4, 4, seed=24)]

    def ref(x, wq, wk, wv, w1):
        att = torch.softmax((x @ wq) @ (x @ wk).transpose(-1, -2) / 2.0, -1) @ (x @ wv)
        h = torch.nn.functional.layer_norm(att @ w1, [4])
        h = torch.relu(h) + torch.sqrt(h**2 + 1.0) / 3.0
        return (h * h).sum((1, 2)).mean(0)

    expected = torch_vjp(ref, vals, torch.tensor(1.0, dtype=F64))
    check_evaluator_output(ad.Evaluator(eval_nodes=grads), dict(zip([X, Wq, Wk, Wv, W1], vals)), expected)


def test_missing_input_is_a_value_error():
    x, y = ad.Variable("x"), ad.Variable("y")
    with pytest.raises(ValueError, match="y"):
        ad.Evaluator(eval_nodes=[x + y]).run(input_values={x: torch.ones(2)})
