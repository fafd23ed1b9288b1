"""Unit tests of single attack steps on real batches, against the true factor ∂L/∂Z.

Each step is a pure function on tensors; here it gets the ground-truth directions of a real
photo batch (first layer of a ReLU MLP) and must recover what the attack relies on it for.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from fl_attack import config
from fl_attack.core import clock, columns, kernels
from fl_attack.core.clock import Clock
from fl_attack.core.tuning import TUNING
from fl_attack.solver import certify
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchState, search_context
from fl_attack.steps import completion, faces, feasibility, filtering, match, polish, search, select
from fl_attack.steps.decompose import Decomposition, decompose
from fl_attack.steps.scale import make_system
from fl_attack.steps.tolerances import tolerances

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def truth(real_batch):
    """``truth(B, m, seed)``: a real photo batch's first-layer gradient, its factor L and the
    true directions Qt (D = ∂L/∂Z = L Qt), as a dict of float64 tensors."""

    def build(B: int, m: int, seed: int) -> dict[str, torch.Tensor]:
        t = real_batch("photos32", B, m, seed)
        dec = decompose(t.G, floor_rtol=1e-6)
        assert dec.batch_size == B
        return {"L": dec.L, "R": dec.R, "g": t.g.double(), "W": t.W.double(),
                "b": t.b.double(), "Qt": dec.L.T @ t.D, "D": t.D, "G": t.G.double(),
                "X": t.X, "x": t.x}

    return build


def _hits(Qt: torch.Tensor, Q: torch.Tensor, tol: float = 1e-6) -> set[int]:
    """True columns that some column of Q matches up to sign and scale."""
    if Q.shape[1] == 0:
        return set()
    Qn = Qt / Qt.norm(dim=0)
    cos = (Qn.T @ (Q / Q.norm(dim=0))).abs()
    best, which = cos.max(dim=0)
    return set(which[best > 1 - tol].tolist())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_complete_missing_recovers_dropped_columns(k: int, truth) -> None:
    """With B - k true columns known, the k missing ones follow from W, b and the bias
    gradient alone (completion.complete_missing): every dropped column is among the candidates."""
    t = truth(20, 200, seed=1)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-4)
    gen = torch.Generator().manual_seed(k)
    drop = torch.randperm(20, generator=gen)[:k].tolist()
    keep = [i for i in range(20) if i not in drop]
    Qc = completion.complete_missing(system, t["Qt"][:, keep])
    assert set(drop) <= _hits(t["Qt"], Qc), (drop, sorted(_hits(t["Qt"], Qc)))
    assert Qc.shape[1] <= 4 * 200 * 200  # candidates, not the whole sphere


def test_complete_missing_needs_the_right_scale_slice(truth) -> None:
    """The completion is not vacuous: with a wrong bias gradient (scale constraint) the dropped
    column is not recovered."""
    t = truth(20, 200, seed=1)
    system = make_system(t["L"], t["R"], -t["g"], t["W"], t["b"], 1e-4)
    keep = list(range(1, 20))
    Qc = completion.complete_missing(system, t["Qt"][:, keep])
    assert 0 not in _hits(t["Qt"], Qc)


def test_sample_missing_recovers_many_dropped_columns(truth) -> None:
    """Eight of thirty columns dropped (too many for the exact completion): points sampled on
    the missing samples' slice give back at least half of them exactly (measured 5-7 of 8 over
    generator seeds). Not every kernel returned is a column: some row sets vanish on mixtures
    of samples (measured: 11 of 59 kernels true, spurious ones with up to 101 zeros), which
    the attack's polishing, leverage test and λ selection sort out."""
    t = truth(30, 200, seed=1)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-4)
    gen = torch.Generator().manual_seed(0)
    drop = torch.randperm(30, generator=gen)[:8].tolist()
    keep = [i for i in range(30) if i not in drop]
    Qc = completion.sample_missing(system, t["Qt"][:, keep], generator=gen,
                                   n_samples=1024)
    hits = _hits(t["Qt"], Qc)
    assert len(set(drop) & hits) >= 4, (drop, sorted(hits))


