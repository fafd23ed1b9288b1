"""The attack on real data: the certificate on the true directions and beside them, every
loss and optimiser near the samples' columns, SPEAR sampling, partial and completed searches
built directly, the time budget, and precise errors on bad input.

A search's outcome depends on where its random starts land, and PyTorch's vectorised kernels
change that from one CPU to another. So what a search must find is built into the situation
here (the true directions, or a round monkeypatched to offer chosen columns), and end-to-end
attacks on real batches assert only what ``fl_attack.invert`` promises whatever its search
finds (the ``promises`` fixture).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fl_attack
from fl_attack.config import AttackConfig
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.errors import ZeroUpdate
from fl_attack.solver import candidates
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState
from fl_attack.steps import completion, faces, polish, search
from fl_attack.steps.tolerances import ZERO_FLOOR
from fl_attack.testbed import data, models

pytestmark = pytest.mark.usefixtures("one_thread")


def _psnr(image_score, inputs: torch.Tensor, x: torch.Tensor, name: str) -> float:
    """The worst image's PSNR (dB) of the rows ``inputs`` against the images ``x``."""
    return float(image_score(inputs, x, name).psnr.min())


def _near(Qt: torch.Tensor, angle: float, seed: int = 0) -> torch.Tensor:
    """(B, B) unit starts, each ``angle`` radians off its column of ``Qt`` (unit columns), in
    a random direction orthogonal to it: starts inside the columns' basins."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(Qt.shape, generator=gen, dtype=Qt.dtype)
    noise -= Qt * (Qt * noise).sum(dim=0)
    return normalize_columns(Qt + math.tan(angle) * noise / noise.norm(dim=0))


def _offer(D: torch.Tensor, which: list[int]):
    """A search round that offers the pool the true columns ``which`` of ``D`` (m, B), the
    true ∂L/∂Z, in the coordinates of the search's factor L (a search round monkeypatched to
    find exactly these columns)."""

    def round_(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
        L = ctx.L
        q = normalize_columns(L.T @ D[:, which].to(L))
        pool.add(q, zero_mask(L @ q, ctx.zero_rtol).sum(dim=0))

    return round_


@pytest.mark.parametrize("name", ["photos32", "mnist"])
def test_the_certificate_holds_for_the_true_basis_and_for_nothing_beside_it(
        name: str, real_batch, output_side, mix, image_score) -> None:
    """B = 20, m = 200, with the attack's own tolerances, from the batch's true ∂L/∂Z. The
    true basis is certified (λ = 1) and reconstructs every image exactly (> 90 dB). For
    every sample, its column mixed with the sample sharing most of its zero rows (30%, 1%,
    0.1%: where a search on similar samples stalls) is not certified, and such a mixture,
    rounded and offered to the pool as every candidate of the search is, is refused or
    comes back as the sample's own column: no full basis of pool columns beside the truth
    is certified."""
    t = real_batch(name, 20, 200, seed=0)
    side = output_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.D)
    assert side.certified(Qt)
    assert _psnr(image_score, side.reconstruct(Qt), t.x, name) > 90.0
    partner = side.most_similar(Qt)
    admitted = 0
    for a in range(20):
        for share in (0.3, 1e-2, 1e-3):
            Q = mix(Qt, a, partner[a], share)
            assert not side.certified(Q), (a, share)
            kept = side.admitted(Q[:, a])
            if kept is not None:
                admitted += 1
                assert float((Qt.T @ kept).abs().max()) > 1 - 1e-6, (a, share)
    assert admitted > 0  # the situation: rounding brings mixtures back to columns


@pytest.mark.parametrize("name", ["photos32", "mnist"])
def test_default_attack_b20_m200_keeps_its_promises(name: str, real_batch, promises) -> None:
    """Default settings at B = 20, m = 200 (the papers' setting), the first two batches: the
    batch's shape, λ in [0, 1], and a certificate only for a full λ = 1 basis whose every
    image is exact, whatever the search finds."""
    for seed in range(2):
        t = real_batch(name, 20, 200, seed)
        rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed)
        promises(rec, t.x, name)


def test_numpy_inputs_give_the_tensor_result_at_float64_tolerances(
        real_batch, output_side, image_score, promises) -> None:
    """float64 gradients of an MNIST batch (B = 16, m = 200) given as numpy arrays are read
    as the same tensors: the same reconstruction, bit for bit, as from the tensors with the
    same seed. The attack's tolerances are float64's, under which the true basis is
    certified and exact."""
    t = real_batch("mnist", 16, 200, seed=2, dtype=torch.float64)
    side = output_side(t.G, t.g, t.W, t.b)
    assert side.system.zero_rtol == ZERO_FLOOR[torch.float64]
    Qt = side.basis(t.D)
    assert side.certified(Qt) and _psnr(image_score, side.reconstruct(Qt), t.x, "mnist") > 90.0
    kw = {"seed": 0, "max_seconds": None}
    rec = fl_attack.invert(t.G.numpy(), t.g.numpy(), weight=t.W.numpy(), bias=t.b.numpy(), **kw)
    ref = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, **kw)
    assert torch.equal(rec.inputs, ref.inputs)
    assert (rec.sparsity_match, rec.exact, rec.n_directions) == (
        ref.sparsity_match, ref.exact, ref.n_directions)
    promises(rec, t.x, "mnist")
    summary = rec.as_dict()
    assert summary["exact"] is rec.exact and summary["batch_size"] == 16


def test_float64_faces_are_split_at_the_float64_zero_test(real_batch, output_side, image_score,
                                                          promises) -> None:
    """float64 gradients of a photo batch (B = 20) whose samples share most of their ReLU
    pattern. The face of the two samples sharing most zero rows (the kernel of L on the rows
    where their mixture is smallest, from a Gram matrix as face splitting computes it) is
    two-dimensional at the float64 zero test (1e-7), and splitting it gives both samples'
    columns exactly (kernels from Gram matrices are only accurate to about √eps, so the test
    must be that loose). The true basis is certified and exact; the attack keeps its
    promises."""
    t = real_batch("photos32", 20, 200, seed=1, dtype=torch.float64)
    side = output_side(t.G, t.g, t.W, t.b)
    rtol, L = side.system.zero_rtol, side.dec.L
    assert rtol == ZERO_FLOOR[torch.float64]
    Qt = side.basis(t.D)
    assert side.certified(Qt)
    assert _psnr(image_score, side.reconstruct(Qt), t.x, "photos32") > 90.0
    zero = zero_mask(L @ Qt, rtol).double()
    shared = zero.T @ zero
    shared.fill_diagonal_(-1)
    i, j = divmod(int(shared.argmax()), 20)
    q = normalize_columns(Qt[:, [i]] + Qt[:, [j]])[:, 0]  # their mixture: where ℓ1 stalls
    n_rows = int(shared[i, j])
    N = faces.face_basis(L, q, n_rows, rtol)
    assert N.shape[1] == 2
    Qf, _ = faces.split_face(L, N, zero_rtol=rtol, generator=torch.Generator().manual_seed(0))
    cos = (Qt.T @ Qf).abs()
    assert {int(c.argmax()) for c in cos.T if float(c.max()) > 1 - 1e-9} == {i, j}
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0)
    promises(rec, t.x, "photos32")


def test_without_weight_and_bias_no_certificate(real_batch, output_side, image_score,
                                                promises) -> None:
    """Without the layer's weight and bias there is no λ, so nothing is certified whatever
    the search finds. The directions still determine the batch: the true ones give every
    image exactly, their scales from the bias gradient alone."""
    t = real_batch("photos32", 10, 200, seed=1)
    rec = fl_attack.invert(t.G, t.g, seed=0)
    assert rec.sparsity_match is None and rec.exact is False
    promises(rec, t.x, "photos32")
    side = output_side(t.G, t.g)
    assert _psnr(image_score, side.reconstruct(side.basis(t.D)), t.x, "photos32") > 90.0


OPTIONS = [
    {"loss": "l1", "optimizer": "pgd"},
    {"loss": "logcosh", "optimizer": "radam"},
    {"loss": "logcosh", "optimizer": "pgd"},
    {"loss": "l1", "optimizer": "radam", "polish": False, "steps": 500, "search_dtype": "float64"},
]


def _optimise(side, init: torch.Tensor, cfg: AttackConfig) -> torch.Tensor:
    """A search round's optimisation (``candidates.spearpp_round``) of the starts ``init`` (B, K)
    with the options of ``cfg``: unit directions (B, K) in float64."""
    dtype = torch.float32 if cfg.search_dtype == "float32" else torch.float64
    Q = search.optimise_on_sphere(side.dec.L.to(dtype), init.T.to(dtype), loss=cfg.loss,
                                  optimizer=cfg.optimizer, steps=cfg.steps, lr=cfg.lr,
                                  milestones=cfg.lr_milestones, gamma=cfg.lr_gamma,
                                  alpha=cfg.logcosh_alpha)
    return normalize_columns(Q.double())


@pytest.mark.parametrize("options", OPTIONS)
def test_every_loss_and_optimizer_returns_to_the_samples_columns(
        options: dict, real_batch, output_side, promises) -> None:
    """Each loss and optimiser as a search round runs it (steps, precision, schedule), from
    starts 0.05 rad off every true column of a real batch (B = 8, m = 200). ℓ1 has a sharp
    minimum at each sample's column and LogCosh a smooth one next to it, so every run comes
    back to its column (to 1e-3 in 1 - cos), and rounding (``polish``) makes it the exact
    column. The whole attack with these options keeps its promises; without rounding a
    certificate means every zero pattern is right, each column within the zero test of the
    truth, so its images are held to 75 dB, not 90."""
    t = real_batch("photos32", 8, 200, seed=3)
    side = output_side(t.G, t.g, t.W, t.b)
    cfg = AttackConfig(**options)
    Qt = side.basis(t.D)
    Q = _optimise(side, _near(Qt, 0.05), cfg)
    assert float((1 - (Q * Qt).sum(dim=0).abs()).max()) < 1e-3
    Qp = polish.polish(side.dec.L, Q, n_rows=side.ctx.n_rows(), zero_rtol=side.system.zero_rtol)[0]
    assert float((1 - (Qp * Qt).sum(dim=0).abs()).max()) < 1e-12
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, **options)
    promises(rec, t.x, "photos32", exact_db=90.0 if cfg.polish else 75.0)


def test_l4_runs_and_is_weaker(real_batch, output_side, promises) -> None:
    """−ℓ4 (SPEAR++ §4: weaker than ℓ1). The samples' columns are not its critical points: at
    every true column of a real batch (B = 8, m = 200) the gradient of Σ v⁴ along the sphere
    keeps more than 5% of its length (measured 8-29%). So from the same starts 0.05 rad off
    the columns, where ℓ1 comes back to all 8, −ℓ4 comes back to fewer than half (to 1e-3)
    with either optimiser. The attack with −ℓ4 still returns a valid result."""
    t = real_batch("photos32", 8, 200, seed=3)
    side = output_side(t.G, t.g, t.W, t.b)
    L, Qt = side.dec.L, side.basis(t.D)
    grad = L.T @ (L @ Qt).pow(3)
    along = grad - Qt * (Qt * grad).sum(dim=0)
    assert float((along.norm(dim=0) / grad.norm(dim=0)).min()) > 0.05
    init = _near(Qt, 0.05)

    def back(options: dict) -> int:
        Q = _optimise(side, init, AttackConfig(**options))
        return int(((1 - (Q * Qt).sum(dim=0).abs()) < 1e-3).sum())

    for optimizer in ("radam", "pgd"):
        assert back({"loss": "l1", "optimizer": optimizer}) == 8
        assert back({"loss": "l4", "optimizer": optimizer}) < 4, optimizer
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, loss="l4", max_rounds=1)
    assert rec.inputs.shape == (8, 3072)
    promises(rec, t.x, "photos32")


def test_spear_sampling_is_exact_where_every_column_is_surely_drawn(
        real_batch, output_side, image_score) -> None:
    """SPEAR sampling (B = 10, m = 200) draws random (B-1)-row sets of L from the seeded
    generator, and a set inside a sample's live zero rows gives that sample's column (other
    sets give directions with B - 1 zeros, below τ m, or rank-deficient ones). From the true
    ∂L/∂Z: each column's chance per draw, C(z, B-1) / C(m, B-1) for its z live zero rows,
    times the sampling budget is over 50 expected draws, so each column is missed with
    probability below e^-50 whatever the CPU. The search is then certified and exact."""
    t = real_batch("photos32", 10, 200, seed=1)
    live = t.G.abs().amax(dim=1) > 0
    zeros = ((t.D == 0) & live[:, None]).sum(dim=0)
    budget = AttackConfig().max_samples
    expected = [budget * math.comb(int(z), 9) / math.comb(200, 9) for z in zeros]
    assert min(expected) > 50, expected
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, method="spear", seed=0,
                           max_seconds=None)
    assert rec.method == "spear" and rec.exact and rec.n_directions == 10
    assert _psnr(image_score, rec.inputs, t.x, "photos32") > 90.0


def test_a_search_that_finds_five_columns_gives_a_partial_uncertified_batch(
        monkeypatch: pytest.MonkeyPatch, real_batch, promises) -> None:
    """Built directly: every search round offers the pool the same five true columns of a
    real batch (B = 20), and nothing completes the other 15 (slice sampling off; the exact
    completion needs at most three missing). The selection is completed with an orthonormal
    complement: 5 directions, a partial result, not certified, the batch's shape."""
    t = real_batch("photos32", 20, 200, seed=0)
    monkeypatch.setattr(candidates, "spearpp_round", _offer(t.D, [0, 3, 7, 11, 15]))
    monkeypatch.setattr(candidates, "neighbour_search", lambda *a: None)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_rounds=2,
                           slice_samples=0, max_seconds=None)
    assert rec.partial and rec.n_directions == 5 and not rec.exact
    assert rec.rounds == 2
    promises(rec, t.x, "photos32")


