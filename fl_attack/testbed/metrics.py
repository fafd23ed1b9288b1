"""Scoring reconstructions the way the SPEAR / SPEAR++ papers do.

A gradient-inversion attack returns the batch's inputs in an arbitrary order (the gradient is
a sum over samples, so it carries no order), possibly only some of them. Scoring therefore

1. matches reconstructions to originals by an optimal assignment (Hungarian algorithm on the
   pairwise mean squared error), then
2. computes a per-original PSNR (and optionally SSIM); an original with no reconstruction
   scores 0 dB (and SSIM 0), so partial reconstructions are penalised in the batch mean;
3. aggregates batches into an *accuracy*: the percentage of batches whose mean PSNR exceeds a
   threshold — 90 dB for exact attacks in FedSGD (reconstruction up to numerical error), 25 dB
   under DP-SGD noise or FedAvg (visually recognisable), as in the papers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

__all__ = ["PSNR_CAP", "MatchedScore", "batch_accuracy", "match", "psnr", "score_batch"]

#: PSNR reported for (numerically) identical samples instead of ``inf``. 300 dB is far above
#: anything float64 arithmetic distinguishes from exact (~ 310 dB for data in [0, 1]) and well
#: above the papers' 90 dB threshold, while keeping means finite.
PSNR_CAP = 300.0


def _check_batch(t: Tensor, what: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim < 2:
        raise ValueError(f"{what} must be a batch of shape (B, ...), got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    return t


def psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-sample peak signal-to-noise ratio in dB over all non-batch dims.

    ``10 * log10(data_range**2 / mse)`` in float64, for ``x`` and ``y`` of the same shape
    ``(B, ...)``; returns a float64 tensor ``(B,)``. Identical samples (``mse == 0``) and
    anything above :data:`PSNR_CAP` are reported as ``PSNR_CAP`` (300 dB) instead of ``inf``.
    """
    _check_batch(x, "x")
    _check_batch(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}")
    if not data_range > 0:
        raise ValueError(f"data_range must be positive, got {data_range}")
    d = x.detach().to("cpu", torch.float64) - y.detach().to("cpu", torch.float64)
    mse = d.pow(2).flatten(1).mean(dim=1)
    out = 10.0 * torch.log10(float(data_range) ** 2 / mse)  # mse == 0 -> inf -> capped
    return out.clamp(max=PSNR_CAP)


def _flat_pair(reconstructed: Tensor, original: Tensor) -> tuple[Tensor, Tensor]:
    if not (isinstance(reconstructed, Tensor) and reconstructed.numel() == 0):
        _check_batch(reconstructed, "reconstructed")  # an empty tensor = nothing recovered
    _check_batch(original, "original")
    r = reconstructed.detach().to("cpu", torch.float64)
    o = original.detach().to("cpu", torch.float64).flatten(1)
    r = r.reshape(r.shape[0], -1) if r.shape[0] else r.reshape(0, o.shape[1])
    if r.shape[1] != o.shape[1]:
        raise ValueError(
            f"reconstructed samples have {r.shape[1]} values, originals {o.shape[1]} "
            f"(shapes {tuple(reconstructed.shape)} vs {tuple(original.shape)})"
        )
    return r, o


def match(reconstructed: Tensor, original: Tensor, *, shared: bool = False) -> Tensor:
    """Optimal one-to-one assignment of reconstructions to originals.

    ``reconstructed`` is ``(R, ...)``, ``original`` is ``(B, ...)`` with the same number of
    values per sample (any sample shape, e.g. images or flat rows). Minimises the total
    pairwise MSE with :func:`scipy.optimize.linear_sum_assignment`. Returns an int64 ``perm``
    of shape ``(B,)`` with ``reconstructed[perm[i]]`` matched to ``original[i]``; when
    ``R < B`` (a partial reconstruction) the originals left without a partner get ``-1``, or,
    with ``shared``, their nearest reconstruction (an update that merged near-duplicate
    samples, ``fl_attack.Reconstruction.merged``: one reconstruction stands for both). When
    ``R > B`` the surplus reconstructions are simply unused.
    """
    r, o = _flat_pair(reconstructed, original)
    perm = torch.full((o.shape[0],), -1, dtype=torch.int64)
    if r.shape[0] == 0 or o.shape[0] == 0:
        return perm
    # ||o_i - r_j||^2 = |o_i|^2 + |r_j|^2 - 2 o_i.r_j, vectorised; clamp rounding below 0.
    cost = (o.pow(2).sum(1, keepdim=True) + r.pow(2).sum(1) - 2.0 * o @ r.T).clamp_(min=0.0)
    rows, cols = linear_sum_assignment((cost / o.shape[1]).numpy())
    perm[torch.from_numpy(rows)] = torch.from_numpy(cols).to(torch.int64)
    if shared:
        left = perm < 0
        perm[left] = cost[left].argmin(dim=1)
    return perm