@pytest.mark.parametrize(("B", "m", "chunk"), [(30, 200, 2**25), (100, 1000, 2**22)])
def test_nested_row_set_kernels_equal_the_separate_row_sets(B: int, m: int, chunk: int,
                                                            truth) -> None:
    """Slice sampling's three nested row sets per point, screened with Grams accumulated along
    the nesting (``nested_row_set_kernels``), give exactly the kernels of screening each
    rule's row sets on their own (``pattern_kernels`` on the deduplicated masks), also when
    the points are split into several chunks."""
    t = truth(B, m, seed=1)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-4)
    gen = torch.Generator().manual_seed(0)
    keep = torch.randperm(B, generator=gen)[: B - B // 3]
    offset, Aw, dist = completion.missing_slice(system, t["Qt"][:, keep])
    w = torch.randn(512, Aw.shape[1], generator=gen, dtype=torch.float64) * dist
    h = offset[:, None] + Aw @ w.T
    idx, lengths = completion.slice_row_sets(h, B, (0.6, 0.75))
    assert bool((lengths[1:] >= lengths[:-1]).all()) and bool((lengths[0] <= B).all())
    with pytest.raises(ValueError, match="non-decreasing"):  # the sets would not be nested
        completion.slice_row_sets(h, B, (0.75, 0.6))
    new = completion.nested_row_set_kernels(t["L"], idx, lengths, 1e-4, chunk_elems=chunk)
    ranks = torch.arange(idx.shape[0])[:, None]
    old = []
    for r in range(lengths.shape[0]):
        use = lengths[r] >= B - 1
        rows = torch.where(ranks < lengths[r, use][None], idx[:, use], m)
        mask = torch.zeros(m + 1, int(use.sum()), dtype=torch.bool).scatter_(0, rows, True)[:m]
        old.append(kernels.pattern_kernels(t["L"], torch.unique(mask, dim=1), 1e-4))
    old = torch.cat(old, dim=1)
    assert new.shape[1] == old.shape[1] > 0
    cos = (old.T @ new).abs()
    assert float(cos.max(dim=1).values.min()) > 1 - 1e-9
    assert float(cos.max(dim=0).values.min()) > 1 - 1e-9
    assert len(_hits(t["Qt"], new)) > 0  # the sets do reach true columns
    # with the kept columns known, only their re-discoveries go; every other kernel stays
    known = t["Qt"][:, keep]
    skipped = completion.nested_row_set_kernels(t["L"], idx, lengths, 1e-4, chunk_elems=chunk,
                                                known=known)
    unit = known / known.norm(dim=0)
    refound = (old.T @ unit).abs().max(dim=1).values > 1 - 1e-6
    assert int(refound.sum()) > 0  # without ``known`` the sets do give known columns back
    assert skipped.shape[1] == int((~refound).sum())
    cos = (old[:, ~refound].T @ skipped).abs()
    assert float(cos.max(dim=1).values.min()) > 1 - 1e-9
    assert float(cos.max(dim=0).values.min()) > 1 - 1e-9


def test_known_free_flags_the_sets_a_known_column_vanishes_on(truth) -> None:
    """A row set inside a known column's zero rows has that column in its kernel, so
    ``known_free`` marks it (clean and under noise); one row where the column is clearly active
    frees the set."""
    t = truth(30, 200, seed=1)
    L, q = t["L"], t["Qt"][:, :1]
    v = (L @ q)[:, 0].abs()
    zeros = v <= 1e-6 * v.max()  # its inactive rows (float32 gradient: ~1e-7)
    inside = zeros.nonzero()[:, 0]
    assert inside.numel() >= 29
    sets = torch.zeros(200, 3, dtype=torch.bool)
    sets[inside[:29], 0] = True  # B - 1 of its zero rows
    sets[inside[:29], 1] = True
    sets[int(v.argmax()), 1] = True  # and the row where it is most active
    sets[inside, 2] = True  # all its zero rows
    others = t["Qt"][:, 1:3]  # two columns that vanish on none of these sets
    assert kernels.known_free(L, sets, others, 1e-4).tolist() == [True, True, True]
    known = torch.cat([others, q], dim=1)
    assert kernels.known_free(L, sets, known, 1e-4).tolist() == [False, True, False]
    noise = torch.full((30,), 1e-3, dtype=L.dtype)
    assert kernels.known_free(L, sets, known, 1e-4, noise).tolist() == [False, True, False]
    assert kernels.known_free(L, sets, known[:, :0], 1e-4).tolist() == [True, True, True]
    chunked = kernels.known_free(L, sets, known, 1e-4, chunk_elems=200)  # one set at a time
    assert chunked.tolist() == [False, True, False]


def _similar_pair(t: dict[str, torch.Tensor], B: int) -> tuple[torch.Tensor, int, int,
                                                               torch.Tensor]:
    """Unit true columns, the two samples with the most shared zero rows (i, j) and their
    normalised mixture: the column a search on similar samples stalls at."""
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    zero = columns.zero_mask(t["L"] @ Qt, 1e-4).double()
    shared = zero.T @ zero
    shared.fill_diagonal_(0)
    i, j = divmod(int(shared.argmax()), B)
    mix = (Qt[:, i] + Qt[:, j]) / (Qt[:, i] + Qt[:, j]).norm()
    return Qt, i, j, mix


@pytest.mark.parametrize("seed", [0, 2])
def test_pattern_margins_reject_a_mixture_of_similar_samples(seed: int, truth) -> None:
    """A partial set of true columns passes the LP feasibility test; adding the mixture of the
    two samples with the most shared zero rows (one found, one missing) makes the mixture and
    its found partner infeasible and leaves every other column feasible. (Measured margins:
    true ≥ 0.03, mixture -0.75 / -0.90, partner -0.99 / -1.0.)"""
    t = truth(30, 200, seed=seed)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-4)
    Qt, i, j, mix = _similar_pair(t, 30)
    keep = [c for c in range(30) if c not in (j, 3, 7, 11, 19, 23, 27) or c == i][:22]
    found = Qt[:, keep]
    assert bool((feasibility.pattern_margins(found, system) >= feasibility.FAIL_MARGIN).all())
    margins = feasibility.pattern_margins(torch.cat([found, mix[:, None]], dim=1), system)
    bad = set(torch.nonzero(margins < feasibility.FAIL_MARGIN).squeeze(1).tolist())
    assert bad == {len(keep), keep.index(i)}, (sorted(bad), margins)