@pytest.mark.parametrize("dataset", ["photos32", "mnist"])
def test_a_search_that_finds_all_but_three_columns_is_completed_exactly(
        dataset: str, monkeypatch: pytest.MonkeyPatch, real_batch, image_score) -> None:
    """Built directly: the search round offers the pool 17 of the 20 true columns of a real
    batch (m = 200). With three missing, the exact completion (``completion.complete_missing``:
    every cell of the missing samples' sign arrangement, from W and b, no random draw) gives
    the missing columns: certified, all 20 directions, every image exact."""
    t = real_batch(dataset, 20, 200, seed=0)
    monkeypatch.setattr(candidates, "spearpp_round", _offer(t.D, list(range(3, 20))))
    monkeypatch.setattr(candidates, "neighbour_search", lambda *a: None)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, slice_samples=0,
                           max_seconds=None)
    assert rec.exact and rec.n_directions == 20
    assert _psnr(image_score, rec.inputs, t.x, dataset) > 90.0


def test_slice_sampling_runs_on_a_search_that_found_nothing(
        monkeypatch: pytest.MonkeyPatch, real_batch, promises) -> None:
    """Built directly: every search round finds nothing (B = 20). The completion then samples
    the slice of all B samples from W and b (``completion.sample_missing`` with no found
    column), every round, and whatever it gives keeps the attack's promises."""
    t = real_batch("photos32", 20, 200, seed=0)
    found: list[int] = []
    sample = completion.sample_missing

    def spy(system, cols, **kw):
        found.append(cols.shape[1])
        return sample(system, cols, **kw)

    monkeypatch.setattr(candidates, "spearpp_round", _offer(t.D, []))
    monkeypatch.setattr(candidates, "neighbour_search", lambda *a: None)
    monkeypatch.setattr(completion, "sample_missing", spy)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_rounds=1,
                           max_seconds=None)
    assert found and found[0] == 0
    promises(rec, t.x, "photos32")


