"""``sparse="auto"``: invert through both sides of a layer between two ReLUs, keep the better.

A layer preceded and followed by a ReLU is sparse on both sides (SPEAR §3.2): its output
gradients ∂L/∂Z (:mod:`fl_attack.solver.output_side`) and its inputs X
(:mod:`fl_attack.solver.input_side`).
:func:`invert_auto` attacks the output side first; if that is not certified it attacks the input
side with the rest of the budget, and :func:`better_side` decides which reconstruction to return
by :func:`side_score`, computed the same way for both from the public G, W, b. The gradient's
decomposition is computed once and serves the output side and the scores' tolerances.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock
from fl_attack.result import Reconstruction
from fl_attack.solver import input_side, output_side
from fl_attack.steps.decompose import decompose
from fl_attack.steps.tolerances import rank_floor, tolerances
from fl_attack.validation import LayerUpdate


def side_score(
    X: torch.Tensor,
    G: torch.Tensor,
    W: torch.Tensor | None,
    b: torch.Tensor | None,
    *,
    zero_rtol: float,
    z_band: float = 0.0,
) -> float:
    """Consistency of inputs ``X`` (B, n) with a layer between two ReLUs, for either side.

    Computed from ``X`` and the public ``G`` (m, n), ``W``, ``b`` only, the same way whichever
    side produced ``X``, so that ``"auto"`` can compare the two sides' results. It is the mean of

    * λ of ``X`` and its implied output gradients ``D̂ᵀ = G X⁺`` (from ``G = D̂ᵀ X``, both sides'
      results fit G): the fraction of the m B entries where "``W x_i + b ≤ 0``" agrees with
      "``D̂`` numerically zero" (:func:`fl_attack.solver.input_side.pattern_match`; the ReLU *after*
      the layer); and
    * the fraction of samples ``x_i`` with no entry below ``-zero_rtol · max|x_i|`` (the ReLU
      *before* the layer: its outputs have no negative entry).

    Both are 1 for the true batch. Neither suffices alone: at deep layers the biases dominate
    ``z``, so wrong inputs keep a high λ, while a wrong row has negative entries; on a first
    layer (signed inputs) the row test is 0 for both sides and λ decides. The row test counts
    whole samples, not entries: a nearly-right mixture has only a few slightly negative
    entries. Without ``W``, ``b`` only the row test.
    """
    X = X.to(G)
    xmax = X.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny)
    rows = float((X >= -zero_rtol * xmax).all(dim=1).double().mean())
    if W is None or b is None:
        return rows
    D = (G @ torch.linalg.pinv(X)).T  # (B, m)
    one = torch.ones(X.shape[0], dtype=X.dtype, device=X.device)
    lam = input_side.pattern_match(X, D, one, W, b, zero_rtol=zero_rtol, z_band=z_band).value
    return (lam + rows) / 2


def better_side(
    out: Reconstruction,
    inp: Reconstruction,
    G: torch.Tensor,
    W: torch.Tensor | None,
    b: torch.Tensor | None,
    *,
    zero_rtol: float,
    z_band: float = 0.0,
) -> tuple[Reconstruction, Reconstruction]:
    """``"auto"``'s rule: which of the two sides' results to return.

    Parameters
    ----------
    out, inp
        The output side's and the input side's reconstructions of the same layer.
    G : (m, n)
        The layer's weight gradient; ``W`` (m, n) and ``b`` (m,) its parameters, or None.
    zero_rtol, z_band
        The tolerances of the layer's decomposition (``tolerances.tolerances``).

    Returns
    -------
    (best, other)
        Ordered by (certified exact, :func:`side_score`, directions found); the output side
        on ties. Each side's own ``sparsity_match`` is not used: the two λ are computed on
        different factorisations and do not compare (see :func:`side_score`).
    """
    def rank(rec: Reconstruction) -> tuple[bool, float, int]:
        score = side_score(rec.inputs, G, W, b, zero_rtol=zero_rtol, z_band=z_band)
        return rec.exact, score, rec.n_directions

    return (inp, out) if rank(inp) > rank(out) else (out, inp)


def invert_auto(layer: LayerUpdate, cfg: AttackConfig, seed: int,
                clock: Clock) -> Reconstruction:
    """``sparse="auto"``: the output side first; if it is not exact, the input side as well.

    Parameters
    ----------
    layer, cfg, seed, clock
        As for :func:`fl_attack.solver.input_side.invert_inputs`; ``max_seconds`` bounds the two
        attempts together (the input side gets what the output side left, but always at least
        one search round).

    Returns
    -------
    Reconstruction
        The better of the two by :func:`better_side`; ``config.sparse`` names the side used
        and ``timings["other_side"]`` the seconds spent on the side not returned.
    """
    G, W, b = layer.weight_grad, layer.weight, layer.bias
    t0 = time.perf_counter()
    dec = decompose(G, batch_size=cfg.batch_size, rank_margin=cfg.rank_margin,
                    floor_rtol=rank_floor(layer.precision), noise_floor=layer.rounding_edge)
    out_clock = Clock(cfg.max_seconds, start=t0)
    out_clock.tick("decompose", t0)
    out = output_side.invert_output(dataclasses.replace(layer, next_weight_grad=None),
                               dataclasses.replace(cfg, sparse="output"), seed, out_clock, dec=dec)
    if out.exact:
        out.seconds = clock.elapsed()
        return out
    budget = cfg.max_seconds
    if budget is not None:
        budget = max(budget - clock.elapsed(), 1e-3)
    inp = input_side.invert_inputs(layer, dataclasses.replace(cfg, max_seconds=budget), seed,
                                    Clock(budget))
    zero_rtol, z_band = tolerances(dec, cfg, layer.precision)
    best, other = better_side(out, inp, G, W, b, zero_rtol=zero_rtol, z_band=z_band)
    best.budget_exhausted = out.budget_exhausted or inp.budget_exhausted
    best.timings["other_side"] = other.seconds
    best.seconds = clock.elapsed()
    best.config = dataclasses.replace(best.config or cfg, max_seconds=cfg.max_seconds)
    return best