def test_constraint_generation_gives_the_full_lp_margin(monkeypatch: pytest.MonkeyPatch,
                                                       truth) -> None:
    """The margins found by constraint generation (``feasibility.max_margin``: one warm-started
    HiGHS model, a few hundred of the m rows) equal those of the LP over every row solved from
    scratch by ``scipy.optimize.linprog``, for true columns (margin ≥ 0), the mixture of two
    similar samples and its partner (margins < 0); also when the round cap adds every row."""
    t = truth(30, 200, seed=0)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-4)
    Qt, i, j, mix = _similar_pair(t, 30)
    keep = [c for c in range(30) if c != j][:20]
    cols = torch.cat([Qt[:, keep], mix[:, None]], dim=1)
    got = feasibility.pattern_margins(cols, system)
    one_lp = feasibility.max_margin

    def full_lp(A: np.ndarray, b: np.ndarray) -> float | None:
        n, d = A.shape
        res = linprog(np.r_[np.zeros(d), -1.0], A_ub=np.c_[A, np.ones(n)], b_ub=b,
                      bounds=[(None, None)] * d + [(None, 1.0)], method="highs")
        return float(res.x[-1]) if res.status == 0 else None

    monkeypatch.setattr(feasibility, "max_margin", full_lp)
    full = feasibility.pattern_margins(cols, system)
    monkeypatch.setattr(feasibility, "max_margin",  # a few rows, then every row at round 2
                        lambda A, b: one_lp(A, b, start=5, grow=5, max_rounds=2))
    capped = feasibility.pattern_margins(cols, system)
    assert not bool(got.isnan().any() or full.isnan().any() or capped.isnan().any())
    assert float((got - full).abs().max()) < 1e-7, (got, full)
    assert float((capped - full).abs().max()) < 1e-7, (capped, full)
    assert float(full.min()) < feasibility.FAIL_MARGIN < float(full.max())  # both kinds present


def test_irls_round_snaps_perturbed_columns_to_exact_ones(truth) -> None:
    """Directions a few degrees off the true columns (what ℓ1 returns when a similar sample
    pulls it off) are driven to the exact columns by reweighted least squares, and the
    result has the column's full zero set."""
    t = truth(20, 200, seed=0)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(Qt.shape, generator=gen, dtype=Qt.dtype)
    noise -= Qt * (Qt * noise).sum(dim=0)  # orthogonal perturbation: cos = 1/sqrt(1 + 0.05²)
    Qn = Qt + 0.05 * noise / noise.norm(dim=0)
    assert not _hits(t["Qt"], Qn)
    Q = polish.irls_round(t["L"], Qn)
    hits = _hits(t["Qt"], Q, tol=1e-9)
    assert len(hits) >= 18, sorted(hits)
    true_zeros = (t["D"] == 0).sum(dim=0)
    zeros = columns.zero_mask(t["L"] @ Q, 1e-4).sum(dim=0)
    for i in hits:
        assert int(zeros[i]) >= int(true_zeros[i])


