"""FedAvg updates (SPEAR App. F, SPEAR++ §5.3): ``W₀ - W_E`` after several local steps,
attacked with ``update="fedavg"``, on real photo batches from the library's simulated client.

The contracts are checked on the update's true directions: the summed output gradients
lr Σ_s ∂L/∂Z_s of the client's local steps, got by replaying its training. End-to-end attacks
assert only what ``fl_attack.invert`` promises whatever its search finds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fl_attack
from fl_attack.core.columns import normalize_columns
from fl_attack.model import updates
from fl_attack.solver import candidates, certify, loop
from fl_attack.solver import output_side as output_side_module
from fl_attack.solver.certify import Assessment
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, SearchState
from fl_attack.steps import match
from fl_attack.testbed import data, models, simulate

pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.01


@dataclass
class Update:
    """A client's FedAvg (or FedSGD) update of the first layer, and the truth behind it."""

    x: torch.Tensor
    """(B, 3, 32, 32) the client's images."""
    dW: torch.Tensor
    db: torch.Tensor
    W0: torch.Tensor
    b0: torch.Tensor
    D: torch.Tensor
    """(m, B) float64: lr Σ_s ∂L/∂Z_s over the local steps, per sample (dW = D X)."""


def _replay(model: nn.Module, xn: torch.Tensor, y: torch.Tensor, *, lr: float, epochs: int,
            batch_size: int | None, seed: int, output_grad) -> tuple[torch.Tensor, nn.Module]:
    """The client's local SGD (``simulate.local_update``: the same seeded mini-batches, plain
    SGD on the mean cross-entropy) with each sample's first-layer output gradient summed over
    the steps it takes part in: (lr Σ_s ∂L/∂Z_s (m, B), the trained model)."""
    n = xn.shape[0]
    shuffle = torch.Generator().manual_seed(seed)
    local = copy.deepcopy(model)
    optimizer = torch.optim.SGD(local.parameters(), lr=lr)
    D = torch.zeros(models.linear_layers(model)[0].out_features, n, dtype=torch.float64)
    for _ in range(epochs):
        steps = ([torch.arange(n)] if batch_size is None or batch_size >= n
                 else list(torch.randperm(n, generator=shuffle).split(batch_size)))
        for idx in steps:
            D[:, idx] += lr * output_grad(local, xn[idx], y[idx])
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(local(xn[idx]), y[idx]).backward()
            optimizer.step()
    return D, local


def _client(x: torch.Tensor, y: torch.Tensor, model: nn.Module, protocol: str, epochs: int,
            batch_size: int | None, seed: int, output_grad, lr: float = LR) -> Update:
    xn = data.normalize(x, "photos32")
    res = simulate.local_update(model, xn, y, protocol=protocol, lr=lr, epochs=epochs,
                                batch_size=batch_size, seed=seed)
    dW, db, W0, b0 = updates.weight_update_pair(model.state_dict(), res.state_dict)
    D, local = _replay(model, xn, y, lr=lr, epochs=epochs, batch_size=batch_size, seed=seed,
                       output_grad=output_grad)
    for key, value in local.state_dict().items():  # the replay is the client's training
        assert torch.equal(value, res.state_dict[key]), key
    return Update(x=x, dW=dW, db=db, W0=W0, b0=b0, D=D)


def _fedavg(seed: int, epochs: int, batch_size: int | None, output_grad, B: int = 20,
            m: int = 200) -> Update:
    """A FedAvg client update of a real photo batch (B, m) through a fresh ReLU MLP."""
    x, y = data.sample_batch("photos32", B, seed=seed)
    model = models.relu_mlp(x[0].numel(), m, 3, seed=seed)
    return _client(x, y, model, "fedavg", epochs, batch_size, seed, output_grad)


def _narrow(seed: int, protocol: str, epochs: int, batch_size: int | None, output_grad,
            B: int = 8, m: int = 32) -> Update:
    """A client update of a narrow first layer (3072 -> m): one model (seed 0) for every
    batch, ``load_images("photos32", B, seed=seed)`` as the client's data."""
    x, y = data.load_images("photos32", B, seed=seed)
    model = models.relu_mlp(x[0].numel(), m, 3, 10, seed=0)
    return _client(x, y, model, protocol, epochs, batch_size, seed, output_grad)


def test_subset_match_counts_only_unexplained_zeros() -> None:
    """λ's entry test for FedAvg sums: a zero needs an inactive unit, a non-zero entry always
    matches; the single-step test needs both directions."""
    Z = torch.tensor([[-1.0], [-1.0], [2.0], [2.0]])
    Dzero = torch.tensor([[True], [False], [True], [False]])
    assert match.matches(Z, Dzero).squeeze(1).tolist() == [True, False, False, True]
    assert match.matches(Z, Dzero, subset=True).squeeze(1).tolist() == [True, True, False, True]


