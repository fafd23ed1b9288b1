"""Peeling found samples off the gradient with the next layer's gradient (``fl_attack.steps.peel``),
on real photo batches: each step against the true factor ∂L/∂Z, then the whole attack with
the search's findings built in (a round monkeypatched to offer chosen true columns)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fl_attack
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.solver import candidates
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState
from fl_attack.steps import peel
from fl_attack.steps.decompose import decompose
from fl_attack.steps.scale import make_system
from fl_attack.testbed import models

pytestmark = pytest.mark.usefixtures("one_thread")

B, M = 20, 200


@pytest.fixture(scope="module")
def case(real_batch):
    """``case(seed=0, B=20, m=200)``: a real photo batch's first two layers' gradients, the
    truth, and the attack's factors."""

    def build(seed: int = 0, B: int = B, m: int = M) -> dict:
        t = real_batch("photos32", B, m, seed)
        G2, _ = models.layer_gradients(t.model, t.X.float(), t.y, 1)
        dec = decompose(t.G.double(), floor_rtol=1e-6)
        system = make_system(dec.L, dec.R, t.g.double(), t.W.double(), t.b.double(), 1e-4,
                             1e-5)
        return {"x": t.x, "xn": t.X, "y": t.y, "model": t.model, "G": t.G, "g": t.g,
                "G2": G2, "W": t.W, "b": t.b, "dec": dec, "system": system,
                "Qt": dec.L.T @ t.D, "D": t.D}

    return build


def _recover(t: dict, cols: torch.Tensor) -> peel.Peeled:
    rows2 = peel.next_layer_rows(t["G2"].double(), t["dec"].batch_size, 1e-6)
    assert rows2 is not None
    s = t["system"]
    return peel.recover(cols, t["dec"].L, t["dec"].R, rows2, s.WR, s.bias, zero_rtol=1e-4,
                        z_band=1e-5, precision=torch.float32)


@pytest.mark.parametrize(("b", "m"), [(B, M), (100, 500)])
def test_true_columns_give_every_sample_exactly_and_verified(b: int, m: int, case) -> None:
    """Each true column on its own (unit length, unknown scale) gives its sample through the
    next layer: verified, input exact to float32 precision, the column's true scale back.
    (100, 500) is where the kernel tolerance matters: one at 1e-7 would reject 43 of the 100
    true columns, and counting trimmed rows as chance zeros 4 more."""
    t = case(B=b, m=m)
    Qt = t["Qt"]
    out = _recover(t, Qt / Qt.norm(dim=0))
    assert bool(out.verified.all())
    err = (out.inputs - t["xn"]).norm(dim=1) / t["xn"].norm(dim=1)
    assert float(err.max()) < 1e-4
    assert torch.allclose(out.columns, Qt, rtol=1e-4, atol=1e-4 * float(Qt.abs().max()))


@pytest.mark.parametrize(("b", "m"), [(B, M), (100, 500)])
def test_a_mixture_of_two_columns_is_not_verified(b: int, m: int, case) -> None:
    """Sums of two true columns (no sample's pattern) and random directions are rejected."""
    t = case(B=b, m=m)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    gen = torch.Generator().manual_seed(0)
    h = b // 2
    wrong = torch.cat([Qt[:, :h] + Qt[:, h:2 * h], torch.randn(b, 10, generator=gen,
                                                               dtype=torch.float64)], dim=1)
    out = _recover(t, wrong)
    assert not bool(out.verified.any()) and out.inputs.shape == (0, t["xn"].shape[1])


def test_peeling_leaves_the_gradient_of_the_other_samples(case) -> None:
    """Taking 12 verified samples off leaves the gradient the other 8 contribute to the batch's
    mean loss: the 8-sample batch's own gradient times 8/20."""
    t = case()
    Qt = t["Qt"]
    out = _recover(t, Qt[:, :12] / Qt[:, :12].norm(dim=0))
    assert int(out.verified.sum()) == 12
    Gr, gr = peel.peel_off(t["G"].double(), t["g"].double(), t["dec"].L, out)
    G8, g8 = models.layer_gradients(t["model"], t["xn"][12:].float(), t["y"][12:], 0)
    scale = 8 / 20
    assert float((Gr - scale * G8.double()).norm() / Gr.norm()) < 1e-4
    assert float((gr - scale * g8.double()).norm() / gr.norm()) < 1e-4


def test_fast_factors_equal_the_full_decompositions(case) -> None:
    """The randomised basis of the next layer's rows spans what its SVD spans, and the reduced
    factors L (I - A C) R give the same column space and product as decomposing G - Σ g xᵀ."""
    t = case()
    gen = torch.Generator().manual_seed(0)
    fast = peel.next_layer_rows(t["G2"].double(), B, 1e-6, gen)
    full = decompose(t["G2"].double(), floor_rtol=1e-6).R
    full = torch.linalg.qr(full.T).Q
    assert fast is not None and fast.shape == (B, M)
    assert float((fast.T @ fast - full @ full.T).norm()) < 1e-6
    Qt = t["Qt"]
    out = _recover(t, Qt[:, :12] / Qt[:, :12].norm(dim=0))
    red = peel.reduced(t["dec"], out)
    Gr, _ = peel.peel_off(t["G"].double(), t["g"].double(), t["dec"].L, out)
    ref = decompose(Gr, floor_rtol=1e-6)
    assert red is not None and red.batch_size == ref.batch_size == 8
    assert float((red.L @ red.L.T - ref.L @ ref.L.T).norm()) < 1e-5
    assert float((red.L @ red.R - Gr).norm() / Gr.norm()) < 1e-6
    wrong = peel.Peeled(inputs=out.inputs, coords=out.coords, columns=out.columns.flip(1),
                        verified=out.verified)  # coordinates paired with the wrong columns
    assert peel.reduced(t["dec"], wrong) is None


