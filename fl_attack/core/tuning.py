"""The search's tuning constants, in one place with their defaults.

These are not user options (those are :class:`fl_attack.AttackConfig`): they are the choices the
search makes between its steps, tuned on real photo batches. ``docs/algorithm.md`` says where
each one acts; the measurements behind the values are in ``experiments/results/tuning.md``.
The numerical tolerances (zero tests, rank floors) are in :mod:`fl_attack.steps.tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Constants of the search loop (:mod:`fl_attack.solver.loop`) and its steps."""

    stale_rounds: int = 3
    """SPEAR++ rounds without a new candidate after which a full basis with λ < 1 is final
    (with ``update="fedavg"``: rounds without a change of λ, ``loop.search``)."""
    slice_patience: int = 3
    """Slice-sampling calls on one found set (per round) before the search takes over; each
    call draws new points and its yield is random."""
    peel_share: float = 0.5
    """With a next layer, found samples are peeled off during the completions once this share
    of B new trusted columns is there, otherwise after them (peeling right after a round's
    search is too early: the completions find most columns)."""
    peel_time_share: float = 0.5
    """Past this share of ``max_seconds`` a tenth of B new trusted columns is enough to peel
    (the levels below need the time)."""
    seed_tol: float = 1e-4
    """A direction counts as inside a level's column space when its projection keeps this much
    of its unit norm (float32 factors are ~1e-7 off)."""
    polish_chunk: int = 256
    """Directions polished at once under a time budget (the budget is checked between chunks)."""
    noisy_ratio: float = 1e-3
    """Noise edge over σ_B above which an update counts as noisy: λ then stops the search below
    1 and no result is certified."""
    noisy_trust: float = 0.75
    """Under noise a selected column is trusted (completions and peeling start from it, and the
    search ends only with all B trusted) when its ``filtering.noisy_sparsity`` is at least this
    share of the least zero count of a true column."""
    noisy_lambda_stop: float = 0.98
    """λ at which a search on a noisy update stops (no basis reaches 1 under noise), once all B
    columns are trusted."""
    noisy_violations: int = 2
    """Under noise a column of a full selection with more confident violations of the ReLU law
    than this (``violations.law_violations``) is not trusted (the search goes on, completing
    it from the others) and the final selection repairs it (``violations.repair``). The true
    basis shows at most one per column at f = 0.05-0.1 on the tuning batches."""
    neighbour_share: float = 0.25
    """Share of ``max_seconds`` the neighbour search after round 1 may take (half of it for
    the seeds, ``faces.conditional_directions``)."""
    finish_share: float = 0.25
    """Share of ``max_seconds`` the final selection (swaps, repair) may take past the search's
    budget: a call ends within about (1 + this) x ``max_seconds``."""
    activation_after: int = 1
    """With the next layer's gradient, SPEAR++ rounds before the activation rounds
    (``candidates.activation_round``) begin; from then on the two alternate."""
    activation_starts: int = 150
    """Starts of each kind (rows of G, Gaussian) of an activation round."""
    activation_steps: int = 1000
    """Adam iterations of an activation round's descent."""
    activation_lr: float = 0.2
    """Adam's step size in the row space's orthonormal coordinates."""
    activation_descents: int = 50
    """Descents of one activation round (each outside the columns the earlier ones found)."""
    activation_min_new: int = 2
    """An activation round stops after a descent that finds fewer new exact columns: the
    last few descents of a round find one column each in the time a search round in the
    complement of the samples found takes (MNIST, B = 100)."""
    starts_floor: int = 256
    """Least number of random starts of a SPEAR++ round (``AttackConfig.n_init`` = None)."""
    starts_per_column: int = 20
    """Random starts per column sought (all B at first, then the missing ones)."""
    minima_dedupe: float = 1e-4
    """Optimised directions closer than this (1 - |cos|) are one minimum (most starts share a
    few minima); the pool deduplicates with ``AttackConfig.dedupe_tol``."""
    irls_per_column: int = 4
    """IRLS (on wide layers) rounds this many of a round's sparsest minima per column
    sought; the others are only rounded by kernels (``candidates.spearpp_round``)."""
    small_batch: int = 32
    """Largest B that splits :attr:`faces_small` new faces per round, larger B
    :attr:`faces_large` (``AttackConfig.max_faces`` = None)."""
    faces_small: int = 128
    faces_large: int = 16
    polish_rows_share: float = 0.75
    """Rows of the first polishing pass, as a share of the least zero count of a true column:
    well inside any true column's zero set."""
    relaxed_zero_rate: float = 0.25
    """When a clean search with the papers' zero threshold (each unit inactive with probability
    1/2, SPEAR §4.1) ends without B columns and with budget left, it goes on with the threshold
    of a column whose units are inactive with this probability (and at least
    :attr:`relaxed_zero_margin` x B): the columns of a trained model keep fewer zeros (units
    active for every sample), and the papers' threshold drops them all
    (``experiments/results/training.md``)."""
    starved_rounds: int = 1
    """A clean search that after this many rounds has selected fewer than
    :attr:`starved_share` of its B columns, or has not selected more for
    :attr:`stale_rounds` rounds, and could lower its zero threshold, ends its first pass
    (``"starved"``) so that the second pass, with the lower threshold, gets the budget."""
    starved_share: float = 0.25
    relaxed_zero_margin: float = 1.25
    """The relaxed threshold is at least this many times B (and one more): below it the
    kernels of B - 1 rows with a few chance zeros flood the pool."""
    repair_candidates: int = 64
    """Sparsest completion candidates tried by the repair of one or two columns."""
    repair_candidates_three: int = 24
    """The same for three columns: C(24, 3) = 2024 trial bases."""
    selection_tol: float = 10.0
    """Stage 1 takes a direction when its distance to the span of those chosen exceeds this
    many zero tolerances (closer ones are the same up to noise), and at least 1e-8."""
    sign_penalty: float = 5.0
    """Weight κ of the sign penalty in the input side's search loss
    (``search.signed_sparsity_loss``)."""


TUNING = Tuning()
"""The defaults every search uses."""