def test_slice_first_samples_the_slice_before_any_search_round(
        monkeypatch: pytest.MonkeyPatch, real_batch, image_score) -> None:
    """``slice_first``: the slice of all B samples is sampled before any search round. Built
    directly, with the slice sampling monkeypatched: when it gives every true column the
    batch is certified and exact with no round run (no "search" timing); when it gives
    nothing the rounds run after it."""
    t = real_batch("photos32", 20, 200, seed=0)
    real_round = candidates.spearpp_round
    events: list[str] = []

    def slice_all(system, cols, **kw):
        events.append("slice")
        return normalize_columns(system.L.T @ t.D.to(system.L))

    def slice_none(system, cols, **kw):
        events.append("slice")
        return system.L.new_zeros(system.L.shape[1], 0)

    def logged_round(ctx, state, pool):
        events.append("round")
        real_round(ctx, state, pool)

    monkeypatch.setattr(candidates, "spearpp_round", logged_round)
    monkeypatch.setattr(completion, "sample_missing", slice_all)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, slice_first=True,
                           max_seconds=None)
    assert events == ["slice"] and rec.rounds == 0 and "search" not in rec.timings
    assert rec.exact and _psnr(image_score, rec.inputs, t.x, "photos32") > 90.0
    events.clear()
    monkeypatch.setattr(completion, "sample_missing", slice_none)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, slice_first=True,
                           max_rounds=1, max_seconds=None)
    assert events[0] == "slice" and "round" in events
    assert rec.rounds == 1 and "search" in rec.timings