def test_starts_in_the_complement_reach_the_missing_columns(truth) -> None:
    """Starts orthogonal to the known columns (search.random_complement) reach the missing
    columns far more often than uniform starts, on the unchanged ℓ1 landscape."""
    t = truth(20, 200, seed=2)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    missing = [3, 11, 17]
    known = [i for i in range(20) if i not in missing]
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    init = search.random_complement(t["Qt"][:, known], 200, generator=gen,
                                    dtype=torch.float32, device=cpu)
    assert float((init.double() @ Qt[:, known]).abs().max()) < 1e-5
    counts = []
    for start in (init, search.random_sphere(200, 20, generator=gen, dtype=torch.float32,
                                             device=cpu)):
        Q = search.optimise_on_sphere(t["L"].float(), start, steps=300).double()
        best, which = (Qt.T @ (Q / Q.norm(dim=0))).abs().max(dim=0)
        counts.append(int(((best > 0.999) & torch.isin(which, torch.tensor(missing))).sum()))
    assert counts[0] >= 3 * max(counts[1], 1), counts


@pytest.mark.parametrize("optimizer", ["pgd", "radam"])
def test_a_passed_deadline_stops_the_search_after_one_check(optimizer: str, truth) -> None:
    """``max_seconds`` reaches inside the long steps: with its deadline already passed,
    the optimiser stops at its first look at the clock (the same iterates as a run of that
    many steps) and IRLS returns only the first chunk of directions, each as a full run
    would have refined it."""
    t = truth(20, 200, seed=1)
    L = t["L"]
    gen = torch.Generator().manual_seed(0)
    init = search.random_sphere(64, 20, generator=gen, dtype=torch.float64,
                                device=torch.device("cpu"))
    kw = {"optimizer": optimizer, "milestones": ()}
    cut = search.optimise_on_sphere(L, init, steps=300, deadline=0.0, **kw)
    short = search.optimise_on_sphere(L, init, steps=search.CHECK_EVERY, **kw)
    full = search.optimise_on_sphere(L, init, steps=300, **kw)
    assert torch.allclose(cut, short, atol=1e-12)
    assert not torch.allclose(cut, full, atol=1e-3)
    per = 4  # chunk_elems = per x m x B: four directions per chunk
    chunk = per * L.shape[0] * L.shape[1]
    first = polish.irls_round(L, full, chunk_elems=chunk, deadline=0.0)
    everything = polish.irls_round(L, full, chunk_elems=chunk)
    assert first.shape == (20, per) and everything.shape == (20, 64)
    assert torch.allclose(first, everything[:, :per], atol=1e-12)


def test_conditional_directions_stay_within_their_memory_blocks(
        monkeypatch: pytest.MonkeyPatch, truth) -> None:
    """A large pool is solved in blocks of at most ``chunk_elems`` (found columns x zero rows x
    B; one block of a noisy (150,4000) pool asked for 7.9 GB) taken in the pool's order, every
    column gets its seeds, and a passed deadline stops after the first block."""
    t = truth(20, 200, seed=0)
    L, found = t["L"], t["Qt"] / t["Qt"].norm(dim=0)
    zeros = columns.zero_mask(L @ found, 1e-4).sum(dim=0)
    blocks: list[tuple[int, int]] = []
    block = faces._conditional_block

    def spy(Lz: torch.Tensor, cols: torch.Tensor, **kw) -> torch.Tensor:
        blocks.append((cols.shape[1], Lz.numel()))
        # the block's columns, in order, with their zero rows and no more padding than needed
        first = sum(n for n, _ in blocks[:-1])
        assert torch.equal(cols, found[:, first:first + cols.shape[1]])
        assert Lz.shape[1] == int(zeros[first:first + cols.shape[1]].max())
        return block(Lz, cols, **kw)

    monkeypatch.setattr(faces, "_conditional_block", spy)
    kw = {"zero_rtol": 1e-4, "n_init": 4, "steps": 20}
    one = faces.conditional_directions(L, found, generator=torch.Generator().manual_seed(0),
                                        **kw)
    assert [n for n, _ in blocks] == [20] and one.shape == (20, 80)
    blocks.clear()
    chunk = 3 * int(zeros.max()) * 20
    out = faces.conditional_directions(L, found, generator=torch.Generator().manual_seed(0),
                                        chunk_elems=chunk, **kw)
    assert len(blocks) >= 7 and all(elems <= chunk for _, elems in blocks)
    assert sum(n for n, _ in blocks) == 20 and out.shape == (20, 80)
    assert torch.allclose(out.norm(dim=0), torch.ones(80, dtype=out.dtype))
    n_first = blocks[0][0]
    blocks.clear()
    cut = faces.conditional_directions(L, found, generator=torch.Generator().manual_seed(0),
                                        chunk_elems=chunk, deadline=0.0, **kw)
    assert len(blocks) == 1 and cut.shape == (20, 4 * n_first)


def test_a_deadline_passes_only_once_the_clock_is_beyond_it() -> None:
    now = time.perf_counter()
    assert not clock.passed(None)
    assert clock.passed(now - 1.0)
    assert not clock.passed(now + 3600.0)


