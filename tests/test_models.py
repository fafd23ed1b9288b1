"""The attacked ReLU MLPs and the layer gradients a FedSGD client shares."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_attack.testbed import data
from fl_attack.testbed.models import (
    first_layer_gradients,
    layer_gradients,
    layer_inputs,
    linear_layers,
    relu_mlp,
)


@pytest.fixture(scope="module")
def photos():
    x, y = data.sample_batch("photos32", 10, seed=11)
    return data.normalize(x, "photos32"), y


def test_relu_mlp_structure():
    model = relu_mlp(3072, 200)
    kinds = [type(m) for m in model]
    assert kinds == [nn.Flatten] + [nn.Linear, nn.ReLU] * 3 + [nn.Linear]
    lins = linear_layers(model)
    assert [tuple(lin.weight.shape) for lin in lins] == [
        (200, 3072),
        (200, 200),
        (200, 200),
        (10, 200),
    ]
    assert all(lin.bias is not None for lin in lins)
    assert len(linear_layers(relu_mlp(784, 50, depth=5, num_classes=2))) == 6
    with pytest.raises(ValueError, match="depth"):
        relu_mlp(784, 50, depth=0)


def test_relu_mlp_seeded_and_global_rng_untouched(photos):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = relu_mlp(3072, 64, seed=5)
    assert torch.equal(torch.rand(3), expected)  # the seeded build used a private RNG state
    b = relu_mlp(3072, 64, seed=5)
    c = relu_mlp(3072, 64, seed=6)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    x, _ = photos
    assert a(x).shape == (10, 10)
    assert torch.equal(a(x), a(data.flatten(x)))  # images or flat rows


def test_layer_gradients_match_manual_autograd(photos):
    x, y = photos
    model = relu_mlp(3072, 200, seed=0)
    for layer in (0, 2, -1):
        gw, gb = layer_gradients(model, x, y, layer=layer)
        assert all(p.grad is None for p in model.parameters())  # nothing left on the model
        assert gw.dtype == torch.float32 and not gw.requires_grad
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        lin = linear_layers(model)[layer]
        assert torch.allclose(gw, lin.weight.grad, rtol=1e-5, atol=1e-8)
        assert torch.allclose(gb, lin.bias.grad, rtol=1e-5, atol=1e-8)
        model.zero_grad(set_to_none=True)
    gw0, gb0 = first_layer_gradients(model, x, y)
    gw, gb = layer_gradients(model, x, y, layer=0)
    assert torch.equal(gw0, gw) and torch.equal(gb0, gb)
    with torch.no_grad():  # works even when called under no_grad
        gw1, _ = layer_gradients(model, x, y)
    assert torch.equal(gw1, gw)


def test_first_layer_gradient_has_rank_batch_size(photos):
    """dW = dZ^T X: rank B, rows in the span of the B real images (SPEAR's starting point)."""
    x, y = photos
    model = relu_mlp(3072, 200, seed=1).double()
    gw, gb = layer_gradients(model, x, y, dtype=torch.float64)
    assert gw.shape == (200, 3072) and gb.shape == (200,)
    assert int(torch.linalg.matrix_rank(gw)) == 10
    # the float32 gradient has rank 10 up to float32 rounding
    gw32, _ = layer_gradients(model.float(), x, y)
    assert int(torch.linalg.matrix_rank(gw32.double(), rtol=1e-5)) == 10
    # rows of dW lie in the row space of X
    X = data.flatten(x).double()
    proj = gw @ torch.linalg.pinv(X) @ X
    assert torch.allclose(proj, gw, atol=1e-10 * float(gw.abs().max()))


def test_layer_inputs(photos):
    x, y = photos
    model = relu_mlp(3072, 200, seed=2)
    z0 = layer_inputs(model, x, 0)
    assert torch.equal(z0, data.flatten(x))
    z1 = layer_inputs(model, x, 1)
    lin0 = linear_layers(model)[0]
    assert z1.shape == (10, 200)
    assert torch.allclose(z1, torch.relu(lin0(data.flatten(x))).detach())
    assert float(z1.min()) == 0.0 and 0.1 < float((z1 == 0).double().mean()) < 0.9
    assert not z1.requires_grad
    # the hook is removed again
    assert all(not lin._forward_pre_hooks for lin in linear_layers(model))


def test_bad_arguments(photos):
    x, y = photos
    model = relu_mlp(3072, 20, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        layer_gradients(model, x, y, layer=4)
    with pytest.raises(ValueError, match="loss"):
        layer_gradients(model, x, y, loss="mse")
    with pytest.raises(ValueError, match="labels"):
        layer_gradients(model, x, y[:3])
    with pytest.raises(ValueError, match="out of range"):
        layer_inputs(model, x, 7)