def test_five_full_batch_local_steps_are_read_but_never_certified_with_update_fedavg(
        output_grad, output_side, mix, image_score, promises) -> None:
    """E = 5 full-batch steps, B = 20, m = 200. The update is D Xᵀ-shaped with D = lr Σ_e
    ∂L/∂Z_e (replayed): sample j's column vanishes on the units it leaves inactive at every
    step, fewer than at W₀. So the true basis fails the single-step reading ("inactive at W₀
    ⇔ zero"; λ 0.93-0.99 in fedavg.md) and passes the FedAvg reading (zeros only on
    inactive units, each column pinned by its zero rows), and its reconstruction is every
    image exactly. Yet the FedAvg reading proves nothing: its λ is one-sided, and a mixture
    of similar samples passes it and, within the update's float32 noise, the pinning too
    (at 1% and 0.1% here; 30% is not pinned). So nothing is certified with
    ``update="fedavg"``, not even the truth. A mixture rounded and offered to the pool, as
    every candidate of the search is, is refused or comes back as the sample's own column.
    The search itself is run once: it keeps its promises and is never exact."""
    u = _fedavg(seed=0, epochs=5, batch_size=None, output_grad=output_grad)
    fedavg = output_side(u.dW, u.db, u.W0, u.b0, update="fedavg")
    single = output_side(u.dW, u.db, u.W0, u.b0)
    assert fedavg.B == single.B == 20 and not fedavg.ctx.noisy
    Qt = fedavg.basis(u.D)
    assert fedavg.lam(Qt) == 1.0 and certify.pinning(fedavg.ctx, Qt).all
    assert not fedavg.certified(Qt) and not certify.supported(fedavg.ctx, Qt)
    assert single.lam(Qt) < 1.0 and not single.certified(Qt)
    assert float(image_score(fedavg.reconstruct(Qt), u.x, "photos32").psnr.min()) > 90.0
    partner = fedavg.most_similar(Qt)
    admitted = 0
    for a in range(20):
        Q = mix(Qt, a, partner[a], 0.3)
        assert not bool(certify.pinning(fedavg.ctx, Q).pinned[a]), a
        assert not fedavg.certified(mix(Qt, a, partner[a], 1e-2))
        for share in (0.3, 1e-2, 1e-3):
            kept = fedavg.admitted(mix(Qt, a, partner[a], share)[:, a])
            if kept is not None:  # admitted: then it is the sample's own column
                admitted += 1
                assert float((Qt.T @ kept).abs().max()) > 1 - 1e-6, (a, share)
    assert admitted > 0  # the situation: rounding brings mixtures back to columns
    rec = fl_attack.invert(u.dW, u.db, weight=u.W0, bias=u.b0, seed=0, update="fedavg",
                           max_seconds=None)
    promises(rec, u.x, "photos32")
    assert not rec.exact


def test_a_completed_column_of_a_fedavg_sum_counts_as_unmatched(output_grad,
                                                               output_side) -> None:
    """A FedAvg sum's λ tests only that zero rows are inactive units, so a completed column
    (dense: no zero row) passes it whole. The λ a FedAvg reading reports counts such columns
    as unmatched: with k of B columns completed it is at most (B - k)/B, 0 with none found,
    and the true columns keep their own count. A single step's λ is left as it is."""
    u = _fedavg(seed=0, epochs=5, batch_size=None, output_grad=output_grad)
    fedavg = output_side(u.dW, u.db, u.W0, u.b0, update="fedavg")
    B, m = fedavg.B, u.dW.shape[0]
    Qt = fedavg.basis(u.D)
    dense = normalize_columns(torch.randn(B, B, generator=torch.Generator().manual_seed(0),
                                          dtype=Qt.dtype))
    found = torch.arange(B) >= 5
    Q = torch.where(found[None, :], Qt, dense)
    got = match.sparsity_match(Q, fedavg.system)
    assert got is not None and bool((got.per_column[~found] == m).all())  # the vacuous pass
    kept = output_side_module._with_evidence(got, found, subset=True)
    assert kept is not None and kept.value <= (B - 5) / B
    assert bool((kept.per_column[~found] == 0).all())
    assert torch.equal(kept.per_column[found], got.per_column[found])
    none = output_side_module._with_evidence(got, torch.zeros(B, dtype=torch.bool), subset=True)
    assert none is not None and none.value == 0.0
    assert output_side_module._with_evidence(got, found, subset=False) is got
    assert output_side_module._with_evidence(got, torch.ones(B, dtype=torch.bool),
                                             subset=True) is got