def test_greedy_swaps_fix_a_basis_and_stop_at_a_passed_deadline(truth) -> None:
    """Stage 2 swaps two wrong columns for the true ones held as spares (λ → 1); with its
    deadline already passed it makes no swap and returns the basis it was given."""
    t = truth(20, 200, seed=2)
    system = make_system(t["L"], t["R"], t["g"], t["W"], t["b"], 1e-6)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    gen = torch.Generator().manual_seed(0)
    wrong = Qt[:, :2] + 0.5 * Qt[:, 2:4] @ torch.randn(2, 2, generator=gen, dtype=torch.float64)
    Q = torch.cat([wrong, Qt[:, 2:]], dim=1)
    junk = torch.randn(20, 6, generator=gen, dtype=torch.float64)
    spare = torch.cat([junk, Qt[:, :2]], dim=1)
    before = match.sparsity_match(Q, system)
    assert before is not None and before.value < 1.0
    fixed, got, swaps = select.swap_greedily(Q, spare, select.OutputSwaps(system, Q, spare))
    assert got is not None and got.value == 1.0 and swaps == 2
    assert _hits(Qt, fixed) == set(range(20))
    kept, late, none = select.swap_greedily(Q, spare, select.OutputSwaps(system, Q, spare),
                                            deadline=0.0)
    assert none == 0 and torch.equal(kept, Q)
    assert late is not None and late.value == before.value


def test_chance_zeros_count_as_matches_only_without_law_violations(truth) -> None:
    """A real photo batch (20, 200) whose ∂L/∂Z has exactly one chance zero, planted: an active
    unit's entry set to 1e-7 of its column's largest (below the float32 zero test, as measured
    on real batches: 4e-7 at (30, 200) batch 16), with every other active entry kept clear of
    the zero test, and the gradient rebuilt from it (G = ∂L/∂Z X). The paper's λ₊ term would
    keep the *true* basis below 1; λ counts that chance zero as a match (the ReLU law holds
    there) and reports it. A basis with a column mixing two samples breaks the law and keeps
    every mismatch."""
    t = truth(20, 200, seed=0)
    X = t["X"]
    Z = (X @ t["W"].T + t["b"]).T  # (m, B)
    D = t["D"].clone()
    top = D.abs().amax(dim=0, keepdim=True)
    small = (D != 0) & (D.abs() < 1e-3 * top)
    D[small] = torch.copysign(1e-3 * top.expand_as(D)[small], D[small])  # no accidental ones
    i, a = divmod(int(torch.argmax(torch.where(D != 0, Z, float("-inf")))), Z.shape[1])
    D[i, a] = 1e-7 * top[0, a]  # surely active (its largest pre-activation), gradient ~ 0
    dec = decompose(D @ X, floor_rtol=1e-13)
    system = make_system(dec.L, dec.R, D.sum(dim=1), t["W"], t["b"], 1e-4, z_band=1e-5)
    Qt = columns.normalize_columns(dec.L.T @ D)
    truth = match.sparsity_match(Qt, system)
    assert truth is not None and truth.value == 1.0 and truth.chance_zeros == 1
    share = (D == 0).double()
    share = share.T @ share
    share.fill_diagonal_(-1)
    for c in range(3):  # column c mixed with the sample sharing most of its zero rows
        Q = Qt.clone()
        Q[:, c] = Qt[:, c] + 0.1 * Qt[:, int(share[c].argmax())]
        wrong = match.sparsity_match(Q, system)
        assert wrong is not None and wrong.value < 0.999 and wrong.chance_zeros == 0


def test_repair_restores_a_true_column_above_the_leverage_cut(truth) -> None:
    """The final repair (``certify.repair``) replaces the mismatching columns of a full basis by
    the exact completion's candidates without the leverage cut of the search: a true column
    can have a zero row of leverage above ``max_leverage`` (a sample whose zero rows nearly all
    belong to another's: measured 0.9925 at (30, 200) batch 3). Built directly: the true
    basis of a real (30, 200) batch with its highest-leverage column mixed with another
    (which spoils both columns' patterns), ``max_leverage`` set just below that column's
    leverage. The repair must give back the true basis, λ = 1."""
    t = truth(30, 200, seed=3)
    probe = config.AttackConfig()
    dec = decompose(t["G"], floor_rtol=1e-6)
    zero_rtol, z_band = tolerances(dec, probe, torch.float32)
    system = make_system(dec.L, dec.R, t["g"], t["W"], t["b"], zero_rtol, z_band)
    Qt = columns.normalize_columns(dec.L.T @ t["D"])
    lev = polish.max_leverage(dec.L, Qt, columns.zero_mask(dec.L @ Qt, zero_rtol))
    j = int(lev.argmax())
    k = (j + 1) % 30
    cfg = config.AttackConfig(max_leverage=float(lev[j]) - 1e-4)
    Q = Qt.clone()
    Q[:, j] = columns.normalize_columns(Qt[:, j:j + 1] + 0.3 * Qt[:, k:k + 1])[:, 0]
    ctx = search_context(cfg, dec, system, torch.Generator().manual_seed(0),
                         torch.device("cpu"), Clock(None))
    state = SearchState(match=match.sparsity_match(Q, system))
    assert state.match is not None and state.match.value < 1.0
    fixed = certify.repair(ctx, state, Q)
    assert state.match.value == 1.0 and _hits(Qt, fixed) == set(range(30))


