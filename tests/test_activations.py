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
from fl_attack.core.columns import ColumnNoiseRtol, normalize_columns, zero_mask
from fl_attack.solver import candidates
from fl_attack.solver.state import SearchState
from fl_attack.steps import activations, peel
from fl_attack.steps.decompose import decompose
from fl_attack.steps.peel import Peeled
from fl_attack.steps.scale import make_system
from fl_attack.steps.tolerances import ZERO_FLOOR, ZERO_SD, output_tolerances, rank_floor, row_noise
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
    return dict(dec=dec, system=system, span=span, frame=frame, X=X, W=W, b=b, points=points,
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


def test_recover_reads_each_column_at_its_own_zero_test(update) -> None:
    """Without the points' patterns, ``peel.recover`` reads each column's zero rows with the
    search's per-column test (``zero_mask``). A trained model at large B has a loose
    batch-wide tolerance (its weakest samples near the rounding) that the per-column test
    tightens on strong columns; read at the loose value, a strong column's small true
    entries count as zeros and its sample does not verify. Built here directly: a loose
    tolerance of 10⁻² over this batch's per-column noise."""
    u = update
    dec, system = u["dec"], u["system"]
    rtol = ColumnNoiseRtol(1e-2, dec.L.double(), row_noise(dec, torch.device("cpu")),
                           ZERO_FLOOR[torch.float32], ZERO_SD)
    rows2 = u["span"].T.contiguous()
    args = (u["truth"], dec.L, dec.R, rows2, system.WR, system.bias)
    kw = dict(z_band=system.z_band, precision=torch.float32)
    got = peel.recover(*args, zero_rtol=rtol, **kw)
    loose = peel.recover(*args, zero_rtol=float(rtol), **kw)
    assert int(loose.verified.sum()) < int(got.verified.sum())  # the situation
    own = peel.recover(*args, zero_rtol=rtol, zeros=zero_mask(dec.L @ u["truth"], rtol), **kw)
    assert torch.equal(got.verified, own.verified)
    X = u["X"][got.verified]
    assert float(((got.inputs - X).norm(dim=1) / X.norm(dim=1)).max()) < 1e-3


def test_the_missing_columns_lie_outside_the_verified_samples_coordinates(update) -> None:
    """``candidates.verified_complement``: with some samples verified (their coordinates,
    rows of Q⁻¹), and then also some exact points of the activation rounds, every other
    sample's column lies in the complement it returns, and no such sample's column does; so
    the search there is a search at the smaller batch."""
    u = update
    truth, coords = u["truth"], u["coords"].T  # (B, B) columns, (B, B) rows x_i = c_iᵀ R
    done = torch.arange(8)
    state = SearchState(verified=Peeled(inputs=u["X"][done], coords=coords[done],
                                        columns=truth[:, done],
                                        verified=torch.ones(8, dtype=torch.bool)))
    N = candidates.verified_complement(state, 20)
    assert N is not None and N.shape == (20, 12)
    assert torch.allclose(N.T @ N, torch.eye(12, dtype=N.dtype), atol=1e-10)
    inside = (N.T @ truth).norm(dim=0)
    assert float(inside[8:].min()) > 1 - 1e-6
    assert float(inside[:8].max()) < 1 - 1e-3
    # and the activation rounds' exact points (samples 8-11), in R's coordinates
    state.activation_found = truth[:, 8:12]
    state.activation_coords = u["points"][8:12] @ u["frame"].to_L
    N = candidates.verified_complement(state, 20)
    assert N is not None and N.shape == (20, 8)
    inside = (N.T @ truth).norm(dim=0)
    assert float(inside[12:].min()) > 1 - 1e-6
    assert float(inside[:12].max()) < 1 - 1e-3


def test_a_weaker_samples_activation_is_a_kernel_by_its_gap(update) -> None:
    """A sample whose activation the next layer's span holds only to 3·10⁻⁵ (a trained
    model's weaker samples) is still the span's one vector vanishing on its inactive units:
    the smallest singular value is far below the next (``peel.KERNEL_GAP``), and the vector
    and its active units are the sample's."""
    u = update
    H = torch.relu(u["X"] @ u["W"].T + u["b"])  # (B, m) the true activations
    gen = torch.Generator().manual_seed(2)
    noise = torch.randn(H.shape[1], generator=gen, dtype=H.dtype)
    noise = noise - H[0] * (H[0] @ noise) / (H[0] @ H[0])
    rows = H.clone()
    rows[0] = H[0] + 3e-5 * H[0].norm() * noise / noise.norm()  # the span holds H[0] to 3e-5
    rows2 = torch.linalg.qr(rows.T).Q.T  # (B, m) orthonormal span
    zero = u["inactive"][0]
    _, sv, _ = torch.linalg.svd(rows2[:, zero].T, full_matrices=False)
    assert float(sv[-1]) > peel.KERNEL_RTOL[torch.float32] * float(sv[0])  # no plain kernel
    kernel, kept = peel._kernel(rows2, zero, peel.KERNEL_RTOL[torch.float32])
    assert kernel is not None and kernel.shape[1] == 1 and torch.equal(kept, zero)
    h = kernel[:, 0]
    assert float((h @ H[0]).abs() / (h.norm() * H[0].norm())) > 1 - 1e-8


def test_a_sample_held_only_to_the_read_tolerance_is_read_not_verified(update) -> None:
    """``peel.recover`` reads a sample whose active units' system holds only to
    ``peel.READ_RTOL`` and flags it unverified (``Peeled.proven``); ``recover_sample``, the
    certificate's test, refuses it. Built directly: the next layer's span moved by 10⁻⁵ per
    row, which leaves this batch's residuals at 4-8·10⁻⁴."""
    u = update
    dec, system = u["dec"], u["system"]
    rows2 = u["span"].T.contiguous()
    E = torch.randn(rows2.shape, generator=torch.Generator().manual_seed(0), dtype=rows2.dtype)
    moved = rows2 + 1e-5 * E / E.norm(dim=1, keepdim=True)
    zeros = u["inactive"].T
    kw = dict(z_band=system.z_band, precision=torch.float32)
    got = peel.recover(u["truth"], dec.L, dec.R, moved, system.WR, system.bias,
                       zero_rtol=system.zero_rtol, zeros=zeros, **kw)
    read = torch.nonzero(got.verified).squeeze(1)
    assert read.numel() >= 10  # the situation: samples read in the band
    assert not bool(got.proven.any())
    for k in read.tolist():
        assert peel.recover_sample(zeros[:, k], moved, system.WR, system.bias, **kw) is None
    X = u["X"][read]
    assert float(((got.inputs - X).norm(dim=1) / X.norm(dim=1)).max()) < 1e-2
    exact = peel.recover(u["truth"], dec.L, dec.R, rows2, system.WR, system.bias,
                         zero_rtol=system.zero_rtol, zeros=zeros, **kw)
    strict = [peel.recover_sample(zeros[:, k], rows2, system.WR, system.bias, **kw) is not None
              for k in torch.nonzero(exact.verified).squeeze(1).tolist()]
    assert any(strict) and exact.proven.tolist() == strict  # verified = the certificate's test
