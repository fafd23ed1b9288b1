"""Step 1 (SPEAR §3.1, SPEAR++ §4.1): low-rank factorisation G = L R and batch-size detection.

The batch size is the numerical rank of G. Clean float32 gradients carry rounding noise and DP-SGD
gradients carry Gaussian noise; both are full-rank "bulks" whose edge is estimated from the tail
energy (Marchenko-Pastur), so a single noise-aware rule reads B off either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl_attack.core.tuning import TUNING
from fl_attack.errors import NotIdentifiable


@dataclass
class Decomposition:
    """G ≈ L R with L (m, B) orthonormal columns (SPEAR++ preconditioning) and R = S_B V_Bᵀ."""

    L: torch.Tensor
    R: torch.Tensor
    singular_values: torch.Tensor
    batch_size: int
    noise_std: float
    """Estimated std of the noise on each gradient entry (rounding noise for clean gradients)."""
    noise_edge: float
    """Estimated largest singular value of the noise alone, ν(√m + √n)."""
    edge_batch_size: int = 0
    """Under noise, the singular values above :data:`EDGE_MARGIN` x the noise edge: the largest
    batch size the spectrum allows (``batch_size`` counts those above ``rank_margin`` x the
    edge, the values clear of the noise). Equal to ``batch_size`` on a clean spectrum or an
    explicit ``batch_size``; 0 for a decomposition built by hand."""
    edge_L: torch.Tensor | None = None
    """(m, edge_batch_size) the left factor at the edge reading, when it is larger."""
    edge_R: torch.Tensor | None = None
    """(edge_batch_size, n) the right factor at the edge reading, when it is larger."""
    spectrum_batch_size: int = 0
    """With an explicit ``batch_size``: the batch size the spectrum itself reads when it is
    smaller (samples closer to each other than the noise or the rounding can separate, or one
    sample given twice), else 0."""
    rounding_floor: float = 0.0
    """The values up to which the spectrum is the stored weights' known rounding
    (:data:`ROUNDING_MARGIN` x ``noise_floor`` of :func:`decompose`); 0 when none is known."""

    def readings(self) -> tuple[int, ...]:
        """The plausible batch sizes, ascending: (batch_size,), (batch_size, edge_batch_size),
        or, with an explicit batch size the noisy spectrum reads fewer of,
        (spectrum_batch_size, batch_size)."""
        if 0 < self.spectrum_batch_size < self.batch_size:
            return (self.spectrum_batch_size, self.batch_size)
        if self.edge_batch_size > self.batch_size and self.edge_L is not None:
            return (self.batch_size, self.edge_batch_size)
        return (self.batch_size,)

    def at(self, batch_size: int) -> Decomposition:
        """This decomposition read at one of :meth:`readings` (the factors' first columns)."""
        if batch_size == self.batch_size:
            return self
        if batch_size not in self.readings():
            raise ValueError(f"batch_size {batch_size} is not a reading of this spectrum "
                             f"{self.readings()}")
        L, R = (self.L, self.R) if batch_size < self.batch_size else (self.edge_L, self.edge_R)
        assert L is not None and R is not None
        return Decomposition(L=L[:, :batch_size].contiguous(), R=R[:batch_size].contiguous(),
                             singular_values=self.singular_values, batch_size=batch_size,
                             noise_std=self.noise_std, noise_edge=self.noise_edge,
                             edge_batch_size=max(self.edge_batch_size, batch_size),
                             rounding_floor=self.rounding_floor)


EDGE_MARGIN = 1.1
"""Under noise, a singular value above this many noise edges ν(√m + √n) may still be a sample
rather than noise: the largest noise singular value scatters around the edge by about 1% at
the layers' shapes (Tracy-Widom), and the estimate ν̂ is within a few percent of ν. Between
this and ``rank_margin`` edges a direction is plausible but noisy; the attack tries both
readings (``output_side.invert_output``)."""


ROUNDING_MARGIN = 3.0
"""Singular values up to this many estimates of the stored weights' rounding
(``tolerances.rounding_edge``) are rounding, never samples. The estimate measured 0.3-1.25 of
the rounding's spectral norm, and storing is not independent of the update: entries the
storage swallows whole are the update's own, so the rounding has a component along the
update that stands out of its bulk (a FedAvg weight difference of an MNIST MLP after 300
steps: one value 2.1 estimates up, its bulk at 1.3, the weakest sample at 26 or more,
``experiments/results/training.md``). A sample within three estimates of the rounding is held
to a third of its size at best."""


CLIFF_BULK = 100.0
"""A drop of three orders of magnitude ends the signal only when the values below it look like
a rounding bulk: the largest within this factor of their median (a noise bulk spans
ν(√m ± √n), a few times). A trained model's per-sample contributions spread over 10⁴-10⁶, so
its spectrum can drop 10³ after its dominant sample and go on falling, sample by sample, down
to the rounding (the quickstart CNN's fc1 after 3000 steps: 1, 5·10⁻⁴, 10⁻⁵, 4·10⁻⁶, ...)."""


def _bulk_below(s: torch.Tensor, r: int) -> bool:
    """Whether the singular values from index ``r`` on look like a rounding bulk
    (:data:`CLIFF_BULK`)."""
    tail = s[r:]
    return float(tail[0]) <= CLIFF_BULK * float(tail.median())


def estimate_rank(
    s: torch.Tensor, m: int, n: int, *, margin: float = 2.0, floor_rtol: float = 1e-13,
    max_rank: int | None = None,
) -> tuple[int, float, float]:
    """Numerical rank of an m x n matrix from all its singular values ``s`` (descending).

    Pass the matrix without its exactly zero rows and columns (``m``, ``n`` and ``s`` of the
    live part, as :func:`decompose` does): their singular values are exact zeros, and the drop
    to them would be read as the end of the signal.

    A clean spectrum (a first drop of 1000x or more, down to a rounding bulk, or no flat noise
    bulk at the bottom) gives the count above that drop / the rounding floor. Otherwise the
    noise is estimated by iterating ν² = tail energy / ((m-k)(n-k)); k = #{σ > margin · ν(√m+√n)}.
    A spectrum with ``max_rank`` (the live rows/columns: full rank) or more values above the
    floor and no drop always takes the noise route: a noise bulk of a near-square matrix is not
    flat (its values span ν(√m ± √n)), so the flatness test alone would call the float32
    rounding of a large FedAvg/DP-SGD weight difference clean and full rank. Returns
    (rank, ν, noise edge); for such a spectrum, the full rank again when the noise route finds
    no signal above its edge or a tail that is not a noise bulk.
    """
    s = s.double()
    energy = s.square()
    total = float(energy.sum())
    floor = float(s[0]) * floor_rtol
    ratio = s[:-1] / s[1:].clamp_min(float(s[0]) * 1e-300)
    cliff = torch.nonzero((ratio > 1e3) & (s[:-1] > floor)).squeeze(1)
    cliff = cliff[[_bulk_below(s, int(c) + 1) for c in cliff.tolist()]]
    forced = False
    if cliff.numel():  # the first drop of three orders of magnitude to a bulk ends the signal
        r = int(cliff[0]) + 1
        clean = True
    else:
        r = int((s > floor).sum())
        bottom = s[r // 2:r] if r >= 4 else s[:r]
        full = r >= (s.numel() if max_rank is None else min(max_rank, s.numel()))
        clean = r < s.numel() or float(bottom.min()) < 0.5 * float(bottom.max())
        forced = clean and full  # took the noise route only because the rank is full
        clean = clean and not full
    if clean:
        dof = max((m - r) * (n - r), 1)
        nu = math.sqrt(float(energy[r:].sum()) / dof)
        return r, nu, nu * (math.sqrt(m) + math.sqrt(n))
    k = 0
    nu = edge = 0.0
    for _ in range(50):
        tail = max(total - float(energy[:k].sum()), 0.0)
        dof = max((m - k) * (n - k), 1)
        nu = math.sqrt(tail / dof)
        edge = nu * (math.sqrt(m) + math.sqrt(n))
        new_k = int((s > max(margin * edge, floor)).sum())
        if new_k == k:
            break
        k = new_k
    if forced:
        above = int((s > floor).sum())
        if k == 0:  # nothing stands out of the bulk: report the rank seen above the floor
            return above, nu, edge
        # a full-rank spectrum is noise only if its tail fills the Marchenko-Pastur bulk: its
        # smallest values reach down to ν|√(m-k) - √(n-k)| (a genuine rank-min(m, n) signal,
        # B ≥ min(m, n), has a tail that falls below; then it is reported full rank)
        low = nu * abs(math.sqrt(m - k) - math.sqrt(n - k))
        if float(s[-1]) < 0.5 * low:
            return above, nu, edge
    return k, nu, edge


def decompose(
    weight_grad: torch.Tensor,
    *,
    batch_size: int | None = None,
    rank_margin: float = 2.0,
    floor_rtol: float = 1e-13,
    noise_floor: float = 0.0,
) -> Decomposition:
    """Factor the weight gradient (float64) and read off the batch size.

    ``floor_rtol`` is the relative size below which a singular value is rounding error whatever
    the noise estimate says (rounding noise is not i.i.d.: float32 gradients need ~1e-6).

    Parameters
    ----------
    weight_grad : (m, n)
        The layer's weight gradient (or weight update).
    batch_size
        The batch size, when known; None reads it off the spectrum. A clean spectrum that
        ends before it (fewer distinct samples: a repeat, samples within the rounding of each
        other) is read where it ends; a noisy one that reads fewer keeps both readings
        (:meth:`Decomposition.readings`).
    rank_margin
        Signal singular values lie above this many noise edges ν(√m + √n).
    floor_rtol
        See above (``tolerances.RANK_FLOOR``).
    noise_floor
        The estimated largest singular value a known rounding gives the update, in its units
        (the stored weights' rounding of a weight difference, ``tolerances.rounding_edge``);
        values up to :data:`ROUNDING_MARGIN` (or ``rank_margin``, if larger) times it are
        never samples. 0: none known.

    Returns
    -------
    Decomposition
        L (m, B) with orthonormal columns, R (B, n), all singular values, B, the noise estimate.

    Raises
    ------
    ValueError
        When the rank is 0 or not smaller than min(m, n) (then the batch is not identifiable
        from this layer) or when an explicit ``batch_size`` exceeds min(m, n) - 1.
    """
    m, n = weight_grad.shape
    G = weight_grad.double()
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    rounding = max(rank_margin, ROUNDING_MARGIN) * noise_floor
    if noise_floor > 0 and float(S[0]) > 0:
        floor_rtol = max(floor_rtol, rounding / float(S[0]))
    # rows of neurons that no sample activates are exactly zero and carry no rank
    live_rows = int((G.abs().amax(dim=1) > 0).sum())
    live_cols = int((G.abs().amax(dim=0) > 0).sum())
    limit = min(live_rows, live_cols)
    # their singular values are exact zeros: left in, the drop to them read as the end of the
    # signal (a FedAvg update at η = 0.001 with one dead neuron: rank 199 of 200 instead of 20)
    rank, nu, edge = estimate_rank(S[:limit], live_rows, live_cols, margin=rank_margin,
                                   floor_rtol=floor_rtol, max_rank=limit)
    if batch_size is None:
        _check_identifiable(rank, limit, noise_floor, rank_margin)
        B = rank
    else:
        if batch_size >= limit:
            raise ValueError(
                f"batch_size={batch_size} is not smaller than min(m, n) = {limit}: not identifiable"
            )
        B = batch_size
    read = rank if batch_size is not None and 0 < rank < batch_size else 0
    # a clean spectrum ends at `read`, or one that ends at the precision floor (a trained
    # model's weakest samples at the update's rounding): the directions beyond it are rounding
    if read and (edge <= TUNING.noisy_ratio * float(S[read - 1])
                 or float(S[read]) < floor_rtol * float(S[0])):
        B = read
    L = U[:, :B].contiguous()
    R = (S[:B, None] * Vh[:B]).contiguous()
    dec = Decomposition(L=L, R=R, singular_values=S, batch_size=B, noise_std=nu,
                        noise_edge=edge, edge_batch_size=B,
                        spectrum_batch_size=read if read < B else 0, rounding_floor=rounding)
    if batch_size is None and rank_margin > EDGE_MARGIN:
        _edge_reading(dec, U, Vh, limit, rank_margin, floor_rtol)
    return dec


def _check_identifiable(rank: int, limit: int, noise_floor: float, rank_margin: float) -> None:
    """:class:`NotIdentifiable` for a rank read off the spectrum that identifies no batch."""
    if rank == 0:
        below = (f": every singular value is within {rank_margin:g} x the rounding the stored "
                 f"weights can add ({noise_floor:.3g})" if noise_floor > 0 else "")
        raise NotIdentifiable(f"weight_grad has numerical rank 0{below}: nothing to invert",
                              reason="no-signal", rank=0, limit=limit)
    if rank >= limit:
        raise NotIdentifiable(
            f"weight_grad has full numerical rank {rank} = min(m, n) = {limit} (counting only "
            f"non-zero rows/columns): the batch is not smaller than the layer (B >= min(m, n))"
            " or the noise swamps the signal, so the batch is not identifiable from this "
            "layer",
            reason="full-rank", rank=rank, limit=limit)


def _edge_reading(dec: Decomposition, U: torch.Tensor, Vh: torch.Tensor, limit: int,
                  rank_margin: float, floor_rtol: float) -> None:
    """On a noisy spectrum, add the edge reading to ``dec``: the singular values between
    :data:`EDGE_MARGIN` and ``rank_margin`` noise edges are plausible samples too."""
    S, B, edge = dec.singular_values, dec.batch_size, dec.noise_edge
    if edge <= TUNING.noisy_ratio * float(S[B - 1]):
        return
    top = int((S[:limit] > max(EDGE_MARGIN * edge, float(S[0]) * floor_rtol)).sum())
    top = min(top, limit - 1)
    if top > B and float(S[B]) <= rank_margin * edge:
        dec.edge_batch_size = top
        dec.edge_L = U[:, :top].contiguous()
        dec.edge_R = (S[:top, None] * Vh[:top]).contiguous()