def test_hard_batches_with_similar_samples_are_sound(real_batch, output_side, mix,
                                                     promises) -> None:
    """Two (30, 200) photo batches with unusual columns: batch 3 has a sample whose 96 zero
    rows share 93 with another's (its true column has leverage above ``max_leverage``; the
    repair step that keeps it is unit-tested in tests/test_steps.py), batch 16 an active
    unit whose ∂L/∂Z is below the float32 zero test (a chance zero, idem). From the true
    ∂L/∂Z: the true basis is certified (batch 16's chance zero forgiven), and for every
    sample its column mixed with the most similar sample's (30%, 1%) is not. The attack on
    both keeps its promises: chance zeros are forgiven only at λ = 1, and a certificate
    means every image exact."""
    for seed in (3, 16):
        t = real_batch("photos32", 30, 200, seed)
        side = output_side(t.G, t.g, t.W, t.b)
        Qt = side.basis(t.D)
        assert side.certified(Qt), seed
        partner = side.most_similar(Qt)
        for a in range(30):
            for share in (0.3, 1e-2):
                assert not side.certified(mix(Qt, a, partner[a], share)), (seed, a, share)
        rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed)
        promises(rec, t.x, "photos32")


def test_explicit_batch_size_and_timings(real_batch) -> None:
    t = real_batch("mnist", 12, 200, seed=4)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, batch_size=12, seed=0)
    assert rec.batch_size == 12 and rec.seconds > 0 and "search" in rec.timings