def _offer_in_span(D: torch.Tensor, most: int):
    """A search round that offers the pool at most ``most`` of the true ∂L/∂Z columns ``D``
    (m, B) that lie in the level's column space (after a peel, only the samples left over):
    a round monkeypatched to find exactly these columns."""

    def round_(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
        L = ctx.L
        q = L.T @ normalize_columns(D.to(L))
        q = normalize_columns(q[:, q.norm(dim=0) > 1 - 1e-4][:, :most])
        pool.add(q, zero_mask(L @ q, ctx.zero_rtol).sum(dim=0))

    return round_


def test_samples_found_by_a_starved_search_are_peeled_and_the_rest_solved(
        monkeypatch: pytest.MonkeyPatch, case, promises, image_score) -> None:
    """Built directly: each search round finds at most 12 of the true columns in its level's
    column space, and nothing completes the rest (slice sampling off, more than three
    missing). With the next layer's gradient the 12 found samples are verified and peeled
    off, and the 8 left are a batch of their own whose round finds all of them: all 20
    directions, certified, every image exact. Without the next layer nothing is peeled and
    the result is partial: 12 directions, not certified."""
    t = case(seed=0)
    monkeypatch.setattr(candidates, "spearpp_round", _offer_in_span(t["D"], 12))
    monkeypatch.setattr(candidates, "neighbour_search", lambda *a: None)
    opts = {"seed": 0, "max_rounds": 2, "slice_samples": 0, "max_seconds": None}
    rec = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"],
                           next_weight_grad=t["G2"], **opts)
    assert rec.peeled == 12 and rec.n_directions == B and rec.exact
    assert float(image_score(rec.inputs, t["x"], "photos32").psnr.min()) > 90.0
    alone = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"], **opts)
    assert alone.peeled == 0 and alone.n_directions == 12 and not alone.exact
    promises(alone, t["x"], "photos32")


def test_a_starved_search_with_the_next_layer_keeps_its_promises(case, promises) -> None:
    """The real search, starved (32 starts, one round, no slice sampling: it finds only
    part of the batch on its own), with the next layer's gradient: whatever it finds and
    peels, the attack keeps its promises."""
    t = case(seed=0)
    rec = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"], next_weight_grad=t["G2"],
                           seed=0, n_init=32, max_rounds=1, steps=200, slice_samples=0,
                           max_seconds=None)
    promises(rec, t["x"], "photos32")


def test_a_next_layer_of_another_rank_peels_only_what_it_holds(case, promises) -> None:
    """A next-layer gradient of fewer samples holds only their activations: it is read at its
    own rank, and whatever it verifies is among those samples (each verified on its own);
    the attack keeps its promises."""
    t = case()
    G2_half, _ = models.layer_gradients(t["model"], t["xn"][:10].float(), t["y"][:10], 1)
    rec = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"], seed=0,
                           next_weight_grad=G2_half)
    assert rec.peeled <= 10 and len(rec.verified) <= 10
    if rec.verified:  # each row verified on its own is one of the 10 samples
        rows = rec.inputs[list(rec.verified)].double()
        nearest = torch.cdist(rows, t["xn"].reshape(B, -1).double()).argmin(dim=1)
        assert bool((nearest < 10).all()), nearest
    promises(rec, t["x"], "photos32")


def test_bad_next_layer_inputs_raise(case) -> None:
    t = case()
    G, g, W, b, G2 = t["G"], t["g"], t["W"], t["b"], t["G2"]
    with pytest.raises(ValueError, match=r"next_weight_grad has shape .*\(k, 200\)"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2[:, :100])
    bad = G2.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="next_weight_grad contains 1 non-finite"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=bad)
    with pytest.raises(ValueError, match="needs weight and bias"):
        fl_attack.invert(G, g, next_weight_grad=G2)
    with pytest.raises(ValueError, match="FedAvg"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2, update="fedavg")
    with pytest.raises(ValueError, match="sparse='output' only"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2, sparse="input")
    with pytest.raises(ValueError, match="identically zero"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=torch.zeros_like(G2))
    with pytest.raises(ValueError, match=r"next_weight_grad must be a \(m, n\) matrix"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2[0])
    with pytest.raises(ValueError, match="next_weight needs next_weight_grad"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight=G2)
    with pytest.raises(ValueError, match=r"next_weight has shape \(10, 200\)"):
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2, next_weight=G2[:10])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean call warns about nothing
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2, seed=0)


