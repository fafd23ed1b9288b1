"""What an attack returns: :class:`Reconstruction`, its certificate and the one builder both
sides of the attack use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock


@dataclass
class Reconstruction:
    """Result of an inversion. ``inputs`` rows are the layer's inputs, in arbitrary order."""

    inputs: torch.Tensor
    """(B, n) reconstructed inputs of the layer, float64 on the CPU."""
    batch_size: int
    """Detected (or given) batch size B."""
    sparsity_match: float | None
    """λ ∈ [0, 1]; None without ``weight`` and ``bias``. Active units whose ∂L/∂Z is
    indistinguishable from zero count as matches when they are the only mismatches and no
    more than chance explains (``chance_zeros``; ``match.sparsity_match``). With
    ``update="fedavg"`` a completed direction counts as unmatched (dense, it would pass that
    reading's one-sided test vacuously), so λ is at most ``n_directions / batch_size``."""
    exact: bool
    """True when λ = 1 with all B directions found, no noise detected and every column pinned
    down by its own zero rows (``certify.pinning``: SPEAR Theorem 3.3 checked on the
    reconstruction; a group of samples whose patterns nest counts only when read through the
    next layer, ``untangled``): the reconstruction is certified without ground truth. Never
    under noise (DP-SGD), where λ counts agreement within a noise tolerance, and never for
    ``update="fedavg"``, whose λ checks only that zero rows are inactive units: report PSNR."""
    n_directions: int
    """Directions found by the search; < B means a partial reconstruction, in which *no* sample
    is guaranteed: every row of Q⁻¹ depends on all B columns."""
    method: str
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    n_candidates: int = 0
    swaps: int = 0
    noise_std: float = 0.0
    noisy: bool = False
    """Noise was detected on the update (``tolerances.noisy_update``): never certified."""
    rounding_limited: bool = False
    """A clean update whose weakest samples sit near the float32 rounding
    (``tolerances.rounding_limited``: a trained model's confidently classified samples): they
    are read only to the update's precision, and nothing is certified."""
    scales: torch.Tensor | None = None
    """Per-sample scale of ∂L/∂Z columns (sign tells nothing; magnitude ~ per-sample loss grad)."""
    column_match: torch.Tensor | None = None
    """Per-sample sparsity match (fraction of the m entries whose patterns agree)."""
    config: AttackConfig | None = None
    chance_zeros: int = 0
    """Entries counted as matches in λ although the paper's λ₊ term counts them as mismatches:
    an active unit whose ∂L/∂Z passed the zero test (its ∂L/∂A is that small; the ReLU law
    allows it). 0 when λ < 1."""
    peeled: int = 0
    """Samples recovered one by one through ``next_weight_grad`` and taken off the gradient
    before the rest of the batch was searched (``fl_attack.steps.peel``): each verified on its
    own (then its row is in :attr:`verified`) or only read to ``peel.READ_RTOL``."""
    batch_size_readings: tuple[int, ...] = ()
    """Under noise, the batch sizes the spectrum allowed and that were attacked, when more than
    one (``fl_attack.steps.batch_size``: the one that explains the update best is returned)."""
    reading_scores: tuple[float, ...] = ()
    """The criterion of each reading in ``batch_size_readings``
    (``steps.batch_size.criterion``, smaller is better: the returned one has the smallest)."""
    mixed: tuple[tuple[int, ...], ...] = ()
    """Groups of samples (row indices of ``inputs``) that the update determines only up to a
    mixture of each other: their ReLU patterns nest (every unit inactive for one is inactive
    for another), so a family of reconstructions of the group has λ = 1 and this layer alone
    cannot tell which is the batch (``certify.Pinning``). A batch with such a group is never
    certified; its other samples are read as usual. Empty for noisy or partial
    reconstructions."""
    merged: int = 0
    """Samples of an explicit ``batch_size`` the update does not separate: the reconstruction
    has B - merged samples, and each of those missing is within the noise (or the rounding)
    of one it has (two augmented views of one picture, a sample given twice). Such a result
    is not certified: the merged samples are read only as one another."""
    untangled: int = 0
    """Samples of groups the layer read only up to a mixture that were then read exactly,
    each verified on its own, through the next layer's weight gradient
    (``fl_attack.solver.untangle``)."""
    verified: tuple[int, ...] = ()
    """Rows of ``inputs`` whose samples were found as points of the layer's row space with
    their activations in the next layer's activation span, then recovered and verified on
    their own through ``next_weight_grad`` (``fl_attack.steps.activations``,
    ``fl_attack.steps.peel``): exact to the update's precision whatever the rest of the
    basis, also when the batch is not certified."""
    sample_errors: torch.Tensor | None = None
    """(B,) each row's relative error from the update's noise or float32 rounding
    (``fl_attack.solver.unproven.sample_errors``: the noise edge carried through the solve
    X = D⁺ G), float64; about 10^-d for a sample the update holds to d digits. A certified
    batch has every entry within the certificate's bound (``Tuning.noisy_ratio``). A
    first-order bound where the columns are exact (a certified batch); in an uncertified
    batch the named rows' imprecise columns move the other rows too, beyond it."""
    unproven: tuple[tuple[int, str], ...] = ()
    """When the batch is not certified: the rows of ``inputs`` that keep it from being
    proven, each with the first condition it fails, a key of
    ``fl_attack.solver.unproven.REASONS`` (``"rounding"``, ``"mixture"``, ``"not-found"``,
    ...). With a direction completed (``"not-found"``) every row not ``verified`` is named
    (found ones ``"incomplete"``): each row of the solve depends on every column. Otherwise
    rows not named pass every per-sample condition; they are exact only if the named ones
    are. Empty when certified, and
    empty for a batch kept from its certificate by something no row carries (samples
    ``merged``, a failed ReLU check of the input side)."""
    budget_exhausted: bool = False
    """True when the time budget (``AttackConfig.max_seconds``) ran out before the search
    ended by its own stop rule, or before the final selection finished: the result is the best
    selection found in the time given, and a larger budget may find more."""
    stopped: str = ""
    """Why the search ended: ``"certified"`` (λ = 1 with all B columns, no noise),
    ``"lambda"`` (λ reached its stop level: under noise ``Tuning.noisy_lambda_stop`` with all
    B columns trusted), ``"found"`` (all B directions, no weight and bias for λ),
    ``"converged"`` (a full basis stopped improving for ``Tuning.stale_rounds`` rounds; under
    noise any selection: no better λ, no new selected or trusted column), ``"budget"``
    (``AttackConfig.max_seconds``), ``"rounds"`` (the round cap), ``"samples"`` (SPEAR's
    sample cap), ``"single"`` (B = 1) or ``"peeled"`` (every sample recovered through the
    next layer). With peeling, the last level's reason (``"budget"`` if any level ran out of
    time). ``budget_exhausted`` says in addition whether the final selection was cut short."""

    @property
    def partial(self) -> bool:
        """True when fewer than B directions were found (the rest of Q̄ was completed)."""
        return self.n_directions < self.batch_size

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe summary (no tensors) for logs and metric records."""
        return {
            "method": self.method,
            "batch_size": self.batch_size,
            "n_directions": self.n_directions,
            "partial": self.partial,
            "sparsity_match": self.sparsity_match,
            "exact": self.exact,
            "seconds": round(self.seconds, 4),
            "rounds": self.rounds,
            "n_candidates": self.n_candidates,
            "swaps": self.swaps,
            "noise_std": self.noise_std,
            "noisy": self.noisy,
            "rounding_limited": self.rounding_limited,
            "update": self.config.update if self.config is not None else "gradient",
            "chance_zeros": self.chance_zeros,
            "peeled": self.peeled,
            "budget_exhausted": self.budget_exhausted,
            "stopped": self.stopped,
            "mixed": [list(group) for group in self.mixed],
            "untangled": self.untangled,
            "verified": list(self.verified),
            "unproven": [[row, why] for row, why in self.unproven],
            "merged": self.merged,
            "batch_size_readings": list(self.batch_size_readings),
            "reading_scores": [round(v, 1) for v in self.reading_scores],
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
        }


def certified(sparsity_match: float | None, n_found: int, batch_size: int, *,
              noisy: bool, nonnegative: bool = True, supported: bool = True,
              precise: bool = True) -> bool:
    """Whether a reconstruction may be marked exact without ground truth.

    Parameters
    ----------
    sparsity_match
        λ of the selected basis (None without the layer's weight and bias: no certificate).
    n_found, batch_size
        Directions found by the search, and B.
    noisy
        Whether noise was detected in the update (``tolerances.noisy_update``). Under noise λ counts
        agreement within a noise tolerance and can reach 1 for an inexact batch, so a noisy
        update is never certified.
    nonnegative
        The input side's extra condition (every recovered input a possible ReLU output).
    supported
        Every column is pinned down by its own zero rows (``certify.supported``; SPEAR
        Theorem 3.3 checked on the reconstruction): without it λ = 1 does not single out the
        batch.
    precise
        The update holds every sample above its rounding (``tolerances.exact_possible``).

    Returns
    -------
    bool
        λ = 1, all B directions found, no noise, ``nonnegative``, ``supported``, ``precise``.
    """
    return (sparsity_match is not None and sparsity_match >= 1.0 and n_found == batch_size
            and not noisy and nonnegative and supported and precise)


def build_reconstruction(
    inputs: torch.Tensor,
    *,
    cfg: AttackConfig,
    clock: Clock,
    batch_size: int,
    n_found: int,
    sparsity_match: float | None,
    per_column: torch.Tensor | None,
    units: int,
    chance_zeros: int,
    noisy: bool,
    noise_std: float,
    scales: torch.Tensor,
    rounds: int,
    n_candidates: int,
    swaps: int,
    exhausted: bool,
    peeled: int = 0,
    nonnegative: bool = True,
    supported: bool = True,
    stopped: str = "",
    mixed: tuple[tuple[int, ...], ...] = (),
    untangled: int = 0,
    precise: bool = True,
) -> Reconstruction:
    """The :class:`Reconstruction` of either side of the attack.

    Parameters
    ----------
    inputs : (B, n)
        The reconstructed inputs (any device; returned on the CPU).
    cfg
        The configuration the side ran with (its ``sparse`` names the side).
    clock
        The side's clock: ``seconds`` is its elapsed time, ``timings`` its step timings.
    batch_size, n_found
        B and the directions found by the search (< B: partial).
    sparsity_match, per_column : (B,), units
        λ and the matching entries per sample (out of the layer's m ``units``), or None
        without weight and bias.
    chance_zeros, noisy, noise_std, nonnegative, supported, precise
        What the certificate needs (:func:`certified`) and reports (an imprecise update
        that is not noisy is ``rounding_limited``).
    scales : (B,)
        The per-sample scales.
    rounds, n_candidates, swaps, peeled, exhausted
        The search's counters and whether the budget ended it.
    stopped
        Why the search ended (``state.STOP_REASONS``); ``"certified"`` becomes ``"lambda"``
        when the certificate's other conditions fail (``nonnegative``, ``supported``).
    mixed, untangled
        The samples read only up to a mixture of each other (``certify.Pinning.groups``),
        and those of such groups read exactly through the next layer.

    Returns
    -------
    Reconstruction
    """
    col = None
    if per_column is not None:
        col = (per_column.double() / units).cpu()
    exact = certified(sparsity_match, n_found, batch_size, noisy=noisy,
                      nonnegative=nonnegative, supported=supported, precise=precise)
    if stopped == "certified" and not exact:
        stopped = "lambda"
    return Reconstruction(
        inputs=inputs.cpu(), batch_size=batch_size, sparsity_match=sparsity_match, exact=exact,
        n_directions=n_found, method=cfg.method, seconds=clock.elapsed(),
        timings=clock.timings, rounds=rounds, n_candidates=n_candidates, swaps=swaps,
        noise_std=noise_std, noisy=noisy, rounding_limited=not (noisy or precise),
        scales=scales.cpu(), column_match=col, config=cfg,
        chance_zeros=chance_zeros, peeled=peeled, budget_exhausted=exhausted,
        stopped=stopped, mixed=mixed, untangled=untangled,
    )
