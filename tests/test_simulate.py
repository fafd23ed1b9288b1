"""Local training of one client (fl_attack.testbed.simulate) and the server's update pair (updates).

Real data: a batch of 8 real photo crops (``photos32``), normalised, on a small float64 ReLU MLP so
that ranks and exact identities can be checked to float64 precision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fl_attack.errors import ZeroUpdate
from fl_attack.model.updates import layer_keys, weight_update_pair
from fl_attack.testbed.data import normalize, sample_batch
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import PROTOCOLS, local_update, noise_multiplier_for_std

B = 8
LR = 0.05
WIDTH = 64


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = sample_batch("photos32", B, seed=3)
    return normalize(x, "photos32").double(), y


def _model(seed: int = 0) -> nn.Sequential:
    return relu_mlp(3 * 32 * 32, WIDTH, depth=2, num_classes=10, seed=seed).double()


def _delta(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() - state[k] for k, v in model.state_dict().items()}


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of the mean cross-entropy w.r.t. every parameter, by autograd."""
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _numerical_rank(a: torch.Tensor, rtol: float = 1e-9) -> int:
    s = torch.linalg.svdvals(a)
    return int((s > rtol * s[0]).sum())


def test_fedsgd_delta_is_lr_times_gradient(batch):
    x, y = batch
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = local_update(model, x, y, protocol="fedsgd", lr=LR)
    assert res.steps == 1 and res.num_examples == B and res.epsilon is None
    # the caller's model is untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    grads = _grads(model, x, y)
    delta = _delta(model, res.state_dict)
    for k, g in grads.items():
        torch.testing.assert_close(delta[k], LR * g, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("batch_size, steps", [(None, 5), (4, 10)])
def test_fedavg_first_layer_delta_has_rank_at_most_batch(batch, batch_size, steps):
    x, y = batch
    model = _model()
    res = local_update(model, x, y, protocol="fedavg", lr=LR, epochs=5, batch_size=batch_size)
    assert res.steps == steps
    dw, db, w0, b0 = weight_update_pair(model.state_dict(), res.state_dict)
    assert dw.shape == (WIDTH, 3 * 32 * 32) and db.shape == (WIDTH,)
    rank = _numerical_rank(dw)
    assert 1 < rank <= B
    # the rows of dW lie in the span of the batch (W0 - W_E = lr sum_e G_e X^T)
    xf = x.reshape(B, -1)
    coef = torch.linalg.lstsq(xf.T, dw.T).solution
    torch.testing.assert_close(xf.T @ coef, dw.T, rtol=0, atol=1e-10 * dw.abs().max().item())
    # deterministic for a seed; a different shuffle changes mini-batch training
    again = local_update(model, x, y, protocol="fedavg", lr=LR, epochs=5, batch_size=batch_size)
    assert all(torch.equal(v, again.state_dict[k]) for k, v in res.state_dict.items())
    if batch_size is not None:
        other = local_update(
            model, x, y, protocol="fedavg", lr=LR, epochs=5, batch_size=batch_size, seed=1
        )
        assert not torch.equal(other.state_dict["1.weight"], res.state_dict["1.weight"])


def test_dpsgd_clipping_only_scales_per_sample_gradients(batch):
    x, y = batch
    model = _model()
    per_sample = [_grads(model, x[i : i + 1], y[i : i + 1]) for i in range(B)]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gs.values())) for gs in per_sample])
    clip = float(norms.median())  # some samples clipped, some not
    # c_i = min(1, C / ||g_i||), with the 1e-6 Opacus adds to the norm (opacus DPOptimizer)
    factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
    assert (factors < 1).any() and (factors == 1).any()

    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = local_update(model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip)
    # Opacus worked on a copy: the caller's model keeps its weights and carries no hooks
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert res.steps == 1 and res.epsilon == math.inf and res.noise_std == 0.0
    delta = _delta(model, res.state_dict)
    for k in delta:
        expected = LR * sum(c * gs[k] for c, gs in zip(factors, per_sample, strict=True)) / B
        scale = expected.abs().max().item()
        torch.testing.assert_close(delta[k], expected, rtol=1e-9, atol=1e-12 * scale)


