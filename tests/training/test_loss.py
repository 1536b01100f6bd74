import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.training import cross_entropy


def test_matches_torch_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 50, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (4, 7), generator=g)
    ours = cross_entropy(logits, targets)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1))
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_grad, ref_grad, atol=1e-7, rtol=1e-6)


def test_stable_for_huge_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [5e3, 5e3, 0.0]], requires_grad=True)
    targets = torch.tensor([1, 0])
    loss = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.double(), targets)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-3)
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_gradcheck_double():
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (6,))
    # the loss reduces in float32 internally; gradcheck with float32-sized tolerances
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, targets).double(), (logits,), eps=1e-3, atol=1e-3)


def test_bfloat16_logits_give_float32_loss_and_bf16_grad():
    logits = torch.randn(8, 32).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 32, (8,))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), targets), atol=1e-5, rtol=1e-5)


def test_shape_mismatch_is_a_clear_error():
    try:
        cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    except ValueError as e:
        assert "targets of shape (2, 3)" in str(e)
    else:
        raise AssertionError("expected ValueError")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6), v=st.integers(2, 20), scale=st.floats(0.01, 200.0), seed=st.integers(0, 2**16),
)
def test_property_matches_torch(n, v, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    loss = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits, targets)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4 * max(1.0, scale / 10))
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
