"""Which samples keep a batch from being certified, and why, without ground truth.

A batch is certified only as a whole (``docs/algorithm.md``, "The certificate"). When it is
not, an auditor still needs to tell a nearly exact read from a poor one: this module names the
rows of the reconstruction that fail one of the certificate's per-sample conditions, with the
condition, and estimates how many digits of each sample the update itself holds.

The precision estimate is first-order: the reconstruction solves X = D⁺ G for the found
∂L/∂Z columns D = L Q̄ diag(s) (SPEAR §3.4), so a perturbation E of the update (its noise or
float32 rounding, spectral norm at most the noise edge ν̂ of step 1) moves row i by
e_iᵀ D⁺ E, whose norm is at most ν̂ ‖row i of Q̄⁻¹‖ / |s_i|, L having orthonormal columns.
Relative to the row itself this is the sample's own noise ratio: for B = 1 it equals the
batch's (noise edge over the one singular value), the ratio the certificate bounds by
``Tuning.noisy_ratio``.
"""

from __future__ import annotations

import torch

from fl_attack.steps.decompose import Decomposition

__all__ = ["PER_SAMPLE", "REASONS", "reasons", "sample_errors"]

#: Why a row of the reconstruction is not proven, by code (``Reconstruction.unproven``).
REASONS: dict[str, str] = {
    "no-weights": "without the layer's weight and bias there is no certificate",
    "noise": "the update carries noise (DP-SGD): no sample is proven under noise",
    "fedavg": "a FedAvg sum of several local steps: the sparsity test checks only that zero "
              "rows are inactive units, so no sample is proven",
    "not-found": "its direction was not found by the search but completed from the others",
    "incomplete": "its direction was found, but the batch has completed directions (rows "
                  "named not-found) and each row of the solve X = D⁺G depends on every column, "
                  "so nothing holds this row unless the completion was right",
    "rounding": "the update holds the sample only near its noise or float32 rounding "
                "(its relative error estimate exceeds the certificate's bound)",
    "mixture": "its ReLU pattern nests with other samples': the layer fixes it only up to a "
               "mixture with them",
    "unpinned": "its zero rows do not single out its direction (too few, or not a "
                "one-dimensional kernel)",
    "mismatch": "its activation pattern disagrees with the ReLU law on some units",
}

#: The reasons that single a sample out; the others (no weights, noise, a FedAvg sum with
#: nothing else against the row) hold for the whole batch.
PER_SAMPLE: frozenset[str] = frozenset({"not-found", "rounding", "mismatch", "mixture",
                                        "unpinned", "incomplete"})


def sample_errors(dec: Decomposition, Q: torch.Tensor, s: torch.Tensor,
                  X: torch.Tensor) -> torch.Tensor:
    """Each reconstructed sample's relative error bound from the update's noise edge.

    Parameters
    ----------
    dec
        The decomposition searched (its ``noise_edge``: the estimated spectral norm of the
        update's noise or rounding).
    Q : (B, B)
        The final unit columns, in the coordinates of ``dec.L``.
    s : (B,)
        Their scales (``scale.reconstruct``).
    X : (B, n)
        The reconstructed inputs, row i from column i.

    Returns
    -------
    torch.Tensor
        (B,) float64 on the CPU: ν̂ ‖row i of Q⁻¹‖ / (|s_i| ‖x_i‖), infinite for a zero row
        or a singular ``Q``.
    """
    Qd = Q.double().cpu()
    try:
        inv = torch.linalg.inv(Qd)
    except RuntimeError:  # singular: nothing is held
        return torch.full((Qd.shape[0],), float("inf"), dtype=torch.float64)
    size = s.double().cpu().abs() * X.double().cpu().norm(dim=1)
    err = float(dec.noise_edge) * inv.norm(dim=1)
    out = err / size
    return torch.where(size > 0, out, torch.full_like(out, float("inf")))


def reasons(
    *,
    batch_size: int,
    errors: torch.Tensor | None,
    bound: float,
    noisy: bool,
    fedavg: bool,
    found: torch.Tensor | None,
    weights: bool = True,
    pinned: torch.Tensor | None,
    mixed: tuple[tuple[int, ...], ...],
    per_column: torch.Tensor | None,
    verified: tuple[int, ...] = (),
    weak_spectrum: bool = False,
) -> tuple[tuple[int, str], ...]:
    """The rows that keep a batch from being certified, each with its first reason.

    The conditions in order: the direction was found, the update holds the sample above its
    rounding (a weak sample's column is imprecise, so it may break the others too), its
    pattern obeys the ReLU law, it is outside every mixture group, its zero rows pin it, and
    no row of the batch (not verified) had its direction completed: a completed column is not
    known even approximately, and every row of the solve depends on it, so a partial batch
    proves no row but the verified ones and names them all.

    Parameters
    ----------
    batch_size
        B, the rows of the reconstruction.
    errors : (B,), optional
        :func:`sample_errors`; rows above ``bound`` are ``"rounding"``.
    bound
        The largest relative error a proven sample may have (``Tuning.noisy_ratio``).
    noisy, fedavg, weights
        Batch-wide: noise or no weight and bias given (``weights`` False) leave every row not
        ``verified`` unproven; a FedAvg row is named by a per-sample condition it fails, else
        ``"fedavg"``.
    found : (B,) bool, optional
        The rows whose direction the search found.
    pinned : (B,) bool, optional
        ``certify.Pinning.pinned`` of the final basis; None when it was not judged.
    mixed
        ``certify.Pinning.groups`` still read only up to a mixture.
    per_column : (B,), optional
        Each column's sparsity match (1.0: its pattern obeys the ReLU law on every unit).
    verified
        Rows read and verified on their own through the next layer: proven whatever the rest.
    weak_spectrum
        The B-th singular value is within the bound of its noise edge (``exact_possible``
        fails): unless a row is named otherwise, the row of largest error is ``"rounding"``.

    Returns
    -------
    tuple of (row, reason)
        Sorted by row; the reasons are keys of :data:`REASONS`.
    """
    done, in_group, out = set(verified), {i for group in mixed for i in group}, []
    completed = found is not None and any(
        not bool(found[i]) for i in range(batch_size) if i not in done)
    for i in range(batch_size):
        if i in done:
            continue
        conditions = (  # (fails, reason), in the order the docstring gives
            (not weights, "no-weights"), (noisy, "noise"),
            (found is not None and not bool(found[i]), "not-found"),
            (errors is not None and not float(errors[i]) <= bound, "rounding"),
            (per_column is not None and float(per_column[i]) < 1.0, "mismatch"),
            (i in in_group, "mixture"), (pinned is not None and not bool(pinned[i]), "unpinned"),
            (completed, "incomplete"), (fedavg, "fedavg"))
        why = next((reason for fails, reason in conditions if fails), None)
        if why is not None:
            out.append((i, why))
    if not out and weak_spectrum and errors is not None:
        left = [i for i in range(batch_size) if i not in done]
        if left:
            out.append((max(left, key=lambda i: float(errors[i])), "rounding"))
    return tuple(out)
