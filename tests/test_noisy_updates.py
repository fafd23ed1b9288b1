"""Attacking real client updates (SPEAR App. E.6, SPEAR++ §5.2): DP-SGD clipping alone
changes nothing, small Gaussian noise still leaks recognisable images. Updates come from
Opacus DP-SGD on a ReLU MLP."""

from __future__ import annotations

import torch

import fl_attack
from fl_attack import data, metrics, models, simulate, updates


def _dp_update(seed: int, noise_frac: float, B: int = 12, m: int = 200, lr: float = 0.1,
               epochs: int = 1):
    x, y = data.sample_batch("photos32", B, seed=seed)
    xn = data.normalize(x, "photos32")
    model = models.relu_mlp(3072, m, 3, seed=seed)
    clip = simulate.local_update(model, xn, y, protocol="dpsgd", lr=lr, max_grad_norm=1.0,
                                 noise_multiplier=0.0, seed=seed)
    dW, _, _, _ = updates.weight_update_pair(model.state_dict(), clip.state_dict)
    median = float(dW.abs().median()) / lr  # median |entry| of the clipped mean gradient
    nm = simulate.noise_multiplier_for_std(noise_frac * median, 1.0, B) if noise_frac else 0.0
    res = simulate.local_update(model, xn, y, protocol="dpsgd", lr=lr, max_grad_norm=1.0,
                                noise_multiplier=nm, seed=seed, epochs=epochs)
    dW, db, W0, b0 = updates.weight_update_pair(model.state_dict(), res.state_dict)
    return x, dW, db, W0, b0, res


def _psnr(rec: fl_attack.Reconstruction, x: torch.Tensor) -> metrics.MatchedScore:
    images = data.denormalize(rec.inputs.float().reshape(-1, 3, 32, 32), "photos32")
    return metrics.score_batch(images, x)


def test_clipping_only_dpsgd_is_still_exact() -> None:
    """Per-sample clipping rescales columns of ∂L/∂Z and the bias gradient alike (SPEAR E.6)."""
    x, dW, db, W0, b0, res = _dp_update(seed=0, noise_frac=0.0)
    assert res.epsilon == float("inf")
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0)
    assert rec.batch_size == 12
    assert float(_psnr(rec, x).psnr.min()) > 90.0


def test_small_dp_noise_still_leaks() -> None:
    """Noise at 1% of the median gradient entry: B is still read off, images stay > 25 dB."""
    x, dW, db, W0, b0, res = _dp_update(seed=1, noise_frac=0.01)
    assert res.noise_std and res.noise_std > 0 and res.epsilon < float("inf")
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0)
    assert rec.batch_size == 12 and rec.noise_std > 0
    assert _psnr(rec, x).mean_psnr > 25.0


def test_dp_noise_at_a_tenth_of_the_median_still_leaks_at_b20() -> None:
    """B = 20, m = 200, noise std 0.1 x the median |entry| of the clipped mean gradient: every
    one of 5 benchmark batches stayed above 25 dB (dp.md: 35.8 dB mean, 34.7 dB on this one),
    against a ceiling of 42.8 dB for a reconstruction from the true ∂L/∂Z. The issue's level
    (1 x the median) is above that ceiling for 4 of 5 batches, so it is not asserted."""
    x, dW, db, W0, b0, res = _dp_update(seed=0, noise_frac=0.1, B=20)
    assert res.epsilon < float("inf")
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0)
    assert rec.noise_std > 0 and not rec.exact
    assert _psnr(rec, x).mean_psnr > 25.0


def test_a_noisy_update_is_never_marked_exact() -> None:
    """Five noisy DP-SGD steps (noise at 0.03 x the median) attacked as a FedAvg sum: that λ only
    checks that zero rows are inactive units, and within the noise tolerance a selection can
    pass it everywhere, so λ may reach 1 (it did on some CPUs) while the images are not exact.
    Whatever λ the search reaches here, the noise is detected and the result is not certified;
    the rule itself is tested on constructed inputs below."""
    x, dW, db, W0, b0, res = _dp_update(seed=4, noise_frac=0.03, B=20, lr=0.01, epochs=5)
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0, update="fedavg")
    assert res.steps == 5 and res.epsilon < float("inf")
    assert rec.noise_std > 0 and rec.batch_size == 20 and rec.inputs.shape == (20, 3072)
    assert rec.sparsity_match is not None and 0.0 <= rec.sparsity_match <= 1.0
    assert not rec.exact
    assert _psnr(rec, x).mean_psnr < 90.0  # the refusal is right: noise bounds the accuracy


def test_the_certificate_refuses_a_noisy_selection_even_at_lambda_one() -> None:
    """The two halves of the rule behind ``exact``, each on a constructed input: a real DP-SGD
    update (noise at 0.03 x the median, as above) is classified noisy and its clipping-only
    twin is not (``tolerances.noisy_update``), and a selection with λ = 1 and all B directions is
    certified only without noise (``result.certified``, used by both sides)."""
    from fl_attack.decompose import decompose
    from fl_attack.result import certified
    from fl_attack.tolerances import noisy_update

    _, dW, _, _, _, _ = _dp_update(seed=4, noise_frac=0.03, B=20, lr=0.01, epochs=5)
    _, clean, _, _, _, _ = _dp_update(seed=4, noise_frac=0.0, B=20, lr=0.01, epochs=5)
    assert noisy_update(decompose(dW.double(), floor_rtol=1e-6))
    assert not noisy_update(decompose(clean.double(), floor_rtol=1e-6))
    assert certified(1.0, 20, 20, noisy=False)
    assert not certified(1.0, 20, 20, noisy=True)  # λ = 1 under noise: no certificate
    assert not certified(0.999, 20, 20, noisy=False)
    assert not certified(1.0, 19, 20, noisy=False)  # a completed (partial) basis
    assert not certified(None, 20, 20, noisy=False)  # no weight and bias: no λ
    assert not certified(1.0, 20, 20, noisy=False, nonnegative=False)  # input side's extra test