def test_dpsgd_noise_is_seeded_accounted_and_of_the_stated_size(batch):
    x, y = batch
    model = _model()
    clip, nm = 1.0, 0.5
    base = local_update(model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip)
    noisy = local_update(
        model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip, noise_multiplier=nm, seed=7
    )
    same = local_update(
        model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip, noise_multiplier=nm, seed=7
    )
    other = local_update(
        model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip, noise_multiplier=nm, seed=8
    )
    assert noisy.epsilon is not None and math.isfinite(noisy.epsilon) and noisy.epsilon > 0
    assert noisy.delta == 1e-5
    assert noisy.noise_std == pytest.approx(nm * clip / B)
    assert noise_multiplier_for_std(noisy.noise_std, clip, B) == pytest.approx(nm)
    for k, v in noisy.state_dict.items():
        assert torch.equal(v, same.state_dict[k]), k
    w = "1.weight"
    assert not torch.equal(noisy.state_dict[w], other.state_dict[w])
    # noise on the averaged gradient has std noise_std (64 x 3072 entries: estimate within 2%)
    noise = (base.state_dict[w] - noisy.state_dict[w]) / LR
    assert noise.std().item() == pytest.approx(noisy.noise_std, rel=0.02)
    # more noise -> less epsilon; mini-batches -> more steps, at sample rate b / N
    quieter = local_update(
        model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip, noise_multiplier=2 * nm
    )
    assert quieter.epsilon < noisy.epsilon
    mini = local_update(
        model, x, y, protocol="dpsgd", lr=LR, max_grad_norm=clip, noise_multiplier=nm,
        epochs=2, batch_size=4,
    )
    assert mini.steps == 4 and mini.noise_std == pytest.approx(nm * clip / 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"protocol": "fedprox"}, "unknown protocol"),
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"protocol": "dpsgd"}, "max_grad_norm"),
        ({"protocol": "dpsgd", "max_grad_norm": 1.0, "noise_multiplier": -1.0}, "noise_mult"),
        ({"protocol": "fedavg", "noise_multiplier": 1.0}, "only used by protocol='dpsgd'"),
        ({"protocol": "fedsgd", "epochs": 3}, "fedsgd"),
        ({"protocol": "fedavg", "batch_size": 0}, "batch_size"),
        ({"protocol": "dpsgd", "max_grad_norm": 1.0, "delta": 0.0}, "delta"),
    ],
)
def test_bad_arguments_raise(batch, kwargs, match):
    x, y = batch
    with pytest.raises(ValueError, match=match):
        local_update(_model(), x, y, **kwargs)


def test_bad_data_raise(batch):
    x, y = batch
    model = _model()
    with pytest.raises(ValueError, match="lengths differ"):
        local_update(model, x, y[:-1])
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        local_update(model, bad, y)
    with pytest.raises(ValueError, match="non-finite"):
        local_update(model, x * float("inf"), y)
    assert PROTOCOLS == ("fedsgd", "fedavg", "dpsgd")


# --------------------------------------------------------------------------- updates


def test_weight_update_pair_from_relu_mlp_states(batch):
    x, y = batch
    model = relu_mlp(3 * 32 * 32, WIDTH, depth=2, num_classes=10, seed=1)  # float32
    keys = layer_keys(model.state_dict())
    assert keys[0] == ("1.weight", "1.bias") and len(keys) == 3
    res = local_update(model, x.float(), y, protocol="fedsgd", lr=LR)
    dw, db, w0, b0 = weight_update_pair(model.state_dict(), res.state_dict)
    assert all(t.dtype == torch.float64 for t in (dw, db, w0, b0))
    assert torch.equal(w0, model.state_dict()["1.weight"].double())
    grads = _grads(model, x.float(), y)
    torch.testing.assert_close(dw, LR * grads["1.weight"].double(), rtol=1e-3, atol=1e-8)
    torch.testing.assert_close(db, LR * grads["1.bias"].double(), rtol=1e-3, atol=1e-8)
    # any layer by key, numpy states (what a Flower ArrayRecord converts to)
    as_np = {k: v.numpy() for k, v in res.state_dict.items()}
    dw2, db2, _, _ = weight_update_pair(model.state_dict(), as_np, weight_key="3.weight")
    assert dw2.shape == (WIDTH, WIDTH) and db2.shape == (WIDTH,)


def test_weight_update_pair_errors():
    g = {"0.weight": torch.ones(4, 3), "0.bias": torch.zeros(4)}
    n = {"0.weight": torch.full((4, 3), 0.5), "0.bias": torch.ones(4)}
    dw, db, _, _ = weight_update_pair(g, n)
    assert torch.equal(dw, torch.full((4, 3), 0.5, dtype=torch.float64))
    assert torch.equal(db, -torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="'2.weight'"):
        weight_update_pair(g, n, weight_key="2.weight")
    with pytest.raises(ValueError, match="'0.bias'"):
        weight_update_pair(g, {"0.weight": n["0.weight"]})
    with pytest.raises(ValueError, match="shape mismatch"):
        weight_update_pair(g, {**n, "0.weight": torch.ones(4, 2)})
    with pytest.raises(ValueError, match="non-finite"):
        weight_update_pair(g, {**n, "0.bias": torch.tensor([1.0, np.nan, 0.0, 0.0])})
    with pytest.raises(ZeroUpdate, match="unchanged") as unchanged:
        weight_update_pair(g, {k: v.clone() for k, v in g.items()})
    assert unchanged.value.part == "update"
    with pytest.raises(ZeroUpdate, match="only the bias changed") as bias_only:
        weight_update_pair(g, {**g, "0.bias": torch.ones(4)})
    assert bias_only.value.part == "weight"
    with pytest.raises(ValueError, match="no linear layer"):
        weight_update_pair({"w": torch.ones(3)}, {"w": torch.ones(3)})