def test_a_weight_differences_next_layer_is_read_above_its_stored_weights_rounding(
        real_batch) -> None:
    """A one-step weight difference of the next layer, its weights stored in float32, with
    five samples' contributions below that storage's rounding (a trained model's weakest):
    read above the rounding edge of ``next_weight``, the span is the other 15 samples'
    activations to float32 precision and holds no rounding direction. (Without the edge the
    same difference reads at a rank of 176: rounding directions taken for samples.)"""
    from fl_attack.steps.tolerances import rounding_edge

    t = real_batch("photos32", B, M, 0, layer=1)  # the next layer: its inputs, ∂L/∂Z, weight
    D = t.D.clone()
    D[:, :5] *= 1e-5
    W0 = t.W.float()
    dW = W0.double() - (W0.double() - 0.01 * D @ t.X).float().double()
    edge = rounding_edge(W0, dW, "float32")
    strength = 0.01 * D.norm(dim=0) * t.X.norm(dim=1)
    strong = strength > 100 * edge
    assert int(strong.sum()) == 15 and bool((strength[~strong] < edge).all())  # as built
    rows2 = peel.next_layer_rows(dW, B, 1e-6, any_rank=True, noise_floor=edge)
    assert rows2 is not None and rows2.shape == (15, M)
    H = t.X.T[:, strong]
    off = (H - rows2.T @ (rows2 @ H)).norm(dim=0) / H.norm(dim=0)
    assert float(off.max()) < 1e-3


def test_a_sample_only_read_replaces_its_row_in_an_unproven_basis_and_is_never_verified(
) -> None:
    """Samples read through the next layer only to ``peel.READ_RTOL`` (``Peeled.proven``
    False) replace their rows when the basis is not proven, never when it is, and are never
    among the verified rows, whether kept (``keep_verified`` keeps both kinds with their
    flags) or peeled off (``_Found.samples``, ∂L/∂Z columns); a peeled verified sample's row is
    a verified row."""
    from types import SimpleNamespace

    from fl_attack.solver.output_side import _known, _verified_rows

    Q = torch.eye(5, dtype=torch.float64)
    inputs = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    got = peel.Peeled(inputs=inputs, coords=torch.eye(5, dtype=torch.float64)[[1, 3]],
                      columns=Q[:, [1, 3]], verified=torch.tensor([False, True, True]),
                      proven=torch.tensor([True, False]))
    state = SearchState()
    candidates.keep_verified(state, got)
    assert state.verified is not None and state.verified.proven.tolist() == [True, False]
    L = torch.linalg.qr(torch.randn(8, 5, dtype=torch.float64))[0]  # the top level's L
    found = SimpleNamespace(samples=[(L[:, [0, 4]], 3.0 + torch.zeros(2, 3, dtype=torch.float64),
                                      torch.tensor([True, False]))])
    known = _known(SimpleNamespace(L=L), state, found)
    X = torch.zeros(5, 3, dtype=torch.float64)
    unproven, rows = _verified_rows(X, Q, known, read=True)
    assert rows == (0, 1) and unproven[1].tolist() == [1.0] * 3
    assert unproven[3].tolist() == [2.0] * 3 and unproven[4].tolist() == [3.0] * 3
    proven, rows = _verified_rows(X, Q, known, read=False)
    assert rows == (0, 1) and proven[0].tolist() == [3.0] * 3
    assert proven[3].tolist() == [0.0] * 3 and proven[4].tolist() == [0.0] * 3
    assert _verified_rows(X, Q, None, read=True) == (X, ())
    only_read = got.take(torch.tensor([False, True]))
    assert only_read.verified.tolist() == [False, False, True]
    assert only_read.proven.tolist() == [False] and only_read.inputs[0, 0] == 2.0


def test_read_samples_are_peeled_with_the_verified_unless_the_rest_loses_its_clean_rank(
        case) -> None:
    """``output_side._peelable``: samples only read (``Peeled.proven`` False) come off the
    gradient with the verified ones when the batch left keeps a clean rank; a read sample
    whose coordinates are off (so that what is left has no clean rank) leaves the verified
    ones alone to peel; with no verified one to fall back to, nothing is peeled."""
    from fl_attack.solver.output_side import _peelable

    t = case()
    dec = t["dec"]
    got = _recover(t, t["Qt"][:, :6])
    assert bool(got.verified.all())
    got.proven = torch.tensor([True, True, True, False, False, False])
    taken, sub = _peelable(dec, got)
    assert taken is got and sub is not None and sub.batch_size == B - 6
    off = got.take(torch.ones(6, dtype=torch.bool))
    off.coords = off.coords.clone()
    off.coords[4] += 0.3 * off.coords[4].norm() * normalize_columns(t["Qt"][:, 10:11])[:, 0]
    assert peel.reduced(dec, off) is None  # the situation: the read sample breaks the cliff
    taken, sub = _peelable(dec, off)
    assert taken is not None and taken.proven.tolist() == [True] * 3
    assert sub is not None and sub.batch_size == B - 3
    only_read = off.take(~off.proven_mask())
    assert _peelable(dec, only_read) == (None, None)
