"""Peeling found samples off the gradient with the next layer's gradient (``fl_attack.peel``),
on real photo batches: each step against the true factor ∂L/∂Z, then the whole attack."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fl_attack
from fl_attack import peel
from fl_attack.decompose import decompose
from fl_attack.scale import make_system
from fl_attack.testbed import data, metrics, models

B, M = 20, 200


def _case(seed: int = 0, B: int = B, m: int = M) -> dict:
    """A real batch's first two layers' gradients, the truth, and the attack's factors."""
    x, y = data.sample_batch("photos32", B, seed=seed)
    xn = data.normalize(x, "photos32").reshape(B, -1)
    model = models.relu_mlp(xn.shape[1], m, 3, seed=seed)
    G, g = models.layer_gradients(model, xn, y, 0)
    G2, _ = models.layer_gradients(model, xn, y, 1)
    lin = models.linear_layers(model)[0]
    W, b = lin.weight.detach(), lin.bias.detach()
    Z = (xn @ W.T + b).requires_grad_(True)
    rest = torch.nn.Sequential(*list(model.children())[2:])
    (D,) = torch.autograd.grad(F.cross_entropy(rest(Z), y), Z)
    dec = decompose(G.double(), floor_rtol=1e-6)
    system = make_system(dec.L, dec.R, g.double(), W.double(), b.double(), 1e-4, 1e-5)
    return {"x": x, "xn": xn.double(), "y": y, "model": model, "G": G, "g": g, "G2": G2,
            "W": W, "b": b, "dec": dec, "system": system, "Qt": dec.L.T @ D.double().T}


def _recover(t: dict, cols: torch.Tensor) -> peel.Peeled:
    rows2 = peel.next_layer_rows(t["G2"].double(), t["dec"].batch_size, 1e-6)
    assert rows2 is not None
    s = t["system"]
    return peel.recover(cols, t["dec"].L, t["dec"].R, rows2, s.WR, s.bias, zero_rtol=1e-4,
                        z_band=1e-5, precision=torch.float32)


@pytest.mark.parametrize(("b", "m"), [(B, M), (100, 500)])
def test_true_columns_give_every_sample_exactly_and_verified(b: int, m: int) -> None:
    """Each true column on its own (unit length, unknown scale) gives its sample through the
    next layer: verified, input exact to float32 precision, the column's true scale back. At
    (100, 500) a kernel tolerance of 1e-7 rejected 43 of the 100 true columns, and counting
    trimmed rows as chance zeros 4 more."""
    t = _case(B=b, m=m)
    Qt = t["Qt"]
    out = _recover(t, Qt / Qt.norm(dim=0))
    assert bool(out.verified.all())
    err = (out.inputs - t["xn"]).norm(dim=1) / t["xn"].norm(dim=1)
    assert float(err.max()) < 1e-4
    assert torch.allclose(out.columns, Qt, rtol=1e-4, atol=1e-4 * float(Qt.abs().max()))


@pytest.mark.parametrize(("b", "m"), [(B, M), (100, 500)])
def test_a_mixture_of_two_columns_is_not_verified(b: int, m: int) -> None:
    """Sums of two true columns (no sample's pattern) and random directions are rejected."""
    t = _case(B=b, m=m)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    gen = torch.Generator().manual_seed(0)
    h = b // 2
    wrong = torch.cat([Qt[:, :h] + Qt[:, h:2 * h], torch.randn(b, 10, generator=gen,
                                                               dtype=torch.float64)], dim=1)
    out = _recover(t, wrong)
    assert not bool(out.verified.any()) and out.inputs.shape == (0, t["xn"].shape[1])


def test_peeling_leaves_the_gradient_of_the_other_samples() -> None:
    """Taking 12 verified samples off leaves the gradient the other 8 contribute to the batch's
    mean loss: the 8-sample batch's own gradient times 8/20."""
    t = _case()
    Qt = t["Qt"]
    out = _recover(t, Qt[:, :12] / Qt[:, :12].norm(dim=0))
    assert int(out.verified.sum()) == 12
    Gr, gr = peel.peel_off(t["G"].double(), t["g"].double(), t["dec"].L, out)
    G8, g8 = models.layer_gradients(t["model"], t["xn"][12:].float(), t["y"][12:], 0)
    scale = 8 / 20
    assert float((Gr - scale * G8.double()).norm() / Gr.norm()) < 1e-4
    assert float((gr - scale * g8.double()).norm() / gr.norm()) < 1e-4


def test_fast_factors_equal_the_full_decompositions() -> None:
    """The randomised basis of the next layer's rows spans what its SVD spans, and the reduced
    factors L (I - A C) R give the same column space and product as decomposing G - Σ g xᵀ."""
    t = _case()
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


def test_a_starved_search_peels_and_recovers_the_whole_batch() -> None:
    """A starved search (32 starts, one round, no slice sampling: 14 of 20 columns alone on
    batch 0, as measured) whose found samples are peeled off level by level. Batches 0-2:
    every certified result is exact (every sample > 90 dB), and at least two of the three are
    recovered whole after peeling samples off. Without the next layer nothing is peeled."""
    opts = {"seed": 0, "n_init": 32, "max_rounds": 1, "steps": 200, "slice_samples": 0,
            "max_seconds": None}
    whole = 0
    for seed in range(3):
        t = _case(seed=seed)
        rec = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"],
                               next_weight_grad=t["G2"], **opts)
        x = t["x"]
        images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), "photos32")
        if rec.exact:
            assert float(metrics.score_batch(images, x).psnr.min()) > 90.0, f"seed {seed}"
            whole += int(rec.peeled > 0 and rec.n_directions == B)
    assert whole >= 2, f"only {whole}/3 batches recovered whole by peeling"
    t = _case(seed=0)
    alone = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"], **opts)
    assert alone.peeled == 0


def test_a_next_layer_of_another_rank_is_not_used() -> None:
    """A next-layer gradient of fewer samples cannot hold every activation: a warning, no
    peeling, the attack runs as without it."""
    t = _case()
    G2_half, _ = models.layer_gradients(t["model"], t["xn"][:10].float(), t["y"][:10], 1)
    with pytest.warns(UserWarning, match="rank"):
        rec = fl_attack.invert(t["G"], t["g"], weight=t["W"], bias=t["b"], seed=0,
                               next_weight_grad=G2_half)
    assert rec.peeled == 0 and rec.exact


def test_bad_next_layer_inputs_raise() -> None:
    t = _case()
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean call warns about nothing
        fl_attack.invert(G, g, weight=W, bias=b, next_weight_grad=G2, seed=0)
