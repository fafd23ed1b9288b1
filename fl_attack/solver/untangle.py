"""Step 10b (beyond the papers): samples the layer reads only up to a mixture, read exactly
through the next layer.

When one sample's inactive units are all inactive for another too (their ReLU patterns nest),
the attacked layer's update determines the pair only up to a one-parameter family of
reconstructions with λ = 1 (``certify.Pinning``): every mixture of the two columns vanishes on
the first sample's zero rows. The next linear layer's weight gradient tells them apart: it
holds each sample's activation h = ReLU(W x + b) in its row space, and the two activations
differ on the units where the patterns do. Candidate zero sets: each column's zero rows, the
rows where all of the group's columns vanish (the inactive units the samples share: those
of the sample with the most active units), and the sparsest directions inside the group's
face (``faces.split_face``). ``peel.recover_sample`` turns each into its sample when exactly
one sample fits it, verified on its own against the next layer. A group is read when it gives
as many distinct verified samples as it has columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import zero_mask
from fl_attack.solver.state import SearchContext
from fl_attack.steps import faces, peel


@dataclass(frozen=True)
class Untangled:
    """The mixed groups read exactly through the next layer."""

    groups: tuple[tuple[int, ...], ...]
    """The groups (column indices) read."""
    inputs: torch.Tensor
    """(R, n) their samples, row i for column ``columns[i]``."""
    columns: tuple[int, ...]
    """The columns (= rows of the reconstruction) the inputs replace."""


DISTINCT_RTOL = 1e-6
"""Two verified samples closer than this (relative to the larger) are the same sample."""


def untangle(ctx: SearchContext, Q: torch.Tensor, X: torch.Tensor,
             groups: tuple[tuple[int, ...], ...], rows2: torch.Tensor,
             precision: torch.dtype, deadline: float | None = None) -> Untangled:
    """Read each group of ``groups`` (columns of ``Q`` (B, B) read only up to a mixture)
    through the next layer's activation span ``rows2`` (B, m) (:func:`peel.next_layer_rows`).

    Parameters
    ----------
    ctx
        The search's context (decomposition, the layer's products, tolerances, generator).
    Q : (B, B), X : (B, n)
        The final basis and its reconstruction (row i from column i).
    groups
        ``certify.Pinning.groups``.
    rows2, precision
        The next layer's activation span and the gradient's precision.
    deadline
        A ``time.perf_counter()`` value; groups are not tried past it.

    Returns
    -------
    Untangled
        The groups read, and the verified samples that replace their rows of ``X``.
    """
    system, L = ctx.system, ctx.L
    assert system.WR is not None and system.bias is not None
    done: list[tuple[int, ...]] = []
    rows: list[torch.Tensor] = []
    columns: list[int] = []
    for group in groups:
        if passed(deadline):
            break
        idx = list(group)
        N = torch.linalg.qr(Q[:, idx]).Q
        found, _ = faces.split_face(L, N, zero_rtol=ctx.zero_rtol, generator=ctx.generator)
        zero = zero_mask(L @ torch.cat([Q[:, idx], found], dim=1), ctx.zero_rtol)
        sets = torch.cat([zero[:, :len(idx)].all(dim=1, keepdim=True), zero], dim=1)
        coords = [c for j in range(sets.shape[1])
                  if (c := peel.recover_sample(sets[:, j], rows2, system.WR, system.bias,
                                               z_band=system.z_band,
                                               precision=precision)) is not None]
        if not coords:
            continue
        samples = _distinct(torch.stack(coords) @ ctx.dec.R)
        if samples.shape[0] != len(idx):
            continue
        order = _assign(samples, X[idx])
        done.append(group)
        rows.append(samples[order])
        columns.extend(idx)
    inputs = torch.cat(rows) if rows else X[:0]
    return Untangled(groups=tuple(done), inputs=inputs, columns=tuple(columns))


def _distinct(inputs: torch.Tensor) -> torch.Tensor:
    """The rows of ``inputs`` (F, n) without repeats (:data:`DISTINCT_RTOL`)."""
    keep: list[int] = []
    for i in range(inputs.shape[0]):
        x = inputs[i]
        if all(float((x - inputs[j]).norm()) > DISTINCT_RTOL * max(
                float(x.norm()), float(inputs[j].norm())) for j in keep):
            keep.append(i)
    return inputs[keep]


def _assign(samples: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """The order of ``samples`` (k, n) that puts each nearest the row of ``current`` (k, n)
    it replaces (an optimal assignment)."""
    from scipy.optimize import linear_sum_assignment

    _, cols = linear_sum_assignment(torch.cdist(current, samples).cpu().numpy())
    return torch.as_tensor(cols, dtype=torch.long)
