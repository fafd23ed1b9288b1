"""Matching reconstructions to originals and scoring them (PSNR, SSIM, batch accuracy)."""

import math

import pytest
import torch

from fl_attack.testbed import data
from fl_attack.testbed.metrics import (
    PSNR_CAP,
    MatchedScore,
    batch_accuracy,
    match,
    psnr,
    score_batch,
)


@pytest.fixture(scope="module")
def batch():
    x, _ = data.sample_batch("photos32", 20, seed=7)
    return x


def test_psnr_identical_is_capped(batch):
    out = psnr(batch, batch.clone())
    assert out.shape == (20,) and out.dtype == torch.float64
    assert torch.all(out == PSNR_CAP) and PSNR_CAP == 300.0


def test_psnr_known_values(batch):
    # a constant offset of 0.01 gives mse = 1e-4 -> 40 dB for data_range 1, 46.02 dB for 2
    assert torch.allclose(psnr(batch + 0.01, batch), torch.full((20,), 40.0, dtype=torch.float64))
    expected = 40.0 + 20 * math.log10(2.0)
    assert torch.allclose(
        psnr(batch + 0.01, batch, data_range=2.0), torch.tensor(expected).double()
    )
    # unit check of the formula on a constructed pair: mse = 0.25 -> 10*log10(4) dB
    x, y = torch.zeros(1, 4), torch.tensor([[0.5, -0.5, 0.5, -0.5]])
    assert float(psnr(x, y)[0]) == pytest.approx(10 * math.log10(4.0))


def test_psnr_validates_inputs(batch):
    with pytest.raises(ValueError, match="shape mismatch"):
        psnr(batch, batch[:5])
    bad = batch.clone()
    bad[3, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        psnr(bad, batch)
    with pytest.raises(ValueError, match=r"\(B, \.\.\.\)"):
        psnr(batch[0, 0, 0], batch[0, 0, 0])


def test_match_recovers_random_permutation(batch):
    p = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    rec = batch[p] + 1e-3 * torch.randn(batch.shape, generator=torch.Generator().manual_seed(1))
    perm = match(rec, batch)
    assert perm.dtype == torch.int64 and perm.shape == (20,)
    assert torch.equal(p[perm], torch.arange(20))  # rec[perm[i]] is a noisy copy of batch[i]
    # flat rows work the same
    assert torch.equal(match(data.flatten(rec), data.flatten(batch)), perm)


def test_score_batch_exact_and_noisy(batch):
    p = torch.randperm(20, generator=torch.Generator().manual_seed(2))
    score = score_batch(batch[p], batch)
    assert isinstance(score, MatchedScore)
    assert score.mean_psnr == PSNR_CAP and torch.all(score.psnr == PSNR_CAP)
    assert score.ssim is None and score.n_matched == 20
    noisy = batch[p] + 0.01
    score = score_batch(noisy, batch)
    assert score.mean_psnr == pytest.approx(40.0)


def test_score_batch_partial_and_surplus(batch):
    p = torch.randperm(20, generator=torch.Generator().manual_seed(3))
    rec = batch[p[:15]]  # the attack recovered 15 of 20
    score = score_batch(rec, batch)
    unmatched = score.perm < 0
    assert int(unmatched.sum()) == 5 and score.n_matched == 15
    assert set(p[15:].tolist()) == set(torch.nonzero(unmatched).flatten().tolist())
    assert torch.all(score.psnr[unmatched] == 0) and torch.all(score.psnr[~unmatched] == PSNR_CAP)
    assert score.mean_psnr == pytest.approx(15 * PSNR_CAP / 20)
    # more reconstructions than originals: the best ones are used, the rest ignored
    extra = torch.cat([data.sample_batch("photos32", 5, seed=99)[0], batch[p]])
    score = score_batch(extra, batch)
    assert score.mean_psnr == PSNR_CAP and torch.all(score.perm >= 5)
    # nothing recovered
    score = score_batch(torch.empty(0, 3, 32, 32), batch)
    assert score.mean_psnr == 0.0 and torch.all(score.perm == -1)


def test_score_batch_ssim(batch):
    p = torch.randperm(20, generator=torch.Generator().manual_seed(4))
    score = score_batch(batch[p[:18]], batch, with_ssim=True)
    hit = score.perm >= 0
    assert score.ssim is not None and score.ssim.shape == (20,)
    assert torch.allclose(score.ssim[hit], torch.ones(18, dtype=torch.float64))
    assert torch.all(score.ssim[~hit] == 0)
    noisy = batch + 0.1 * torch.randn(batch.shape, generator=torch.Generator().manual_seed(5))
    assert float(score_batch(noisy, batch, with_ssim=True).ssim.max()) < 0.9
    flat = data.flatten(batch)
    with pytest.raises(ValueError, match="image_shape"):
        score_batch(flat, flat, with_ssim=True)
    s = score_batch(flat, flat, with_ssim=True, image_shape=(3, 32, 32))
    assert torch.allclose(s.ssim, torch.ones(20, dtype=torch.float64))


def test_score_batch_on_mnist():
    x, _ = data.sample_batch("mnist", 16, seed=1)
    p = torch.randperm(16, generator=torch.Generator().manual_seed(6))
    score = score_batch(x[p] + 1e-4, x, with_ssim=True)
    assert score.mean_psnr == pytest.approx(80.0, abs=1e-3)  # float32 rounding of x + 1e-4
    assert torch.equal(p[score.perm], torch.arange(16))


def test_score_batch_validates(batch):
    bad = batch.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="reconstructed contains NaN"):
        score_batch(bad, batch)
    with pytest.raises(ValueError, match="original contains NaN"):
        match(batch, bad)
    with pytest.raises(ValueError, match="3072"):
        score_batch(batch[:, :, :16], batch)
    with pytest.raises(ValueError, match="empty"):
        score_batch(batch, batch[:0])


def test_batch_accuracy():
    assert batch_accuracy([100.0, 95.0, 80.0, 91.0]) == 75.0
    assert batch_accuracy([90.0, 90.0001]) == 50.0  # strictly above the threshold
    assert batch_accuracy([30.0, 20.0, 26.0, 10.0], threshold=25.0) == 50.0
    assert batch_accuracy((PSNR_CAP,)) == 100.0
    with pytest.raises(ValueError, match="at least one"):
        batch_accuracy([])
    with pytest.raises(ValueError, match="NaN"):
        batch_accuracy([100.0, float("nan")])
