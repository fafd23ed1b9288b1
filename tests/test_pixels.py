"""Contracts of the pixels-from-features pipeline: the split at the attacked layer, its context,
the per-sample upstream gradients, the quickstart models, ``invert_features`` and the
baselines."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_attack.model.split import feature_extractor, layer_context
from fl_attack.pixels import (
    PixelConfig,
    feature_gradients,
    invert_features,
    output_gradients,
)
from fl_attack.pixels.terms import gradient_mismatch
from fl_attack.testbed import baselines, cnn, models

pytestmark = pytest.mark.usefixtures("one_thread")


class TanhHead(nn.Module):
    """fc1 followed by tanh: outside what SPEAR's ReLU argument covers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(torch.flatten(F.relu(self.conv(x)), 1))))


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return F.relu(self.fc1(x))


def linear_stack(seed: int = 0) -> nn.Sequential:
    """An injective linear conv stack, no pooling: its first three output channels are the
    image itself (identity centre taps), so the features determine the pixels and the feature
    objective is strictly convex."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(3, 6, 3, padding=1)
    with torch.no_grad():
        conv.weight[:3].zero_()
        conv.bias[:3].zero_()
        for c in range(3):
            conv.weight[c, c, 1, 1] = 1.0
    return nn.Sequential(conv, nn.Flatten(), nn.Linear(6 * 8 * 8, 5))


# --- split ------------------------------------------------------------------------------------


def test_extractor_returns_exactly_fc1_inputs() -> None:
    model = cnn.build("quickstart", seed=0)
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        manual = model.pool(F.relu(model.conv2(model.pool(F.relu(model.conv1(x))))))
        got = feature_extractor(model, "fc1.weight")(x)
    assert got.shape == (4, 400)
    assert torch.equal(got, manual.reshape(4, -1))


def test_extractor_on_an_mlp_matches_the_layer_inputs() -> None:
    mlp = models.relu_mlp(12, 7, 3, seed=1)
    x = torch.randn(5, 12)
    got = feature_extractor(mlp, "3.weight")(x).detach()
    assert torch.equal(got, models.layer_inputs(mlp, x, layer=1))


def test_extractor_keeps_the_graph_to_images_and_parameters() -> None:
    model = cnn.build("quickstart", seed=0)
    x = torch.rand(2, 3, 32, 32, requires_grad=True)
    feats = feature_extractor(model, "fc1.weight")(x)
    gx, gw = torch.autograd.grad(feats.sum(), [x, model.conv1.weight])
    assert gx.abs().sum() > 0 and gw.abs().sum() > 0


@pytest.mark.parametrize("key", ["conv1.weight", "fc9.weight", "fc1.bias"])
def test_extractor_rejects_what_is_not_a_linear_weight(key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        feature_extractor(cnn.build("quickstart", seed=0), key)


def test_layer_context_relu_tanh_norm_and_untraceable() -> None:
    quick = layer_context(cnn.build("quickstart", seed=0), "fc1.weight")
    assert (quick.relu_after, quick.norm_before, quick.traced) == (True, False, True)
    tanh = layer_context(TanhHead(), "fc1.weight")
    assert tanh.relu_after is False and tanh.after == "tanh"
    normed = nn.Sequential(nn.Conv2d(3, 2, 3), nn.BatchNorm2d(2), nn.Flatten(),
                           nn.Linear(2 * 30 * 30, 4), nn.ReLU())
    ctx = layer_context(normed, "3.weight")
    assert ctx.norm_before is True and ctx.relu_after is True
    branchy = layer_context(Branchy(), "fc1.weight")
    assert branchy.traced is False and branchy.relu_after is None
    with pytest.raises(ValueError, match="conv1.weight"):
        layer_context(cnn.build("quickstart", seed=0), "conv1.weight")


# --- upstream gradients -----------------------------------------------------------------------


def test_output_and_feature_gradients_from_exact_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    d = torch.randn(6, 15, generator=gen, dtype=torch.float64)
    w = torch.randn(15, 40, generator=gen, dtype=torch.float64)
    g = d.T @ x  # the weight gradient Σ_i dZ_i x_iᵀ
    assert torch.allclose(output_gradients(g, x), d, atol=1e-10)
    assert torch.allclose(feature_gradients(0.1 * g, x, w), 0.1 * d @ w, atol=1e-10)


def test_gradient_mismatch_vanishes_at_the_truth_only() -> None:
    stack = linear_stack()
    extractor = feature_extractor(stack, "2.weight")
    x = torch.rand(3, 3, 8, 8)
    upstream = torch.randn(3, 384)
    params = [stack[0].weight, stack[0].bias]
    observed = torch.autograd.grad(extractor(x), params, grad_outputs=upstream)
    norms = [o.pow(2).sum() for o in observed]
    at_truth = gradient_mismatch(extractor(x.repeat(2, 1, 1, 1)), upstream, params, observed,
                                 norms)
    assert at_truth.shape == (2,) and float(at_truth.detach().max()) < 1e-10
    off = gradient_mismatch(extractor(x + 0.1), upstream, params, observed, norms)
    assert float(off.detach()) > 1e-4


# --- models -----------------------------------------------------------------------------------


def test_quickstart_net_is_flowers_net() -> None:
    model = cnn.build("quickstart", seed=0)
    assert list(model.state_dict()) == [
        "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
        "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert cnn.build("wide", seed=0).fc1.in_features == 4096
    assert torch.equal(cnn.build("quickstart", seed=3).fc1.weight,
                       cnn.build("quickstart", seed=3).fc1.weight)


def test_fedsgd_step_is_lr_times_the_gradient() -> None:
    model = cnn.build("quickstart", seed=0)
    x = cnn.quickstart_normalize(torch.rand(4, 3, 32, 32))
    y = torch.tensor([0, 1, 2, 3])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    view = cnn.fedsgd_step(model, x, y, lr=0.1)
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    for (key, _), g in zip(model.named_parameters(), grads, strict=True):
        assert torch.allclose(view.update(key), 0.1 * g.double(), atol=1e-6)
        assert torch.equal(model.state_dict()[key], before[key])  # the model is not modified


def test_quickstart_train_is_seeded() -> None:
    model = cnn.build("quickstart", seed=0)
    x, y = torch.rand(20, 3, 32, 32) * 2 - 1, torch.randint(0, 10, (20,))
    a = cnn.quickstart_train(model, x, y, batch_size=8, seed=1)
    b = cnn.quickstart_train(model, x, y, batch_size=8, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc1.weight"], model.state_dict()["fc1.weight"])


# --- invert_features --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """QuickstartNet, three images and their fc1 features."""
    model = cnn.build("quickstart", seed=0)
    x = torch.rand(3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        feats = feature_extractor(model, "fc1.weight")(x)
    return model, x, feats


def test_invert_features_shapes_box_and_terms(quick_case) -> None:
    model, _, feats = quick_case
    lo, hi = (-1.0, -0.5, 0.0), (1.0, 0.5, 0.25)
    out = invert_features(feats, feature_extractor(model, "fc1.weight"), input_shape=(3, 32, 32),
                          bounds=(lo, hi), restarts=2, max_seconds=60,
                          config=PixelConfig(steps=3))
    assert out.images.shape == (3, 3, 32, 32) and out.images.dtype == torch.float32
    assert out.feature_residual.shape == (3,) and out.chosen.shape == (3,)
    for c in range(3):
        assert float(out.images[:, c].min()) >= lo[c] and float(out.images[:, c].max()) <= hi[c]
    assert out.restarts == 2 and out.steps == 9 and not out.budget_exhausted
    assert out.terms == ("features", "box", "multiscale", "tv")


def test_invert_features_respects_the_budget(quick_case) -> None:
    model, _, feats = quick_case
    start = time.perf_counter()
    out = invert_features(feats, feature_extractor(model, "fc1.weight"), input_shape=(3, 32, 32),
                          bounds=(-1, 1), max_seconds=0.6, restarts=2)
    assert time.perf_counter() - start < 0.6 + 1.0  # ten steps between looks at the clock
    assert out.budget_exhausted and out.steps > 0


def test_invert_features_is_deterministic_for_a_seed(quick_case) -> None:
    model, _, feats = quick_case
    extractor = feature_extractor(model, "fc1.weight")
    cfg = PixelConfig(steps=4)

    def run(seed: int) -> torch.Tensor:
        return invert_features(feats, extractor, input_shape=(3, 32, 32), bounds=(-1, 1),
                               seed=seed, restarts=2, max_seconds=60, config=cfg).images

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_invert_features_rejects_bad_arguments(quick_case) -> None:
    model, _, feats = quick_case
    extractor = feature_extractor(model, "fc1.weight")
    kwargs = {"input_shape": (3, 32, 32), "max_seconds": 1.0}
    with pytest.raises(ValueError, match="lo < hi"):
        invert_features(feats, extractor, bounds=(1, -1), **kwargs)
    with pytest.raises(ValueError, match="together"):
        invert_features(feats, extractor, bounds=(-1, 1), upstream=torch.zeros_like(feats),
                        **kwargs)
    with pytest.raises(ValueError, match="no matching parameter"):
        invert_features(feats, extractor, bounds=(-1, 1), upstream=torch.zeros_like(feats),
                        param_grads={"conv1.weight": torch.zeros(1)}, **kwargs)


def test_identifiable_pixels_are_recovered() -> None:
    """An injective linear stack (features contain the pixels): the feature objective is
    strictly convex with the true images as its only minimiser, so Adam must get there."""
    stack = linear_stack()
    extractor = feature_extractor(stack, "2.weight")
    truth = torch.rand(2, 3, 8, 8) * 1.6 - 0.8
    with torch.no_grad():
        feats = extractor(truth)
    cfg = PixelConfig(scales=(1,), tv=0.0, tv_end=0.0, steps=400)
    out = invert_features(feats, extractor, input_shape=(3, 8, 8), bounds=(-1, 1), restarts=1,
                          max_seconds=60, config=cfg)
    assert float((out.images - truth).abs().max()) < 1e-3
    assert float(out.feature_residual.max()) < 1e-3


def test_gradient_term_runs_with_known_upstream() -> None:
    stack = linear_stack()
    extractor = feature_extractor(stack, "2.weight")
    truth = torch.rand(2, 3, 8, 8) * 1.6 - 0.8
    upstream = torch.randn(2, 384)
    feats = extractor(truth)
    grads = torch.autograd.grad(feats, [stack[0].weight], grad_outputs=upstream)
    cfg = PixelConfig(scales=(2, 1), gradient=1.0, gradient_from=0, steps=3)
    out = invert_features(feats.detach(), extractor, input_shape=(3, 8, 8), bounds=(-1, 1),
                          upstream=upstream, param_grads={"0.weight": grads[0]}, restarts=2,
                          max_seconds=60, config=cfg)
    assert "gradient" in out.terms and out.images.shape == (2, 3, 8, 8)


# --- baselines --------------------------------------------------------------------------------


def test_baselines_shapes_box_and_budget() -> None:
    model = cnn.build("quickstart", seed=0)
    x = cnn.quickstart_normalize(torch.rand(2, 3, 32, 32))
    y = torch.tensor([1, 4])
    view = cnn.fedsgd_step(model, x, y)
    update = {k: view.update(k).float() for k in view.before}
    out = baselines.gradient_matching(model, update, y, input_shape=(3, 32, 32),
                                      bounds=(-1.0, 1.0), max_seconds=0.5, restarts=2)
    assert out.images.shape == (2, 3, 32, 32) and out.steps > 0 and out.seconds < 3
    assert float(out.images.abs().max()) <= 1.0
    mean = baselines.batch_mean(x)
    assert mean.shape == x.shape and torch.allclose(mean[0], x.mean(0))