@pytest.mark.parametrize("epochs", [2, 20])
def test_mini_batch_fedavg_still_leaks(epochs: int, output_grad, output_side, image_score,
                                       promises) -> None:
    """Mini-batches of 5 (4 steps per epoch): a sample's first step is not at W₀, so
    its zeros need not be inactive units of W₀ and certification is not expected. The update
    still has rank B (dW = D X with D the replayed sum of each sample's output gradients),
    its batch size is read off, and the update's true directions give every image back
    exactly: the batch leaks. The search (two rounds) keeps ``invert``'s promises."""
    u = _fedavg(seed=4, epochs=epochs, batch_size=5, output_grad=output_grad)
    side = output_side(u.dW, u.db, u.W0, u.b0, update="fedavg")
    assert side.B == 20
    Qt = side.basis(u.D)
    assert float(image_score(side.reconstruct(Qt), u.x, "photos32").psnr.min()) > 90.0
    rec = fl_attack.invert(u.dW, u.db, weight=u.W0, bias=u.b0, seed=0, update="fedavg",
                           max_rounds=2, max_seconds=None)
    promises(rec, u.x, "photos32")


def test_a_dead_neuron_does_not_hide_the_batch_size_of_a_small_step_update(
        output_grad, output_side, image_score, promises) -> None:
    """η = 0.001, E = 5, full batch, with one first-layer unit that no sample activates (built
    so: its bias far below zero): its row of W₀ - W_E is exactly zero, and the float32 rounding
    of the weight difference sits only ~10³ below the 20th singular value. The drop to the zero
    singular value must not be read as the end of the signal ("full numerical rank 199"):
    dead rows are left out of the rank estimate, and B = 20 is read off, before any search.

    That rounding also bounds what the update holds: even its true directions (the replayed
    sum of output gradients) give the worst image only ~80 dB. Here, on one CPU, the
    search's one round once returned a basis whose λ was 1 and whose every column was pinned
    at that noise level, with a column mixing four similar samples (inputs 8% off): the
    reason a FedAvg reading is never certified. The attack keeps its promises and is not
    exact."""
    x, y = data.sample_batch("photos32", 20, seed=1)
    model = models.relu_mlp(x[0].numel(), 200, 3, seed=1)
    with torch.no_grad():
        models.linear_layers(model)[0].bias[7] = -1e3
    u = _client(x, y, model, "fedavg", 5, None, 1, output_grad, lr=0.001)
    assert float(u.dW[7].abs().max()) == 0.0  # the situation: an exactly zero row
    side = output_side(u.dW, u.db, u.W0, u.b0, update="fedavg")
    assert side.B == 20
    Qt = side.basis(u.D)
    assert side.lam(Qt) == 1.0 and not side.certified(Qt)
    truth = side.reconstruct(Qt)
    score = image_score(truth, x, "photos32")
    assert float(score.psnr.min()) < 90.0 < float(score.mean_psnr)  # the situation
    rec = fl_attack.invert(u.dW, u.db, weight=u.W0, bias=u.b0, seed=0, update="fedavg",
                           max_rounds=1, max_faces=4, max_seconds=None)
    promises(rec, x, "photos32", exact_db=None)
    assert rec.batch_size == 20 and not rec.exact


def test_the_fedavg_lambda_passes_mixtures_the_pinning_does_not(output_grad, output_side,
                                                                mix) -> None:
    """m = 32, B = 8, E = 5 full-batch steps: λ with ``update="fedavg"`` checks only that
    zero rows are inactive units, and a column mixing two samples vanishes exactly where both
    are inactive, so λ passes some 30% mixtures. Built directly from the true columns: the
    pinning (``certify.pinning``) asks each column to be the one-dimensional kernel of L on
    its zero rows, which a 30% mixture is not; a column 3e-5 off a pinned true column has
    the same zero rows, and their kernel is the true column (what ``certify.prove`` settles
    it to). Neither is ever certified."""
    u = _narrow(seed=4, protocol="fedavg", epochs=5, batch_size=None, output_grad=output_grad)
    side = output_side(u.dW, u.db, u.W0, u.b0, update="fedavg")
    assert side.B == 8
    Qt = side.basis(u.D)
    truth = certify.pinning(side.ctx, Qt).pinned
    assert bool(truth.any())
    lam_one = 0
    for a in range(8):
        wide = mix(Qt, a, (a + 1) % 8, 0.3)
        lam_one += side.lam(wide) == 1.0
        assert not bool(certify.pinning(side.ctx, wide).pinned[a])
        close = certify.pinning(side.ctx, mix(Qt, a, (a + 1) % 8, 3e-5))
        if truth[a]:
            assert float(close.kernels[:, a] @ Qt[:, a]) > 1 - 1e-9
        assert not side.certified(wide) and not certify.supported(side.ctx, wide)
    assert lam_one > 0  # the situation: λ alone cannot tell some of them from the truth


