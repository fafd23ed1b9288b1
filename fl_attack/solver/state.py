"""The state of one search: what every step reads (:class:`SearchContext`, frozen) and what the
steps change as it runs (:class:`SearchState`).

The candidate pool has its own class (:class:`fl_attack.solver.pool.CandidatePool`). The
solver's steps are functions of (context, state, pool): :mod:`fl_attack.solver.candidates`
(search rounds and completions), :mod:`fl_attack.solver.certify` (selection, certificate,
repair) and :mod:`fl_attack.solver.loop` (the round loop and its stop rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fl_attack.config import FEDAVG_TAU, AttackConfig
from fl_attack.core.clock import Clock
from fl_attack.core.tuning import TUNING, Tuning
from fl_attack.steps import filtering, search
from fl_attack.steps.decompose import Decomposition
from fl_attack.steps.match import Match
from fl_attack.steps.peel import Peeled
from fl_attack.steps.scale import LayerSystem
from fl_attack.steps.tolerances import noisy_update, row_noise


@dataclass(frozen=True)
class SearchContext:
    """What a search reads and never changes: options, tuning, the decomposition and its
    thresholds, the budget.

    Build it with :func:`search_context`.
    """

    cfg: AttackConfig
    dec: Decomposition
    """G ≈ L R of the layer (of the transposed layer on the input side)."""
    system: LayerSystem
    """The products every selection and scale step reuses; its ``zero_rtol`` is the zero test."""
    generator: torch.Generator
    device: torch.device
    clock: Clock
    min_zeros: int
    """Least number of zero rows of a true column (τ m, SPEAR §4.1; at least B)."""
    noisy: bool
    """Noise detected in the update (``tolerances.noisy_update``): never certified."""
    row_noise: torch.Tensor | None
    """(B,) ν / s_j, the noise on L's columns (``filtering.noise_scales``), when noisy."""
    lambda_stop: float
    """λ at which the search stops (1, or ``Tuning.noisy_lambda_stop`` under noise)."""
    input_side: bool = False
    """Inverting through the layer's sparse inputs (``fl_attack.solver.input_side``): the SPEAR++
    rounds minimise the sign-aware loss and always restart uniformly."""
    tuning: Tuning = TUNING
    activation_span: torch.Tensor | None = None
    """(m, r) the next layer's activation span (``peel.next_layer_rows``), when its gradient
    is given on a clean update: the activation rounds run."""

    @property
    def B(self) -> int:
        """The batch size."""
        return self.dec.batch_size

    @property
    def L(self) -> torch.Tensor:
        """(m, B) the decomposition's left factor, orthonormal columns."""
        return self.dec.L

    @property
    def zero_rtol(self) -> float:
        """An entry of a column counts as zero below this fraction of its largest entry."""
        return self.system.zero_rtol

    @property
    def span_tol(self) -> float:
        """A unit direction closer than this to the span of the selected columns is the same
        up to noise (``Tuning.selection_tol`` zero tolerances, at least 1e-8): stage 1 does not
        take it, a swap does not put it in, the certificate does not settle on it."""
        return max(1e-8, self.tuning.selection_tol * self.zero_rtol)

    @property
    def complement_restarts(self) -> bool:
        """Whether ``cfg.deflate`` applies (later rounds start orthogonal to found columns);
        the input side's sign-aware loss has other basins and restarts uniformly."""
        return not self.input_side

    def n_rows(self) -> int:
        """Rows used by the first polishing pass: well inside any true column's zero set."""
        m = self.L.shape[0]
        return min(max(int(self.tuning.polish_rows_share * self.min_zeros), self.B + 2), m - 1)

    def objective(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The loss of the SPEAR++ rounds; None: the configured sparsity loss φ."""
        if not self.input_side:
            return None
        cfg, kappa = self.cfg, self.tuning.sign_penalty
        return lambda V: search.signed_sparsity_loss(V, cfg.loss, cfg.logcosh_alpha, kappa)


def search_context(cfg: AttackConfig, dec: Decomposition, system: LayerSystem,
                   generator: torch.Generator, device: torch.device, clock: Clock, *,
                   input_side: bool = False, tuning: Tuning = TUNING) -> SearchContext:
    """The :class:`SearchContext` of a decomposition: its thresholds and noise level.

    Parameters
    ----------
    cfg, dec, system, generator, device, clock
        The options, the decomposition and its products, the random generator, the device
        the search runs on and the call's budget.
    input_side
        Whether the search inverts ``Gᵀ`` (the layer's sparse inputs).
    tuning
        The search's constants.

    Returns
    -------
    SearchContext
    """
    B, m = dec.batch_size, dec.L.shape[0]
    tau = cfg.tau if cfg.tau is not None or not system.subset else FEDAVG_TAU
    min_zeros = max(filtering.min_zero_count(m, cfg.p_false_reject, tau), B)
    noisy = noisy_update(dec)
    return SearchContext(
        cfg=cfg, dec=dec, system=system, generator=generator, device=device, clock=clock,
        min_zeros=min_zeros, noisy=noisy, row_noise=row_noise(dec, device) if noisy else None,
        lambda_stop=cfg.lambda_stop or (tuning.noisy_lambda_stop if noisy else 1.0),
        input_side=input_side, tuning=tuning,
    )


def relaxed(ctx: SearchContext) -> SearchContext | None:
    """The context of a second pass with a lower zero threshold (``Tuning.relaxed_zero_rate``,
    at least ``Tuning.relaxed_zero_margin`` x B + 1) that completes from nothing before its
    first round (``AttackConfig.slice_first``, unless set), or None where there is none to
    take: a noisy update, an explicit ``AttackConfig.tau``, the input side, or a threshold
    already as low (a FedAvg sum starts at ``FEDAVG_TAU``, and its second pass keeps the
    completions' schedule)."""
    cfg, tuning, B, m = ctx.cfg, ctx.tuning, ctx.B, ctx.L.shape[0]
    if ctx.noisy or cfg.tau is not None or ctx.input_side:
        return None
    low = max(filtering.min_zero_count(m, cfg.p_false_reject, rate=tuning.relaxed_zero_rate),
              int(tuning.relaxed_zero_margin * B) + 1)
    if low >= ctx.min_zeros:
        return None
    # the completions from nothing place the zero rows by the layer's own pre-activations,
    # where the search's ℓ1 minima on a trained model are mixtures that cancel its dense rows
    first = cfg.slice_first
    if first is None:  # FedAvg completions keep their own schedule
        first = system_has_weights(ctx) and not ctx.system.subset
    return dataclasses.replace(ctx, min_zeros=low,
                               cfg=dataclasses.replace(cfg, slice_first=first))


def system_has_weights(ctx: SearchContext) -> bool:
    """Whether the layer's weight and bias are known (λ, completions)."""
    return ctx.system.WR is not None and ctx.system.bias is not None


STOP_REASONS = ("certified", "lambda", "found", "converged", "budget", "rounds", "samples",
                "single", "peeled", "starved")
"""Why a search ends (``Reconstruction.stopped``): ``certified``, λ = 1 with all B columns on a
clean update; ``lambda``, λ reached the stop level under noise (``Tuning.noisy_lambda_stop``, or
``AttackConfig.lambda_stop``) with all B columns trusted; ``found``, all B directions without the
weight and bias λ needs; ``converged``, a full basis stopped improving (``Tuning.stale_rounds``
rounds without a change; under noise any selection, without a better λ or a new selected or trusted
column, ``loop.search``); ``budget``, ``AttackConfig.max_seconds`` ran out; ``rounds``, the round
cap (``AttackConfig.max_rounds``); ``samples``, SPEAR's sample cap (``AttackConfig.max_samples``);
``single``, B = 1 (nothing to search); ``peeled``, the loop handed verified samples to the peeling
(``fl_attack.steps.peel``) and no level was left to search; ``starved``, a clean search that
could lower its zero threshold (``relaxed``) selected fewer than ``Tuning.starved_share`` of B
columns in ``Tuning.starved_rounds`` rounds, or no more for ``Tuning.stale_rounds`` rounds (the
second pass takes over; reported only when it has no time)."""


@dataclass
class SearchState:
    """What the steps of one search change as it runs."""

    rounds: int = 0
    swaps: int = 0
    samples: int = 0
    """Submatrices drawn so far (SPEAR sampling)."""
    match: Match | None = None
    """λ of the last full selection (None while fewer than B columns are selected)."""
    trusted: torch.Tensor | None = None
    """(B, F) columns believed right so far; completions and peeling start from them."""
    deflated: torch.Tensor | None = None
    """(B, F) columns whose complement later rounds search: the trusted ones; under noise all
    of a partial selection (the wrong ones are dominated by the noisiest singular vectors,
    and searching outside them keeps the search off those minima)."""
    faces_seen: set[bytes] = field(default_factory=set)
    """Zero patterns of the faces already split."""
    verdicts: dict[bytes, tuple[bool, int]] = field(default_factory=dict)
    """Feasibility of a column's zero pattern -> (feasible, missing columns when checked)."""
    completed: dict[tuple[int, int, int], int] = field(default_factory=dict)
    """Completion calls per (missing, found, round) of the current search pass."""
    peel_tried: set[bytes] = field(default_factory=set)
    """Zero patterns of the columns whose samples peeling already tried."""
    activation_found: torch.Tensor | None = None
    """(B, F) exact columns the activation rounds found (``candidates.activation_round``);
    later descents search outside them."""
    activation_coords: torch.Tensor | None = None
    """(F, B) the coordinates c (x = cᵀ R) of the exact points behind ``activation_found``'s
    columns, in the same order: rows of Q⁻¹, whose complement holds the missing columns
    (``candidates.verified_complement``)."""
    verified: Peeled | None = None
    """Samples recovered on their own through the next layer but not peeled off, verified or
    only read (``Peeled.proven``, ``peel.READ_RTOL``): those of the activation rounds' exact
    columns (``peel.recover`` on each point's inactive units), of the sparsest found columns,
    and of a peel that left no clean rank. The verified ones' rows of the result are these
    inputs whatever the rest of the basis; the read ones' only in a basis not proven."""
    recover: Callable[..., Peeled] | None = None
    """Recovers and verifies the samples of columns through the next layer
    (``peel.recover``); unlike ``peeler`` it stays set when peeling is given up."""
    peeler: Callable[..., Peeled] | None = None
    """Recovers and verifies the samples of found columns (``fl_attack.steps.peel``), if given."""
    peeled: Peeled | None = None
    """Set when the search stopped to let the samples read through the next layer (verified
    or only read, ``Peeled.proven``) be peeled off."""
    exhausted: bool = False
    """Set when the budget ran out before the search or the final selection ended."""
    stopped: str = ""
    """Why the last search loop ended (``loop.search``): one of :data:`STOP_REASONS`."""
