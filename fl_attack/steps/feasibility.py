"""Partial bases (beyond the papers): is a found column the ∂L/∂Z column of a real input?

With a full basis the sparsity match λ checks every column (SPEAR §4.2). With fewer than B columns
that check is not available, yet the search needs to know which columns to build on: a mixture
of two samples with almost the same ReLU pattern is nearly as sparse as either sample, and one
such column in the found set makes the later rounds search the wrong complement and makes the
completion of the missing columns (:mod:`fl_attack.steps.completion`) solve the wrong slice.

A true column j has a dual row p_j (the j-th row of Q̄⁻¹) with p_j · q_k = 0 for every other
true column and p_j · t = s_j, and the sample's pre-activations Z_j = W R^T p_j / s_j + b are
≤ 0 exactly on the zero rows of L q_j. So a = p_j / s_j lies in the affine set
{a : a · q_k = 0 (k ≠ j found), a · t = 1}, of dimension B − F, and the m sign conditions on
W R^T a + b must be feasible there. A linear program decides that: for a mixture of two similar
samples they are infeasible by a wide margin, and so is the partner of a mixture while the
mixture is in the set; true columns of a set of true columns are feasible (tested in
tests/test_steps.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import highspy
import numpy as np
import torch

from fl_attack.core.clock import passed
from fl_attack.core.columns import zero_mask
from fl_attack.steps.completion import dual_slice
from fl_attack.steps.scale import LayerSystem

FAIL_MARGIN = -1e-2
"""Columns whose best normalised sign margin is below this are infeasible. True columns sit at
≥ 0 up to the rounding of t = L⁺ g; mixtures of similar samples fall clearly below it (the
values measured on real batches are in ``experiments/results/tuning.md``)."""


def max_margin(A: np.ndarray, b: np.ndarray, *, start: int | None = None,
               grow: int | None = None, tol: float = 1e-9,
               max_rounds: int = 20) -> float | None:
    """max δ ≤ 1 over (y, δ) subject to A y + δ ≤ b, or None when the LP solver fails.

    Solved by constraint generation: the LP over the ``start`` rows tightest at y = 0, then
    again with up to ``grow`` of the rows its solution violates most, until it violates none
    (by more than ``tol``); then it is the optimum of the whole LP too, since dropping rows can
    only raise the optimum. The relaxed LPs are always feasible (δ is unbounded below) and
    bounded (δ ≤ 1). The full LP has one row per neuron (m = 4000) but only a few hundred
    rows bind near its optimum. After ``max_rounds`` rounds every row is taken.
    One HiGHS model takes the rows as they come, so each round's dual simplex starts from the
    last round's optimal basis instead of from scratch: the same optima as re-solving each
    round with ``scipy.optimize.linprog``, at a fraction of the cost
    (``experiments/results/tuning.md``).
    """
    n, d = A.shape
    start = 4 * (d + 1) if start is None else start
    grow = 2 * (d + 1) if grow is None else grow
    full = np.ascontiguousarray(np.concatenate([A, np.ones((n, 1))], axis=1), dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    lp = _new_lp(d + 1)
    active = np.zeros(n, dtype=bool)
    rows = np.argsort(b, kind="stable")[:start]
    for rnd in range(max_rounds + 1):
        if rnd == max_rounds:
            rows = np.flatnonzero(~active)
        _add_rows(lp, full, b, rows)
        active[rows] = True
        lp.run()
        if lp.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        x = np.asarray(lp.getSolution().col_value)
        excess = full @ x - b
        bad = np.flatnonzero((excess > tol) & ~active)
        if bad.size == 0 or rnd == max_rounds:
            return float(x[-1])
        rows = bad[np.argsort(-excess[bad], kind="stable")[:grow]]
    return None  # not reached: the last round takes every row


def _new_lp(cols: int) -> highspy._Highs:
    """A silent HiGHS model: minimise −x[-1] over free x with x[-1] ≤ 1, no rows yet.
    ``highspy._Highs`` is the package's exported binding; its ``Highs`` subclass adds
    callback machinery and prints a banner."""
    lp = highspy._Highs()
    lp.setOptionValue("output_flag", False)
    upper = np.full(cols, highspy.kHighsInf)
    upper[-1] = 1.0
    lp.addVars(cols, np.full(cols, -highspy.kHighsInf), upper)
    lp.changeColsCost(1, np.array([cols - 1], dtype=np.int32), np.array([-1.0]))
    return lp


def _add_rows(lp: highspy._Highs, full: np.ndarray, b: np.ndarray, rows: np.ndarray) -> None:
    """Add the dense rows ``full[rows] x ≤ b[rows]`` to ``lp``."""
    k, cols = rows.size, full.shape[1]
    values = full[rows].ravel()
    starts = np.arange(0, k * cols, cols, dtype=np.int32)
    index = np.tile(np.arange(cols, dtype=np.int32), k)
    lp.addRows(k, np.full(k, -highspy.kHighsInf), b[rows], values.size, starts, index, values)


def _margin_lp(cols: torch.Tensor, j: int, WR: torch.Tensor, bias: torch.Tensor, t: torch.Tensor,
               zero: torch.Tensor, sure: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """The LP of :func:`pattern_margins` for column ``j`` of ``cols`` as (A, b) of
    :func:`max_margin`: its pattern ``zero`` (m,) on the rows ``sure`` (m,), in the affine set
    a = N (v0 + U y) left by the other columns, rows normalised so that δ is a margin. None
    when the other columns leave no such set."""
    dual = dual_slice(torch.cat([cols[:, :j], cols[:, j + 1:]], dim=1), t)
    if dual is None:
        return None
    N, v0, U = dual
    WN = WR @ N
    A, c0 = (WN @ U)[sure], (WN @ v0 + bias)[sure]
    sign = torch.where(zero[sure], -1.0, 1.0).to(A.dtype)
    norm = torch.cat([A, c0[:, None]], dim=1).norm(dim=1).clamp_min(1e-300)
    # sign_i (A_i y + c0_i) ≥ δ norm_i  ⇔  −sign_i A_i y / norm_i + δ ≤ sign_i c0_i / norm_i
    return ((-(sign[:, None] * A) / norm[:, None]).cpu().numpy(),
            (sign * c0 / norm).cpu().numpy())


def pattern_margins(
    cols: torch.Tensor, system: LayerSystem, which: torch.Tensor | None = None,
    deadline: float | None = None,
) -> torch.Tensor:
    """Best sign margin of each column's ReLU pattern given the others (F,) float64.

    ``cols`` (B, F) are found unit columns (F < B). For each column in ``which`` (default all)
    the result is the largest δ such that some a in the column's affine set (module docstring)
    has (W R^T a + b)_i ≤ −δ‖·‖ on its zero rows and ≥ δ‖·‖ elsewhere, rows normalised; capped
    at 1 (an unbounded cell). Negative: no input has this pattern, the column is not a sample's.
    Entries of ∂L/∂Z within 100x of the zero test are left out (they may be either).
    NaN where the LP solver failed, and for the columns not reached before ``deadline`` (a
    ``time.perf_counter()`` value, checked between groups of LPs; the first group always runs).
    Needs ``weight`` and ``bias`` (``system.WR``).
    The LPs are built here in groups and solved on ``torch.get_num_threads()`` threads (the
    solver releases the GIL). Torch work stays on this thread: building the LPs in the worker
    threads as well slowed the attack's later steps down.
    """
    if system.WR is None or system.bias is None:
        raise ValueError("pattern_margins needs the layer's weight and bias")
    B, F = cols.shape
    if F >= B:
        raise ValueError(f"pattern_margins is for partial bases: got {F} columns for B = {B}")
    which = torch.arange(F) if which is None else which
    cols = cols.double()
    WR, bias, t = system.WR.double(), system.bias.double(), system.t.double()
    V = system.L @ cols
    zero = zero_mask(V, system.zero_rtol)
    sure = ~zero | zero_mask(V, system.zero_rtol * 1e-2)  # the ambiguous band left out

    out = torch.full((len(which),), float("nan"), dtype=torch.float64)
    todo = which.tolist()
    workers = max(1, torch.get_num_threads())
    step = 8 * workers  # LPs held at a time, each m x (missing + 1) floats
    with ThreadPoolExecutor(workers) as pool:
        for lo in range(0, len(todo), step):
            if lo > 0 and passed(deadline):
                break
            lps = [_margin_lp(cols, j, WR, bias, t, zero[:, j], sure[:, j])
                   for j in todo[lo:lo + step]]
            jobs = [None if lp is None else pool.submit(max_margin, *lp) for lp in lps]
            for n, job in enumerate(jobs, start=lo):
                value = None if job is None else job.result()
                if value is not None:
                    out[n] = value
    return out