def test_chance_zero_allowance_is_a_poisson_quantile() -> None:
    from scipy.stats import poisson

    # the last: a noisy update's band (e^-mu underflows; the quantile must still be found)
    for n_band, ratio in ((0, 1 / 99), (17, 1 / 99), (98, 1 / 99), (500, 1 / 99),
                          (300_000, 1 / 99)):
        mu = (n_band + 1) * ratio
        assert match.chance_zero_allowance(n_band, ratio) == int(
            poisson.ppf(1 - match.CHANCE_TAIL, mu))


def test_gathered_grams_and_leverages_match_the_masked_formulas() -> None:
    """Polishing's Gram matrices and leverages, formed from gathered rows in chunks ordered by
    size, equal Lᵀ diag(mask) L and max over masked rows of lᵀ (G + q qᵀ)⁻¹ l, per column."""
    gen = torch.Generator().manual_seed(0)
    L = torch.linalg.qr(torch.randn(300, 12, generator=gen, dtype=torch.float64)).Q
    mask = torch.rand(300, 9, generator=gen) < torch.linspace(0.05, 0.9, 9)
    Q = torch.randn(12, 9, generator=gen, dtype=torch.float64)
    Q = Q / Q.norm(dim=0)
    seen = torch.zeros(9, dtype=torch.long)
    for cols, gram in kernels.masked_grams(L, mask, chunk_elems=12 * 300):  # several chunks
        for c, G in zip(cols.tolist(), gram, strict=True):
            seen[c] += 1
            ref = L.T @ (L * mask[:, c, None].double())
            assert torch.allclose(G, ref, atol=1e-13)
    assert seen.tolist() == [1] * 9
    lev = polish.max_leverage(L, Q, mask, chunk_elems=12 * 300)
    for c in range(9):
        Lz = L[mask[:, c]]
        M = Lz.T @ Lz + Q[:, c, None] * Q[None, :, c]
        ref = (Lz @ torch.linalg.solve(M, Lz.T)).diagonal().max()
        assert float(lev[c]) == pytest.approx(float(ref), abs=1e-10)


def test_masked_kernels_match_full_eigendecompositions(truth) -> None:
    """The Cholesky-based kernel projection used by polishing gives the eigh reference's kernel
    dimensions and directions, on true columns (1-d kernels on their zero rows), on faces
    (rows shared by two samples: 2-d kernels) and on random directions (no kernel)."""
    t = truth(20, 200, seed=2)
    L, Qt = t["L"], t["Qt"]
    gen = torch.Generator().manual_seed(0)
    zeros = t["D"].abs() <= 1e-7 * t["D"].abs().amax(dim=0)  # (m, B) true zero rows
    shared = zeros[:, :10] & zeros[:, 10:]  # rows two samples share: a 2-d face each
    rand = torch.randn(L.shape[0], 10, generator=gen, dtype=L.dtype).abs() < 0.5
    mask = torch.cat([zeros, shared, rand], dim=1)
    Q = torch.cat([Qt + 1e-3 * torch.randn(Qt.shape, generator=gen, dtype=L.dtype),
                   Qt[:, :10] + Qt[:, 10:],
                   torch.randn(20, 10, generator=gen, dtype=L.dtype)], dim=1)
    Q = Q / Q.norm(dim=0)
    eig_tol = mask.sum(dim=0).to(L.dtype) * 1e-14 / L.shape[0]
    vals, vecs = kernels.masked_gram_eigh(L, mask)
    P_ref, k_ref = kernels.project_to_kernel(Q, vals, vecs, eig_tol)
    P, k = kernels.masked_kernels(L, mask, Q, eig_tol)
    assert k.tolist() == k_ref.tolist()
    assert set(k[:20].tolist()) == {1} and int((k[20:30] >= 2).sum()) >= 8
    assert _hits(Qt, P[:, :20], tol=1e-12) == set(range(20))  # the exact true columns
    cos = (P * P_ref).sum(dim=0).abs()
    assert float(cos[:30].min()) > 1 - 1e-12


