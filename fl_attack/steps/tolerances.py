"""Numerical tolerances of the attack: when an entry is zero, a singular value signal, an update
noisy. Shared by both sides of the attack (output and input); see ``docs/algorithm.md``.
"""

from __future__ import annotations

import torch

from fl_attack.config import AttackConfig
from fl_attack.core.columns import ColumnNoiseRtol
from fl_attack.core.tuning import TUNING
from fl_attack.steps.decompose import Decomposition

RANK_FLOOR = {torch.float32: 1e-6, torch.float64: 1e-13}
"""Relative size below which a singular value is rounding error, by the gradient's precision
(``decompose.decompose``'s ``floor_rtol``; rounding noise is not i.i.d.)."""

ZERO_FLOOR = {torch.float32: 1e-4, torch.float64: 1e-7}
"""Least numerical-zero tolerance for entries of L q, relative to the column's largest entry.
For float64 it is 1e-7, not ~1e-13: kernels taken from Gram matrices (polishing, face splitting)
are only accurate to about sqrt(eps) ≈ 1.5e-8, and a tighter floor makes face splitting miss
the samples of a face."""

NOISE_ZERO = 0.12
"""Under noise the zero tolerance is this multiple of the noise ratio (noise edge / σ_B, about
the relative error of L), capped at :data:`ZERO_CAP`."""

ZERO_CAP = 0.1

ZERO_SD = 5.0
"""Per-column zero test of a clean update with weak samples (:func:`output_tolerances`): an
entry of L q counts as zero within this many stds of the noise on L q. On MNIST models trained
3000 steps (tuning data) the true zero rows of the columns the update holds lie within 3-33
stds and their non-zero entries beyond 47 (a few weak columns excepted). At B = 20, 10 batches,
3, 5, 10 and 100 stds read 5 of the batches and 30 read 4 (mean PSNR 93, 90, 86, 84 and 83 dB);
5 keeps more of the true zeros than 3 where the noise estimate is off."""

Z_BAND = {torch.float32: 1e-5, torch.float64: 1e-10}
"""Relative band around a pre-activation of 0 within which its sign is rounding error (λ)."""

FLOAT32_STORED = 1e-11
"""A float64 gradient whose (B+1)-th singular value exceeds this fraction of the largest holds
float32-precision numbers (a noise floor above float64 rounding) and is treated as float32."""


def effective_precision(dec: Decomposition, precision: torch.dtype) -> torch.dtype:
    """``precision``, or float32 for float64 storage of float32-precision numbers
    (:data:`FLOAT32_STORED`)."""
    S, B = dec.singular_values, dec.batch_size
    if precision == torch.float64 and B < S.numel() and S[B] > FLOAT32_STORED * S[0]:
        return torch.float32
    return precision


def rank_floor(precision: torch.dtype) -> float:
    """:data:`RANK_FLOOR` for a gradient of ``precision`` (float32 for any coarser type)."""
    return RANK_FLOOR[torch.float32 if precision == torch.float32 else torch.float64]


def rounding_edge(weight: torch.Tensor, update: torch.Tensor, dtype: str) -> float:
    """An estimate of the largest singular value that storing ``W_E = weight - update`` in
    ``dtype`` adds to the update ``W₀ - W_E``.

    Storing rounds each entry by at most half its unit in the last place u: by about u/√12
    at random where the update is large against u, by the whole update entry where it is
    below u/2 (stored W_E is W₀ there). The estimate is the largest row norm plus the largest
    column norm of the matrix of u/2 (the form of Latała's and Bandeira and van Handel's
    bounds for independent entries). It is an estimate, not a bound: the rounding's spectral
    norm measured 0.3-0.35 of it on the quickstart CNN's fc1 after 3000 steps and 1.1-1.25 on
    an MNIST MLP after 1500 steps at learning rates 0.05-0.001, where storing swallows many
    update entries whole (``tests/test_trained_models.py``). Entries with ``W_E = 0`` carry no
    rounding.

    Parameters
    ----------
    weight, update : (m, n)
        ``W₀`` and ``W₀ - W_E`` (any float dtype; the difference is formed in float64).
    dtype
        The storage dtype of the client's weights (``AttackConfig.weights_dtype``).

    Returns
    -------
    float
        The estimate, in the update's units.
    """
    w_e = weight.double() - update.double()
    _, exponent = torch.frexp(w_e)  # |w| = f · 2^e with f in [0.5, 1)
    eps = torch.finfo(getattr(torch, dtype)).eps  # the unit in the last place of 1
    half_ulp = torch.ldexp(torch.full_like(w_e, eps), exponent - 2)  # of f · 2^e: eps 2^(e-1)
    sq = torch.where(w_e == 0, 0.0, half_ulp.square())
    return float(sq.sum(dim=1).max().sqrt() + sq.sum(dim=0).max().sqrt())


