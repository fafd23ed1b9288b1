"""Configuration of the attack: one dataclass with documented, validated defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("spear++", "spear")
LOSSES = ("l1", "logcosh", "l4")
OPTIMIZERS = ("radam", "pgd")
SPARSE_SIDES = ("output", "input", "auto")
UPDATES = ("gradient", "fedavg")
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
FEDAVG_TAU = 0.2
"""Default τ for ``update="fedavg"``: the zero fraction a column must show (see ``update``)."""
DEFAULT_MAX_SECONDS = 120.0
"""Default ``AttackConfig.max_seconds``: every call is bounded unless the caller passes
``max_seconds=None``. Sized for clean FedSGD batches up to (100, 1000); larger layers
(B = 150-210, m = 4000) need a larger budget or ``next_weight_grad`` (the timings behind this
are in ``experiments/results/tuning.md``)."""
WIDE_LAYER = 500
"""Outputs m from which the search drops the PGD rounds and adds IRLS rounding by default."""


@dataclass
class AttackConfig:
    """Options of :func:`fl_attack.invert`. Defaults work without tuning on FedSGD gradients.

    Attributes are grouped by the step of the attack they control (``docs/algorithm.md``
    describes the steps; the search's internal constants are in :mod:`fl_attack.core.tuning`).
    """

    # --- which attack ---------------------------------------------------------------------------
    method: str = "spear++"
    """``"spear++"`` (dictionary learning, polynomial in B) or ``"spear"`` (sampling)."""
    update: str = "gradient"
    """What the client sent. ``"gradient"``: one gradient step (FedSGD, DP-SGD): a column's zero
    rows are exactly the units its sample leaves inactive. ``"fedavg"``: ``W₀ - W_E`` after E
    full-batch local steps from ``weight``/``bias`` = W₀: a column sums its sample's gradients
    over the steps, so its zero rows are the units inactive at *every* step, a subset of those
    inactive at W₀. λ then counts a zero row as matching when the reconstruction is inactive
    there at W₀ (and every non-zero row), so λ = 1 says "every zero is explained by W₀";
    a mixture of samples passes that test where all of them are inactive, and such a reading is
    never certified (``certify.supported``; ``docs/algorithm.md``, "The certificate");
    the zero threshold τ drops to :data:`FEDAVG_TAU` (columns lose zeros as training drifts); the
    completions use only the most negative rows of a missing sample's W₀ pattern. With mini-batches
    the inclusion holds only approximately (a sample's first step is not at W₀), still better than
    ``"gradient"`` (``experiments/results/fedavg.md``). Not for noisy sums: with DP-SGD noise every
    zero within the noise tolerance passes the inclusion test and λ stops choosing between
    candidates (``experiments/results/dp.md``); clipping alone works with both."""
    weights_dtype: str | None = None
    """The dtype the client stores its weights in (``"float32"``, ``"float16"``, ``"bfloat16"``,
    ``"float64"``) when ``weight_grad`` is ``W₀ - W_E``: its rounding is never read as samples
    (``tolerances.rounding_edge``); below float64, float32's tolerances. Needs ``weight``."""
    sparse: str = "output"
    """Which factor is sparse: ``"output"`` (∂L/∂Z, any layer followed by ReLU), ``"input"`` (the
    layer's inputs, a layer preceded by ReLU) or ``"auto"`` (try output, then input; keep the
    better, see :mod:`fl_attack.solver.both_sides`)."""

    # --- decomposition (SPEAR §3.1, SPEAR++ §4.1) -----------------------------------------------
    batch_size: int | None = None
    """Override the batch size B read off the gradient's numerical rank."""
    rank_margin: float = 2.0
    """A singular value counts as signal when above ``rank_margin`` x the estimated noise edge
    ν(√m+√n) (Marchenko-Pastur). Also guards against float rounding in clean gradients."""

    # --- SPEAR++ search (SPEAR++ §4.2) ------------------------------------------------------------
    loss: str = "l1"
    """Sparsity surrogate: ``"l1"`` (best), ``"logcosh"`` (smooth) or ``"l4"`` (−ℓ4, weakest)."""
    optimizer: str = "radam"
    """``"radam"`` (Riemannian Adam on the sphere, geoopt) or ``"pgd"`` (projected gradient)."""
    n_init: int | None = None
    """Random initialisations per round, optimised as one B x K batch. None: ``max(256, 20 B)``,
    and ``max(256, 20 k)`` in rounds that start in the complement of the F found columns
    (k = B - F missing; polishing and IRLS cost grows with K, ~O(K m B²); the two numbers are
    ``Tuning.starts_floor`` and ``Tuning.starts_per_column``)."""
    steps: int = 300
    """Optimisation steps per round (the paper used 500; polishing makes fewer enough)."""
    lr: float | None = None
    """Initial learning rate. None: 0.1 for radam, 5.0 for pgd (PGD steps on the mean loss)."""
    lr_milestones: tuple[float, ...] = (0.4, 0.8)
    """Fractions of ``steps`` at which the learning rate is multiplied by ``lr_gamma``."""
    lr_gamma: float = 0.1
    alternate: bool | None = None
    """Use the other optimiser every second round (RAdam and PGD stall at different minima).
    None: on for layers with m < :data:`WIDE_LAYER` outputs (on wide layers the PGD rounds
    found few columns)."""
    logcosh_alpha: float = 20.0
    """Sharpness α of LogCosh, applied to entries scaled to unit RMS (lost in the paper; tuned)."""
    deflate: bool = True
    """Rounds after the first start only orthogonally to the columns found so far
    (``search.random_complement``), where the missing columns' basins are."""
    max_rounds: int | None = None
    """Rounds of fresh initialisations before giving up on missing directions, over every
    pass of a search. None: ``max(12, B // 4)`` per pass (a search that ends without its
    columns may take a second pass with a lower zero threshold, ``solver.output_side``). Rounds
    after the first are cheap (restarts in the complement of what is found), and hard batches
    need many of them."""
    max_seconds: float | None = DEFAULT_MAX_SECONDS
    """Wall-clock budget of one call in seconds (default :data:`DEFAULT_MAX_SECONDS`); ``None``
    means no limit. When it runs out the best selection so far is returned and
    ``Reconstruction.budget_exhausted`` is True. Checked between steps and inside the long ones
    (every 10 optimiser steps, between chunks of IRLS, polishing, kernel screening, LPs and
    peeled columns), so the search ends within about one chunk of it. The final selection
    (greedy swaps, repair, noisy refit) may then take up to a quarter of the budget more
    (``Tuning.finish_share``), so a call returns within about 1.25 x ``max_seconds`` plus one
    chunk. Without a limit a noisy update can keep the search busy for many minutes (all
    rounds, swaps and repairs run to their caps)."""

    # --- SPEAR sampling (SPEAR §3.3, §5.1) --------------------------------------------------------
    samples_per_step: int = 4096
    """(B-1) x B submatrices drawn and solved at once per sampling step."""
    max_samples: int = 2_000_000
    """Sampling budget of SPEAR (the paper allows up to 2e9 on a GPU)."""

    # --- polishing / rounding and filtering (SPEAR++ §4.3-§4.4, SPEAR §4.1) ---------------------
    polish: bool = True
    """Round every optimised direction to the exact kernel of its predicted zero rows."""
    irls: bool | None = None
    """After the first round, also round every optimised direction by reweighted least squares
    towards the sparsest direction nearby (``polish.irls_round``): recovers columns that are
    not ℓ1 minima (on real data a similar sample often pulls the minimum a few degrees off).
    None: on for layers with m ≥ :data:`WIDE_LAYER` outputs; on narrow layers its extra sparse
    candidates crowd the selection."""
    zero_rtol: float | None = None
    """An entry of L q counts as zero below ``zero_rtol`` x the column's max. None: from the
    precision of the gradient (1e-7 float64, 1e-4 float32) or from the estimated noise."""
    p_false_reject: float = 1e-5
    """Probability that a true direction is rejected by the sparsity threshold τ (binomial tail)."""
    tau: float | None = None
    """Override the minimal fraction of zeros a candidate needs. None: from the binomial tail
    (``p_false_reject``), or :data:`FEDAVG_TAU` for ``update="fedavg"``."""
    max_leverage: float = 0.99
    """Reject candidates with a zero row of leverage above this (coincidental zeros)."""
    max_faces: int | None = None
    """New faces split per search round (each costs one small batched sampling, O(B³) and up).
    None: 128 for B ≤ 32, else 16 (``Tuning.faces_small``, ``Tuning.faces_large``): at large B
    restarts orthogonal to the found columns (``deflate``) recover more columns per second."""
    max_face_dim: int = 8
    """Largest face (group of samples sharing their zero rows) split by sampling."""
    dedupe_tol: float = 1e-6
    """Directions with |cos| > 1 - dedupe_tol are duplicates (up to sign)."""
    slice_first: bool | None = None
    """Before the first search round, sample the slice of all B samples (found set empty) and
    complete from there; the search then starts in the complement of what that found. Needs
    ``weight`` and ``bias``. None: on for layers with m ≥ :data:`WIDE_LAYER` outputs and clean
    single-step gradients (there the completions find columns at several times the search's
    rate), off on narrow layers (where it gains little and can cost a certificate), FedAvg sums
    and noisy updates (the measurements: ``experiments/results/tuning.md``)."""
    slice_samples: int = 2048
    """Points drawn on the slice of the missing samples, each round, when 2 or more columns are
    missing (``completion.sample_missing``, needs ``weight`` and ``bias``; for 2-3 after the
    exact completion); 0 turns it off. Each point gives up to three row sets (its B most
    negative rows, 60% and 75% of its negative rows)."""

    # --- selection (SPEAR §4.2) -------------------------------------------------------------------
    verify_dim: int = 64
    """While fewer than B columns are found, trust (build the next rounds and the completion on)
    only columns whose ReLU pattern is feasible given the others (``feasibility``, one LP per
    column), once at most ``verify_dim`` columns are missing; 0 turns it off. Skipped on noisy
    updates. Without it a mixture of two similar samples can be trusted and stall the search."""
    greedy: bool = True
    """Stage 2: swap columns for spare candidates while the sparsity-matching λ increases."""
    max_swaps: int = 200
    swap_positions: int = 6
    """Positions tried per spare candidate in stage 2 (those with the largest coefficients)."""
    lambda_stop: float | None = None
    """Stop searching once λ reaches this value. None: 1.0 (clean) or chosen from the noise."""

    # --- noise (DP-SGD: SPEAR App. E.6, SPEAR++ §5.2) ---------------------------------------------
    noise: str | float = "auto"
    """``"auto"``: estimate the noise from the spectrum; ``0``: treat as clean; a float: the
    known std of the noise on each gradient entry."""

    # --- execution ------------------------------------------------------------------------------
    search_dtype: str = "float32"
    """Precision of the optimisation (final solves are always float64)."""
    progress: bool = False
    """Log the progress of the rounds at INFO on ``logging.getLogger("fl_attack")`` (else at
    DEBUG); configure logging to see it, e.g. ``logging.basicConfig(level=logging.INFO)``."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def wide_layer_search(self, m: int) -> tuple[bool, bool]:
        """(``alternate``, ``irls``) for a layer with ``m`` outputs, their defaults resolved.

        Both defaults switch at :data:`WIDE_LAYER` outputs (see the two options).
        """
        wide = m >= WIDE_LAYER
        alternate = self.alternate if self.alternate is not None else not wide
        irls = self.irls if self.irls is not None else wide
        return alternate, irls

    def first_slice(self, m: int, *, noisy: bool) -> bool:
        """``slice_first`` for a layer with ``m`` outputs, its default resolved (see the option)."""
        if self.slice_first is not None:
            return self.slice_first
        return m >= WIDE_LAYER and not noisy and self.update == "gradient"

    def round_cap(self, batch_size: int) -> int:
        """``max_rounds``, or its default for a batch of ``batch_size``."""
        return self.max_rounds or max(12, batch_size // 4)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid option."""
        _choice("method", self.method, METHODS)
        _choice("sparse", self.sparse, SPARSE_SIDES)
        _choice("update", self.update, UPDATES)
        if self.weights_dtype is not None:
            _choice("weights_dtype", self.weights_dtype, WEIGHT_DTYPES)
        _choice("loss", self.loss, LOSSES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("search_dtype", self.search_dtype, ("float32", "float64"))
        if self.batch_size is not None and (not isinstance(self.batch_size, int)
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {self.batch_size!r}")
        if self.max_rounds is not None and (not isinstance(self.max_rounds, int)
                                            or self.max_rounds < 1):
            raise ValueError(f"max_rounds must be a positive int or None, got {self.max_rounds!r}")
        for name in ("steps", "samples_per_step", "max_samples", "max_swaps", "slice_samples",
                     "verify_dim", "swap_positions", "max_face_dim"):
            value = getattr(self, name)
            zero_ok = name in ("max_swaps", "slice_samples", "verify_dim")  # 0: off
            if not isinstance(value, int) or value < 0 or (not zero_ok and value == 0):
                kind = "non-negative" if zero_ok else "positive"
                raise ValueError(f"{name} must be a {kind} int, got {value!r}")
        if self.max_faces is not None and (not isinstance(self.max_faces, int)
                                           or self.max_faces < 1):
            raise ValueError(f"max_faces must be a positive int or None, got {self.max_faces!r}")
        if self.n_init is not None and (not isinstance(self.n_init, int) or self.n_init < 1):
            raise ValueError(f"n_init must be a positive int or None, got {self.n_init!r}")
        for name in ("lr", "max_seconds", "zero_rtol", "tau", "lambda_stop"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        if self.tau is not None and not 0 < self.tau < 1:
            raise ValueError(f"tau must lie in (0, 1), got {self.tau}")
        if self.lambda_stop is not None and self.lambda_stop > 1:
            raise ValueError(f"lambda_stop must be <= 1, got {self.lambda_stop}")
        if not 0 < self.p_false_reject < 1:
            raise ValueError(f"p_false_reject must lie in (0, 1), got {self.p_false_reject}")
        if not 0 < self.lr_gamma <= 1:
            raise ValueError(f"lr_gamma must lie in (0, 1], got {self.lr_gamma}")
        if any(not 0 < f < 1 for f in self.lr_milestones):
            raise ValueError(f"lr_milestones are fractions in (0, 1), got {self.lr_milestones}")
        if self.rank_margin <= 1:
            raise ValueError(f"rank_margin must be > 1, got {self.rank_margin}")
        if self.logcosh_alpha <= 0:
            raise ValueError(f"logcosh_alpha must be > 0, got {self.logcosh_alpha}")
        if not 0 < self.dedupe_tol < 1:
            raise ValueError(f"dedupe_tol must lie in (0, 1), got {self.dedupe_tol}")
        for name in ("alternate", "irls", "slice_first"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        if isinstance(self.noise, str):
            if self.noise != "auto":
                raise ValueError(f"noise must be 'auto' or a number >= 0, got {self.noise!r}")
        elif not (isinstance(self.noise, (int, float)) and self.noise >= 0):
            raise ValueError(f"noise must be 'auto' or a number >= 0, got {self.noise!r}")

    @classmethod
    def from_options(cls, base: AttackConfig | None = None, **options: Any) -> AttackConfig:
        """Build a config from keyword options, rejecting unknown names with the valid ones."""
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown attack option(s) {unknown}; valid options: {sorted(known)}"
            )
        values = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        values.update(options)
        return cls(**values)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose one of {list(allowed)}")
