"""The activation step (``fl_attack.steps.activations``) on a trained model's update: the
samples are the points of the layer's row space whose activations the next layer's gradient
holds, and what the step derives from a point is exact at the samples.

Built from the (784, 200, 200, 200, 10) MLP trained 300 SGD steps on real MNIST digits
(``tests.test_trained_models``), on a fresh batch of 20.
"""

from __future__ import annotations

import pytest
import torch

from fl_attack.config import AttackConfig
from fl_attack.core.columns import normalize_columns
from fl_attack.steps import activations, peel
from fl_attack.steps.decompose import decompose
from fl_attack.steps.scale import make_system
from fl_attack.steps.tolerances import output_tolerances, rank_floor
from fl_attack.testbed import data, models
from tests.conftest import compute_output_grad
from tests.test_trained_models import mnist_model  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def update(mnist_model):  # noqa: F811 (the fixture)
    """The first two layers' gradients of a fresh batch of 20 through the model trained 300
    steps, its decomposition and products, the next layer's activation span, and the true
    samples, columns and points."""
    model = models.relu_mlp(784, 200, 3)
    model.load_state_dict(mnist_model[300])
    x, y = data.load_images("mnist", 3020, seed=0)
    xn = data.normalize(x[-20:], "mnist")
    G, g = models.first_layer_gradients(model, xn, y[-20:])
    G2 = models.layer_gradients(model, xn, y[-20:], layer=1)[0]
    lin = models.linear_layers(model)[0]
    W, b = lin.weight.detach().double(), lin.bias.detach().double()
    dec = decompose(G.double(), floor_rtol=rank_floor(torch.float32))
    assert dec.batch_size == 20  # the situation: every sample above the rounding
    zero_rtol, z_band = output_tolerances(dec, AttackConfig(), torch.float32,
                                          torch.device("cpu"))
    system = make_system(dec.L, dec.R, g.double(), W, b, zero_rtol, z_band, subset=False)
    rows2 = peel.next_layer_rows(G2, 20, rank_floor(torch.float32), any_rank=True)
    assert rows2 is not None
    span = rows2.T
    frame = activations.row_frame(dec.R, system.WR)
    X = xn.reshape(20, -1).double()
    coords = torch.linalg.lstsq(dec.R.T, X.T).solution  # (B, B): x_i = Rᵀ c_i
    points = (frame.from_L @ coords).T  # (B, B) the samples in the frame
    inactive = (X @ W.T + b) <= 0  # (B, m)
    D = compute_output_grad(model, xn, y[-20:]).double()  # (m, B)
    truth = normalize_columns(dec.L.T @ D)  # (B, B) the true columns in L's coordinates
    return dict(dec=dec, system=system, span=span, frame=frame, X=X, b=b, points=points,
                coords=coords, inactive=inactive, truth=truth)


def _same(Q: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """(k,) |cos| between each column of Q and the true column nearest to it."""
    return (normalize_columns(Q).T @ truth).abs().max(dim=1).values


def test_the_samples_are_the_points_the_next_layers_span_holds(update) -> None:
    """At the true samples the activation residual vanishes to the next layer's precision (a
    thousandth of its least value at random points of the row space), each point's inactive
    units give its sample's column (to 10⁻⁶ in angle, the float32 precision of the weakest
    columns), which ``consistent_columns`` accepts; and each sample's point is orthogonal to
    the other samples' columns (the deflation of later descents)."""
    u = update
    frame, b = u["frame"], u["b"]
    P, residual = activations.consistent_points(frame, b, u["span"], u["points"], steps=0,
                                                lr=0.1)
    gen = torch.Generator().manual_seed(0)
    away = P.mean(dim=0) + P.std(dim=0) * torch.randn(50, P.shape[1], generator=gen,
                                                      dtype=P.dtype)
    _, elsewhere = activations.consistent_points(frame, b, u["span"], away, steps=0, lr=0.1)
    assert float(residual.max()) < 1e-6 < 1e-3 * float(elsewhere.min())
    Q, inactive = activations.columns_of_points(u["dec"].L, frame, b, P)
    assert torch.equal(inactive, u["inactive"].T)
    assert (normalize_columns(Q) * u["truth"]).sum(dim=0).abs().min() > 1 - 1e-6
    ok = activations.consistent_columns(u["dec"].L, Q, inactive, u["system"].zero_rtol)
    assert bool(ok.all())
    normals = frame.to_L @ u["truth"]  # (B, B)
    cross = (P / P.norm(dim=1, keepdim=True)) @ (normals / normals.norm(dim=0))
    off = cross - torch.diag(torch.diag(cross))
    assert float(off.abs().max()) < 1e-3 * float(torch.diag(cross).abs().min())


def test_a_column_that_is_not_a_samples_is_never_accepted(update) -> None:
    """Points away from every sample (mixtures of two samples' points, random points of the
    row space): whatever kernel their inactive units give, ``consistent_columns`` accepts
    only true columns."""
    u = update
    frame, b, L = u["frame"], u["b"], u["dec"].L
    gen = torch.Generator().manual_seed(0)
    P = u["points"]
    mixes = 0.5 * (P[:-1] + P[1:])
    scale = P.std(dim=0)
    rand = P.mean(dim=0) + scale * torch.randn(200, P.shape[1], generator=gen,
                                               dtype=P.dtype)
    Q, inactive = activations.columns_of_points(L, frame, b, torch.cat([mixes, rand]))
    ok = activations.consistent_columns(L, Q, inactive, u["system"].zero_rtol)
    assert bool((_same(Q[:, ok], u["truth"]) > 1 - 1e-6).all())


def test_snapping_returns_a_nearby_point_to_its_sample(update) -> None:
    """A point a descent left next to its sample (units on the wrong side of their threshold)
    is moved onto its sample's pattern by solving the pattern, and that pattern gives the
    sample's column."""
    u = update
    frame, b = u["frame"], u["b"]
    P = u["points"]
    gen = torch.Generator().manual_seed(1)
    step = torch.randn(P.shape, generator=gen, dtype=P.dtype)
    moved = P + 1e-2 * P.norm(dim=1, keepdim=True) * step / step.norm(dim=1, keepdim=True)
    flipped = ((moved @ frame.WV.T + b > 0) != (P @ frame.WV.T + b > 0)).sum(dim=1)
    assert int(flipped.max()) >= 1  # the situation: patterns off by some units
    snapped = activations.snap_points(frame, b, u["span"], moved)
    assert torch.equal((snapped @ frame.WV.T + b) <= 0, u["inactive"])
    Q, _ = activations.columns_of_points(u["dec"].L, frame, b, snapped)
    assert (normalize_columns(Q) * u["truth"]).sum(dim=0).abs().min() > 1 - 1e-6


def test_a_points_pattern_verifies_its_sample_through_the_next_layer(update) -> None:
    """``peel.recover`` on the points' inactive units instead of the columns' zero tests
    recovers each sample's input, verified on its own, without the other columns."""
    u = update
    dec, system = u["dec"], u["system"]
    got = peel.recover(u["truth"], dec.L, dec.R, u["span"].T.contiguous(), system.WR,
                       system.bias, zero_rtol=system.zero_rtol, z_band=system.z_band,
                       precision=torch.float32,
                       zeros=u["inactive"].T)
    assert bool(got.verified.any())
    X = u["X"][got.verified]
    err = (got.inputs - X).norm(dim=1) / X.norm(dim=1)
    assert float(err.max()) < 1e-4