def tolerances(dec: Decomposition, cfg: AttackConfig,
               precision: torch.dtype) -> tuple[float, float]:
    """The zero tolerance and pre-activation band for a decomposition of an m x n gradient.

    Parameters
    ----------
    dec
        The gradient's decomposition. A known noise level (``cfg.noise`` a number) replaces
        its spectral noise estimate (``dec.noise_std``, ``dec.noise_edge`` are overwritten).
    cfg
        ``zero_rtol`` overrides the default tolerance.
    precision
        The coarsest precision of the inputs (``validation.input_precision``); float64
        storage of float32-precision numbers counts as float32 (:data:`FLOAT32_STORED`).

    Returns
    -------
    (zero_rtol, z_band)
        An entry of a column counts as zero below ``zero_rtol`` x its largest entry
        (:func:`default_zero_rtol`); pre-activations within ``z_band`` x the largest are
        rounding error (:data:`Z_BAND`).
    """
    if cfg.noise != "auto":
        m, n = dec.L.shape[0], dec.R.shape[1]
        dec.noise_std = float(cfg.noise)
        dec.noise_edge = float(cfg.noise) * (m**0.5 + n**0.5)
    precision = effective_precision(dec, precision)
    zero_rtol = cfg.zero_rtol or default_zero_rtol(precision, dec)
    z_band = Z_BAND[torch.float32] if precision == torch.float32 else Z_BAND[torch.float64]
    return zero_rtol, z_band


def noise_ratio(dec: Decomposition) -> float:
    """Estimated noise edge over the smallest signal singular value (≈ relative error of L)."""
    sigma_b = float(dec.singular_values[dec.batch_size - 1])
    return dec.noise_edge / sigma_b if sigma_b > 0 else float("inf")


def noisy_update(dec: Decomposition) -> bool:
    """Whether the decomposed update carries noise beyond the rounding of a clean gradient:
    its noise ratio exceeds ``Tuning.noisy_ratio`` (DP-SGD noise; float32 rounding of a large
    layer's weight difference can reach it too) and it is not :func:`rounding_limited`. The
    search then runs in its noisy mode (noise-scaled trust, the ReLU-law repair, λ stopping
    below 1)."""
    return noise_ratio(dec) > TUNING.noisy_ratio and not rounding_limited(dec)


def exact_possible(dec: Decomposition) -> bool:
    """Whether every sample of the update can be read exactly: its noise ratio (noise edge over
    the weakest sample's singular value) is at most ``Tuning.noisy_ratio``. Otherwise nothing
    is certified, whether the noise was added or is the rounding of a clean gradient."""
    return noise_ratio(dec) <= TUNING.noisy_ratio


def rounding_limited(dec: Decomposition) -> bool:
    """Whether an update is clean but its weakest samples sit near the float32 rounding: the
    spectrum drops below ``RANK_FLOOR[float32]`` of its largest value right after B, so no
    noise was added, while a trained model's confidently classified samples have gradients
    10⁴-10⁶ times smaller than the others (``experiments/results/training.md``), or, for a
    weight difference of stored weights, right after B the spectrum is within the weights'
    known rounding (``Decomposition.rounding_floor``). The search
    treats it as clean (the noise-mode steps assume i.i.d. noise and drop true columns there);
    its weakest samples are read only to the update's precision and nothing is certified
    (:func:`exact_possible`)."""
    S, B = dec.singular_values, dec.batch_size
    return (B >= S.numel() or float(S[B]) < RANK_FLOOR[torch.float32] * float(S[0])
            or float(S[B]) <= dec.rounding_floor)


def row_noise(dec: Decomposition, device: torch.device) -> torch.Tensor:
    """ν / s_j (B,): the noise on each column of L (``filtering.noise_scales``)."""
    S = dec.singular_values[:dec.batch_size].to(device=device, dtype=torch.float64)
    return dec.noise_std / S.clamp_min(torch.finfo(S.dtype).tiny)


def output_tolerances(dec: Decomposition, cfg: AttackConfig, precision: torch.dtype,
                      device: torch.device) -> tuple[float, float]:
    """:func:`tolerances` for the output side's search: the zero test tightened per column to
    :data:`ZERO_SD` noise stds (:class:`~fl_attack.core.columns.ColumnNoiseRtol`) when the
    update is clean (not :func:`noisy_update`, whose search scales its own trust by the noise),
    its tolerance is the default and looser than the precision's floor (weak samples near the
    rounding). A FedAvg sum's columns are zero exactly at the units inactive at every local
    step, so they take the same test: its small non-zero entries (a unit active at a few
    steps) are entries, not zeros. Otherwise :func:`tolerances` itself."""
    zero_rtol, z_band = tolerances(dec, cfg, precision)
    floor = zero_floor(effective_precision(dec, precision))
    if cfg.zero_rtol is not None or noisy_update(dec) or zero_rtol <= floor:
        return zero_rtol, z_band
    L = dec.L.to(device=device, dtype=torch.float64)
    return ColumnNoiseRtol(zero_rtol, L, row_noise(dec, device), floor, ZERO_SD), z_band


def zero_floor(precision: torch.dtype) -> float:
    """:data:`ZERO_FLOOR` for numbers of ``precision`` (float32 for any coarser type)."""
    return ZERO_FLOOR[torch.float64] if precision == torch.float64 else ZERO_FLOOR[torch.float32]


def default_zero_rtol(precision: torch.dtype, dec: Decomposition) -> float:
    """Numerical-zero tolerance for entries of L q, relative to the column's largest entry.

    The floor comes from the float precision (:data:`ZERO_FLOOR`); under noise (DP-SGD, float32
    weight updates) the entries of a true zero row scatter like the perturbation of L, about
    noise edge / σ_B (:data:`NOISE_ZERO`).
    """
    return min(max(zero_floor(precision), NOISE_ZERO * noise_ratio(dec)), ZERO_CAP)