@pytest.mark.parametrize(("protocol", "epochs", "batch_size"),
                         [("fedavg", 2, 4), ("fedavg", 5, None), ("fedsgd", 1, None)])
def test_narrow_layer_certificates_are_exact(protocol: str, epochs: int,
                                             batch_size: int | None, output_grad,
                                             output_side, mix, image_score,
                                             promises) -> None:
    """The certificate's contract on a narrow layer (m = 32, B = 8), where few zero rows per
    column give λ little to check: FedAvg with mini-batches of 4 (2 epochs), five full-batch
    steps (never certified), and a FedSGD step attacked as a gradient. Built from each
    update's true columns (batches 0-2):

    * the true basis reconstructs every image exactly, and where every step starts from W₀
      (full batches) its λ is 1;
    * a 30% mixture of two samples is never certified;
    * a mixture of two samples (30%, 1%, 0.1%), rounded to the kernel of its zero rows and
      offered to the pool as the search offers every candidate (``polish.polish``,
      ``CandidatePool.add``), is either refused or is the true column: the search cannot
      certify a mixture it never holds.

    Each update is then attacked (batches 0-1): a certificate means every image exact."""
    update = "gradient" if protocol == "fedsgd" else "fedavg"
    for seed in range(3):
        u = _narrow(seed, protocol, epochs, batch_size, output_grad)
        side = output_side(u.dW, u.db, u.W0, u.b0, update=update)
        assert side.B == 8
        Qt = side.basis(u.D)
        assert float(image_score(side.reconstruct(Qt), u.x, "photos32").psnr.min()) > 90.0
        if batch_size is None:
            assert side.lam(Qt) == 1.0
        admitted = 0
        for a in range(8):
            for b in range(8):
                if b == a:
                    continue
                assert not side.certified(mix(Qt, a, b, 0.3)), (seed, a, b)
                for share in (0.3, 1e-2, 1e-3):
                    kept = side.admitted(mix(Qt, a, b, share)[:, a])
                    if kept is not None:  # admitted: then it is the sample's own column
                        admitted += 1
                        cos = float((Qt.T @ kept).abs().max())
                        assert cos > 1 - 1e-6, (seed, a, b, share, cos)
        assert admitted > 0  # the situation: rounding does bring mixtures back to columns
        if seed < 2:
            rec = fl_attack.invert(u.dW, u.db, weight=u.W0, bias=u.b0, seed=seed,
                                   update=update, max_seconds=None)
            promises(rec, u.x, "photos32")


@pytest.mark.parametrize("update", ["fedavg", "gradient"])
def test_rounds_that_only_grow_the_pool_end_a_fedavg_search(
        monkeypatch: pytest.MonkeyPatch, update: str, output_grad, output_side) -> None:
    """The stop rule on a stuck full basis, built directly: every round adds a new candidate
    to the pool and the selection keeps λ < 1. A FedAvg pool grows by mixtures of similar
    samples every round (τ = 0.2 lets them in), so with ``update="fedavg"`` the search ends
    after ``Tuning.stale_rounds`` rounds in which λ did not change; with ``"gradient"`` a
    growing pool keeps it going to the round cap."""
    u = _fedavg(seed=0, epochs=5, batch_size=None, output_grad=output_grad)
    side = output_side(u.dW, u.db, u.W0, u.b0, update=update, max_seconds=None)
    ctx, cfg = side.ctx, side.cfg
    B, m = side.B, side.dec.L.shape[0]
    Q = torch.eye(B, dtype=torch.float64)
    stuck = match.Match(value=0.99, per_column=torch.full((B,), m), H=Q, s=Q[0], P=Q)

    def grow(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
        q = torch.randn(B, 1, generator=ctx.generator, dtype=torch.float64)
        pool.add(q, torch.tensor([m]))

    def selection(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> Assessment:
        state.match = stuck
        return Assessment(Q=Q, count=B, done=False)

    monkeypatch.setattr(candidates, "spearpp_round", grow)
    monkeypatch.setattr(candidates, "neighbour_search", lambda *a: None)
    monkeypatch.setattr(certify, "assess", selection)
    monkeypatch.setattr(certify, "finish", lambda ctx, state, pool: (Q, B))
    state, pool = SearchState(), CandidatePool(ctx)
    loop.search(ctx, state, pool)
    assert len(pool) == state.rounds  # the situation: every round grew the pool
    if update == "fedavg":
        assert state.rounds == 1 + ctx.tuning.stale_rounds
    else:
        assert state.rounds == cfg.round_cap(B)