def test_every_call_is_bounded_and_a_spent_budget_is_reported(real_batch, promises) -> None:
    """``max_seconds`` has a finite default (``None`` only when asked for). A budget that is
    already spent when the search starts still gives a batch of the right shape, a
    certificate only for a full λ = 1 basis of exact images, and says that the budget ended
    the search, on every side; a run that ends by its own stop rule says it did not."""
    from fl_attack.config import DEFAULT_MAX_SECONDS

    assert fl_attack.AttackConfig().max_seconds == DEFAULT_MAX_SECONDS < float("inf")
    assert fl_attack.AttackConfig(max_seconds=None).max_seconds is None
    t = real_batch("photos32", 20, 200, seed=0)
    for side in ("output", "input", "auto"):
        rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, sparse=side,
                               max_seconds=1e-9)
        assert rec.budget_exhausted and rec.as_dict()["budget_exhausted"] is True, side
        promises(rec, t.x, "photos32")
    t = real_batch("photos32", 8, 200, seed=3)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_seconds=None)
    assert not rec.budget_exhausted and rec.as_dict()["budget_exhausted"] is False


def test_import_and_search_raise_no_future_warning() -> None:
    """Importing the package and running a radam search (geoopt, imported lazily) with
    FutureWarnings turned into errors: nothing from this package's side."""
    import subprocess
    import sys

    code = ("import torch, fl_attack\n"
            "from fl_attack.steps import search\n"
            "L = torch.linalg.qr(torch.randn(40, 4, dtype=torch.float64)).Q\n"
            "g = torch.Generator().manual_seed(0)\n"
            "init = search.random_sphere(8, 4, generator=g, dtype=torch.float64,\n"
            "                            device=torch.device('cpu'))\n"
            "assert search.optimise_on_sphere(L, init, steps=20).shape == (4, 8)\n")
    run = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr, run.stderr