@dataclass
class MatchedScore:
    """Scores of one batch after matching.

    ``psnr``: float64 ``(B_orig,)`` per original (0 dB where unmatched); ``mean_psnr``: its mean
    (the per-batch number the papers threshold); ``perm``: from :func:`match`; ``ssim``: float64
    ``(B_orig,)`` per original (0 where unmatched) or ``None`` when not requested.
    """

    psnr: Tensor
    mean_psnr: float
    perm: Tensor
    ssim: Tensor | None = None

    @property
    def n_matched(self) -> int:
        """Number of originals that got a reconstruction."""
        return int((self.perm >= 0).sum())


def _ssim_shape(original: Tensor, image_shape: tuple[int, int, int] | None) -> tuple[int, int, int]:
    if original.ndim == 4:
        return tuple(original.shape[1:])  # type: ignore[return-value]
    if image_shape is None:
        raise ValueError(
            "SSIM needs images: pass (B, C, H, W) tensors or image_shape=(C, H, W) for flat ones"
        )
    shape = tuple(int(v) for v in image_shape)
    if len(shape) != 3 or math.prod(shape) != original[0].numel():
        raise ValueError(
            f"image_shape {shape} does not fit samples of {original[0].numel()} values"
        )
    return shape  # type: ignore[return-value]


def _ssim(rec: Tensor, orig: Tensor, data_range: float, shape: tuple[int, int, int]) -> Tensor:
    """Per-pair SSIM of float64 images, channels first."""
    from skimage.metrics import structural_similarity

    a = rec.reshape(-1, *shape).numpy()
    b = orig.reshape(-1, *shape).numpy()
    vals = [
        structural_similarity(ai, bi, data_range=data_range, channel_axis=0)
        for ai, bi in zip(a, b, strict=True)
    ]
    return torch.tensor(vals, dtype=torch.float64)


def score_batch(
    reconstructed: Tensor,
    original: Tensor,
    *,
    data_range: float = 1.0,
    with_ssim: bool = False,
    image_shape: tuple[int, int, int] | None = None,
    shared: bool = False,
) -> MatchedScore:
    """Match ``reconstructed`` (``(R, ...)``) to ``original`` (``(B, ...)``) and score them.

    Both must be in the same space (e.g. both in [0, 1] with ``data_range=1``). Per-original
    PSNR via :func:`psnr`; originals without a reconstruction (``R < B``) score 0 dB, so the
    mean over the batch counts them as failures. ``with_ssim`` adds SSIM
    (:func:`skimage.metrics.structural_similarity`, channels first) for image tensors
    ``(B, C, H, W)``, or flat ``(B, n)`` ones when ``image_shape=(C, H, W)`` is given.
    ``shared`` matches the originals left over to their nearest reconstruction (:func:`match`):
    for a reconstruction that reports merged samples. Raises ``ValueError`` on NaN/inf,
    mismatched sample sizes or an empty original batch.
    """
    r, o = _flat_pair(reconstructed, original)
    if o.shape[0] == 0:
        raise ValueError("original batch is empty")
    shape = _ssim_shape(original, image_shape) if with_ssim else None
    perm = match(reconstructed, original, shared=shared)
    hit = perm >= 0
    per = torch.zeros(o.shape[0], dtype=torch.float64)
    if hit.any():
        per[hit] = psnr(r[perm[hit]], o[hit], data_range=data_range)
    ssim = None
    if shape is not None:
        ssim = torch.zeros(o.shape[0], dtype=torch.float64)
        if hit.any():
            ssim[hit] = _ssim(r[perm[hit]], o[hit], float(data_range), shape)
    return MatchedScore(psnr=per, mean_psnr=float(per.mean()), perm=perm, ssim=ssim)


def batch_accuracy(mean_psnrs: Sequence[float], threshold: float = 90.0) -> float:
    """Percentage (0..100) of batches whose mean PSNR is strictly above ``threshold``.

    The papers' definition: 90 dB (default) means "recovered exactly up to numerical error"
    for FedSGD; use 25 dB under DP-SGD noise or FedAvg, where exact recovery is impossible and
    the question is whether images are recognisable.
    """
    vals = np.asarray([float(v) for v in mean_psnrs], dtype=np.float64)
    if vals.size == 0:
        raise ValueError("batch_accuracy needs at least one batch")
    if np.isnan(vals).any():
        raise ValueError("mean_psnrs contains NaN")
    return float(100.0 * np.mean(vals > threshold))