def test_noise_scales_predict_the_noise_and_true_columns_score_clearly_sparse(truth) -> None:
    """Gaussian noise on a real photo batch's gradient: ``noise_scales`` predicts the scatter of
    each true column's zero rows, and ``noisy_sparsity`` scores every true column above the
    attack's trust level and random directions of the same span far below it."""
    t = truth(20, 200, seed=0)
    G = t["L"] @ t["R"]
    gen = torch.Generator().manual_seed(0)
    nu = 0.05 * float(G.abs().median())
    dec = decompose(G + nu * torch.randn(G.shape, generator=gen, dtype=G.dtype), floor_rtol=1e-6)
    assert dec.batch_size == 20 and 0.9 < dec.noise_std / nu < 1.1
    row_noise = dec.noise_std / dec.singular_values[:20]
    Qt = dec.L.T @ t["D"]
    V = dec.L @ Qt
    zero = t["D"] == 0
    measured = torch.stack([V[zero[:, j], j].std() for j in range(20)])
    ratio = measured / filtering.noise_scales(Qt, row_noise)
    assert 0.9 < float(ratio.median()) < 1.1 and 0.7 < float(ratio.min())
    assert float(ratio.max()) < 1.4
    trust = TUNING.noisy_trust * filtering.min_zero_count(200, 1e-5)
    score = filtering.noisy_sparsity(V, filtering.noise_scales(Qt, row_noise))
    assert bool((score >= trust).all())
    Qr = torch.randn(20, 500, generator=gen, dtype=G.dtype)
    random = filtering.noisy_sparsity(dec.L @ Qr, filtering.noise_scales(Qr, row_noise))
    assert int(random.max()) < 0.5 * trust


def _noisy_truth(truth, B: int, m: int, frac: float = 0.01
                 ) -> tuple[dict[str, torch.Tensor], Decomposition, torch.Tensor, torch.Generator]:
    """``truth`` with Gaussian noise of std ``frac`` x the median |entry| on the gradient:
    (truth, noisy decomposition, row_noise = ν / s, the generator for more draws)."""
    t = truth(B, m, seed=0)
    G = t["L"] @ t["R"]
    gen = torch.Generator().manual_seed(0)
    nu = frac * float(G.abs().median())
    dec = decompose(G + nu * torch.randn(G.shape, generator=gen, dtype=G.dtype), floor_rtol=1e-6)
    return t, dec, dec.noise_std / dec.singular_values[:B], gen


def test_the_pool_refits_noisy_candidates_to_their_zero_rows(truth, output_side) -> None:
    """Under DP-SGD-like noise (f = 0.05 of the median entry, B given), a candidate 4e-4 off a
    sample's column, where the search's rounds leave them, is scored far below a true column:
    the pool takes it refit to its zero rows (``polish.noisy_refit``), so it is trusted and
    closer to its column than it came."""
    B, m = 20, 200
    t = truth(B, m, seed=0)
    gen = torch.Generator().manual_seed(1)
    nu = 0.05 * float(t["G"].abs().median())
    G = t["G"] + nu * torch.randn(t["G"].shape, generator=gen, dtype=t["G"].dtype)
    side = output_side(G, t["g"], t["W"], t["b"], batch_size=B)
    ctx = side.ctx
    assert ctx.row_noise is not None and side.B == B
    Qt = side.basis(t["D"])
    off = columns.normalize_columns(Qt + 7e-3 * torch.randn(Qt.shape, generator=gen,
                                                              dtype=Qt.dtype))
    trust = TUNING.noisy_trust * ctx.min_zeros
    offered = filtering.noisy_sparsity(ctx.L @ off, filtering.noise_scales(off, ctx.row_noise))
    assert int((offered >= trust).sum()) < B // 2  # not vacuous: most are not trusted as they are
    pool = CandidatePool(ctx)
    pool.add(off, torch.full((B,), m))
    cos = (pool.columns.T @ Qt).abs()  # (K, B)
    best, which = cos.max(dim=0)
    err_before = 1 - (off * Qt).sum(dim=0).abs()
    assert bool((1 - best < err_before / 3).all())
    assert bool((pool.scores[which] >= trust).all())