# ---------------------------------------------------------------- bad input ------------------
@pytest.fixture(scope="module")
def layer(real_batch):
    t = real_batch("photos32", 6, 100, seed=0)
    return t.G, t.g, t.W, t.b


def test_non_finite_gradient(layer) -> None:
    G, g, W, b = layer
    G = G.clone()
    G[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight_grad contains 1 non-finite"):
        fl_attack.invert(G, g)
    g2 = g.clone()
    g2[3] = float("inf")
    with pytest.raises(ValueError, match="bias_grad contains"):
        fl_attack.invert(layer[0], g2)


def test_shapes(layer) -> None:
    G, g, W, b = layer
    with pytest.raises(ValueError, match="weight_grad must be a .m, n. matrix"):
        fl_attack.invert(G.reshape(-1), g)
    with pytest.raises(ValueError, match="bias_grad has shape"):
        fl_attack.invert(G, g[:-1])
    with pytest.raises(ValueError, match="weight has shape"):
        fl_attack.invert(G, g, weight=W.T, bias=b)
    with pytest.raises(ValueError, match="both weight and bias"):
        fl_attack.invert(G, g, weight=W)
    with pytest.raises(TypeError, match="torch.Tensor or numpy.ndarray"):
        fl_attack.invert(G.tolist(), g)


def test_zero_gradients_raise_a_zero_update_naming_the_part(layer) -> None:
    G, g, W, b = layer
    with pytest.raises(ZeroUpdate, match="weight_grad is identically zero") as weight:
        fl_attack.invert(torch.zeros_like(G), g)
    assert weight.value.part == "weight"
    with pytest.raises(ZeroUpdate, match="bias_grad is identically zero") as bias:
        fl_attack.invert(G, torch.zeros_like(g))
    assert bias.value.part == "bias" and isinstance(bias.value, ValueError)


def test_full_rank_gradient_not_identifiable() -> None:
    """A batch not smaller than the layer: rank min(m, n), so the batch cannot be recovered."""
    x, y = data.sample_batch("photos32", 40, seed=0)
    model = models.relu_mlp(3072, 30, 3, seed=0)
    G, g = models.first_layer_gradients(model, data.normalize(x, "photos32"), y)
    with pytest.raises(ValueError, match="full numerical rank"):
        fl_attack.invert(G, g)
    with pytest.raises(ValueError, match="not smaller than min"):
        fl_attack.invert(G, g, batch_size=30)


def test_unknown_options(layer) -> None:
    G, g, W, b = layer
    with pytest.raises(TypeError, match="unknown attack option"):
        fl_attack.invert(G, g, n_inits=10)
    with pytest.raises(ValueError, match="unknown method"):
        fl_attack.invert(G, g, method="spear+")
    with pytest.raises(ValueError, match="unknown loss"):
        fl_attack.invert(G, g, loss="l2")
    with pytest.raises(ValueError, match="unknown device"):
        fl_attack.invert(G, g, device="tpu:0")
    with pytest.raises(ValueError, match="unknown sparse"):
        fl_attack.invert(G, g, sparse="inputs")
    with pytest.raises(ValueError, match="unknown update 'fedsgd'"):
        fl_attack.invert(G, g, update="fedsgd")
    with pytest.raises(ValueError, match="unknown weights_dtype 'float8'"):
        fl_attack.invert(G, g, weight=W, bias=b, weights_dtype="float8")
    with pytest.raises(ValueError, match="weights_dtype='float32' needs the layer's weight"):
        fl_attack.invert(G, g, weights_dtype="float32")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        fl_attack.AttackConfig(steps=0)
    with pytest.raises(ValueError, match="verify_dim must be a non-negative int"):
        fl_attack.AttackConfig(verify_dim=-1)
    assert fl_attack.AttackConfig(verify_dim=0).verify_dim == 0  # 0: the check is off
    with pytest.raises(ValueError, match="slice_first must be True, False or None"):
        fl_attack.AttackConfig(slice_first="yes")
    with pytest.raises(ValueError, match="alternate must be True, False or None"):
        fl_attack.AttackConfig(alternate="yes")


def test_tau_binomial_tail() -> None:
    """SPEAR §4.1: m = 400 and p_fr < 1e-5 give τ ≈ 0.395."""
    from scipy.stats import binom

    from fl_attack.steps.filtering import min_zero_count

    k = min_zero_count(400, 1e-5)
    assert binom.cdf(k - 1, 400, 0.5) < 1e-5 <= binom.cdf(k, 400, 0.5)
    assert abs((k - 1) / 400 - 0.395) < 0.01
    assert np.isclose(binom.cdf(k - 1, 400, 0.5), 2.0**-400 * sum(
        __import__("math").comb(400, i) for i in range(k)))


def test_rank_under_a_noise_bulk_that_is_not_flat() -> None:
    """A rank-20 signal under i.i.d. noise 100x below its smallest singular value (no 1000x
    drop) in a near-square 1000 x 800 matrix, like the float32 rounding of a DP-SGD weight
    difference at m = 4000, n = 3072: the noise bulk spans ν(√m ± √n), far from flat, and must
    still be read as noise (B = 20), not as a full-rank signal."""
    from fl_attack.steps.decompose import estimate_rank

    gen = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(1000, 20, generator=gen, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(800, 20, generator=gen, dtype=torch.float64))[0]
    signal = U @ torch.diag(torch.linspace(1.0, 0.1, 20, dtype=torch.float64)) @ V.T
    nu = 0.1 / 100 / (1000**0.5 + 800**0.5)  # the noise edge 100x below the smallest signal
    noisy = signal + nu * torch.randn(1000, 800, generator=gen, dtype=torch.float64)
    s = torch.linalg.svdvals(noisy)
    assert float(s[19] / s[20]) < 1e3  # no cliff: the noise route decides
    rank, est, _ = estimate_rank(s, 1000, 800, max_rank=800)
    assert rank == 20 and abs(est / nu - 1) < 0.05


def test_a_drop_ends_the_signal_only_above_a_rounding_bulk() -> None:
    """A trained model's spectrum drops 2000x after its dominant sample and goes on falling,
    sample by sample, to the rounding (the quickstart CNN's fc1 after 3000 steps): the drop is
    not the end of the signal, every value above the rounding floor is a sample. The same
    drop onto a flat bulk ends it."""
    from fl_attack.steps.decompose import estimate_rank

    gen = torch.Generator().manual_seed(0)
    bulk = 3e-8 * (1 + 0.5 * torch.rand(112, generator=gen, dtype=torch.float64))
    samples = torch.tensor([1.0, 5e-4, 1e-5, 4e-6, 2e-6, 1.5e-6, 1e-7, 9e-8], dtype=torch.float64)
    s = torch.cat([samples, bulk]).sort(descending=True).values
    rank, _, _ = estimate_rank(s, 120, 400, floor_rtol=1e-6, max_rank=120)
    assert rank == 6  # the samples above the float32 floor, not the 1 before the drop
    flat = torch.cat([samples[:1], 1e3 * bulk]).sort(descending=True).values
    assert float(flat[0] / flat[1]) > 1e3
    assert estimate_rank(flat, 120, 400, floor_rtol=1e-6, max_rank=120)[0] == 1


@pytest.mark.parametrize(("dtype", "weights_dtype", "want"), [
    (torch.float64, None, torch.float64), (torch.float64, "float64", torch.float64),
    (torch.float64, "float32", torch.float32), (torch.float64, "bfloat16", torch.float32),
    (torch.float32, None, torch.float32)])
def test_a_difference_of_stored_weights_is_as_precise_as_their_storage(
        dtype: torch.dtype, weights_dtype: str | None, want: torch.dtype) -> None:
    """The tolerances follow the coarser of the update's dtype and the weights' storage: a
    float64 copy of the difference of float32 weights (what a Flower server forms from a
    reply) is read at float32's tolerances, as the float32 difference is."""
    from fl_attack.validation import load_layer

    gen = torch.Generator().manual_seed(0)
    G, W = torch.randn(6, 4, generator=gen, dtype=dtype), torch.randn(6, 4, generator=gen)
    g, b = torch.randn(6, generator=gen, dtype=dtype), torch.randn(6, generator=gen)
    layer = load_layer(G, g, W, b, None, "cpu", AttackConfig(weights_dtype=weights_dtype))
    assert layer.precision == want