def test_noisy_pattern_kernels_are_least_squares_within_the_noise(truth) -> None:
    """Gaussian noise on a real photo batch's gradient (B = 40, m = 1000): the true zero rows
    of every sample have a kernel within the noise (``row_noise``), where the float tolerance
    of the clean test drops some of them and takes some two-sample faces for columns; random
    row sets give nothing either way."""
    B, m = 40, 1000
    t, dec, row_noise, gen = _noisy_truth(truth, B, m)
    assert dec.batch_size == B
    zero_rtol, _ = tolerances(dec, config.AttackConfig(), torch.float32)
    Qt = dec.L.T @ t["D"]
    zero = t["D"] == 0  # (m, B) each sample's true zero rows
    faces = zero[:, : B // 2] & zero[:, B // 2:]  # rows two samples share: 2-d kernels
    rand = torch.rand(m, 100, generator=gen) < 0.5
    clean = kernels.pattern_kernels(dec.L, zero, zero_rtol)
    noisy = kernels.pattern_kernels(dec.L, zero, zero_rtol, row_noise=row_noise)
    assert len(_hits(Qt, clean, tol=1e-3)) < B  # not vacuous: the float tolerance misses some
    assert noisy.shape[1] == B and _hits(Qt, noisy, tol=1e-3) == set(range(B))
    assert kernels.pattern_kernels(dec.L, faces, zero_rtol, row_noise=row_noise).shape[1] == 0
    assert kernels.pattern_kernels(dec.L, rand, zero_rtol, row_noise=row_noise).shape[1] == 0


def test_noisy_refit_moves_columns_to_their_zero_rows_and_leaves_non_columns(truth) -> None:
    """Under noise (B = 40, m = 1000, real photos), columns a few milliradians off the truth
    come back to the least-squares kernels of their zero rows, several times closer to the
    true directions; random directions, which have no zero rows to fit, stay far from sparse."""
    B, m = 40, 1000
    t, dec, row_noise, gen = _noisy_truth(truth, B, m)
    Qt = columns.normalize_columns(dec.L.T @ t["D"])
    off = columns.normalize_columns(Qt + 3e-3 * torch.randn(Qt.shape, generator=gen,
                                                              dtype=Qt.dtype))
    Qr = torch.randn(B, 10, generator=gen, dtype=Qt.dtype)
    Qr = columns.normalize_columns(Qr)
    out = polish.noisy_refit(dec.L, torch.cat([off, Qr], dim=1), row_noise)
    err_before = 1 - (off * Qt).sum(dim=0).abs()
    err_after = 1 - (out[:, :B] * Qt).sum(dim=0).abs()
    assert float(err_after.median()) < 0.2 * float(err_before.median())
    assert bool(((out[:, :B] * off).sum(dim=0) > 0).all())  # signs kept
    score = filtering.noisy_sparsity(dec.L @ out, filtering.noise_scales(out, row_noise))
    trust = TUNING.noisy_trust * filtering.min_zero_count(m, 1e-5)
    assert bool((score[:B] >= trust).all()) and int(score[B:].max()) < 0.5 * trust


def test_polish_reports_the_zeros_its_directions_have(truth) -> None:
    """Polishing fits each direction to its smallest rows (``n_rows``, here more than a narrow
    layer's τ m) and reports its zero count, which the pool filters on: the count must be
    that of the returned direction, not of the rows it was fitted on (a least-squares fit to
    rows that are no sample's zeros has none). Random directions on a real (8, 32) batch."""
    t = truth(8, 32, seed=1)
    Q = torch.randn(8, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    Qp, zeros, _, _ = polish.polish(t["L"], Q, n_rows=10, zero_rtol=1e-4)
    assert torch.equal(zeros, columns.zero_mask(t["L"] @ Qp, 1e-4).sum(dim=0))


def test_polish_refits_until_the_zero_rows_settle(truth) -> None:
    """Directions 1e-3 off the true columns of a real (50, 1000) batch: the first pass fits
    the smallest rows, the second all zeros of that fit, which can still hold a row that is
    no zero (or miss one) and leave the column off by 1e-4. Polishing goes on while a
    column's zeros change, so every column comes back to float precision: as close to the
    truth as polishing the true columns themselves."""
    t = truth(50, 1000, seed=0)
    Qt = t["Qt"] / t["Qt"].norm(dim=0)
    n_rows = 324  # the attack's first pass at m = 1000 (3/4 of the 433 zeros a column needs)

    def worst(Q: torch.Tensor) -> float:
        Qp, _, _, _ = polish.polish(t["L"], Q, n_rows=n_rows, zero_rtol=1e-4)
        return float((Qp * torch.sign((Qp * Qt).sum(dim=0)) - Qt).norm(dim=0).max())

    floor = worst(Qt)  # the float32 gradient's own precision
    assert floor < 1e-4
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        Qn = Qt + 1e-3 * torch.randn(Qt.shape, generator=gen, dtype=Qt.dtype)
        assert worst(Qn) <= 1.5 * floor, seed
