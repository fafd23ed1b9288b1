"""FedAvg updates (SPEAR App. F, SPEAR++ §5.3): ``W₀ - W_E`` after several local steps,
attacked with ``update="fedavg"``, on real photo batches from the library's simulated client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import fl_attack
from fl_attack import certify, columns, config, loop, match, rounds, updates
from fl_attack.certify import Assessment
from fl_attack.clock import Clock
from fl_attack.decompose import decompose
from fl_attack.pool import CandidatePool
from fl_attack.scale import make_system
from fl_attack.state import SearchContext, SearchState, search_context
from fl_attack.testbed import data, metrics, models, simulate
from fl_attack.tolerances import tolerances


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as in the other attack test files (2 shared cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Every attack below is bounded by its round cap, not by the clock (max_seconds=None), so its
# outcome does not depend on the machine's load.
def _fedavg(seed: int, epochs: int, batch_size: int | None, B: int = 20, m: int = 200,
            lr: float = 0.01, dead: tuple[int, ...] = ()):
    """A FedAvg client update of a real photo batch; the first-layer units in ``dead`` get a
    bias far below any pre-activation, so no sample ever activates them."""
    x, y = data.sample_batch("photos32", B, seed=seed)
    xn = data.normalize(x, "photos32")
    model = models.relu_mlp(xn[0].numel(), m, 3, seed=seed)
    with torch.no_grad():
        for unit in dead:
            models.linear_layers(model)[0].bias[unit] = -1e3
    res = simulate.local_update(model, xn, y, protocol="fedavg", lr=lr, epochs=epochs,
                                batch_size=batch_size, seed=seed)
    dW, db, W0, b0 = updates.weight_update_pair(model.state_dict(), res.state_dict)
    return x, dW, db, W0, b0


def _score(rec: fl_attack.Reconstruction, x: torch.Tensor) -> metrics.MatchedScore:
    images = data.denormalize(rec.inputs.float().reshape(-1, *x.shape[1:]), "photos32")
    return metrics.score_batch(images, x)


def test_subset_match_counts_only_unexplained_zeros() -> None:
    """λ's entry test for FedAvg sums: a zero needs an inactive unit, a non-zero entry always
    matches; the single-step test needs both directions."""
    Z = torch.tensor([[-1.0], [-1.0], [2.0], [2.0]])
    Dzero = torch.tensor([[True], [False], [True], [False]])
    assert match.matches(Z, Dzero).squeeze(1).tolist() == [True, False, False, True]
    assert match.matches(Z, Dzero, subset=True).squeeze(1).tolist() == [True, True, False, True]


def test_five_full_batch_local_steps_are_certified_with_update_fedavg() -> None:
    """E = 5 full-batch steps, B = 20, m = 200: each column's zeros are the units inactive at
    every step, fewer than at W₀, so the single-step λ stays below 1 (0.93-0.99 in fedavg.md)
    even when the images are right; with ``update="fedavg"`` the same update is certified
    (λ = 1) and every sample is exact."""
    x, dW, db, W0, b0 = _fedavg(seed=0, epochs=5, batch_size=None)
    plain = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0, max_rounds=2, max_seconds=None)
    assert not plain.exact
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0, update="fedavg",
                           max_seconds=None)
    assert rec.exact and rec.sparsity_match == 1.0 and rec.batch_size == 20
    assert float(_score(rec, x).psnr.min()) > 90.0


@pytest.mark.parametrize("epochs", [2, 20])
def test_mini_batch_fedavg_still_leaks(epochs: int) -> None:
    """Mini-batches of 5 (4 steps per epoch): a sample's first step is no longer at W₀, so
    certification is not expected, but the batch is still read above 25 dB."""
    x, dW, db, W0, b0 = _fedavg(seed=4, epochs=epochs, batch_size=5)
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0, update="fedavg", max_rounds=2,
                           max_seconds=None)
    assert rec.batch_size == 20
    assert _score(rec, x).mean_psnr > 25.0


def test_a_dead_neuron_does_not_hide_the_batch_size_of_a_small_step_update() -> None:
    """η = 0.001, E = 5, full batch, with one first-layer unit that no sample activates (built
    so: its bias far below zero): its row of W₀ - W_E is exactly zero, and the float32 rounding
    of the weight difference sits only ~10³ below the 20th singular value. The drop to the zero
    singular value must not be read as the end of the signal ("full numerical rank 199"):
    dead rows are left out of the rank estimate, and B = 20 is read off."""
    x, dW, db, W0, b0 = _fedavg(seed=1, epochs=5, batch_size=None, lr=0.001, dead=(7,))
    assert float(dW[7].abs().max()) == 0.0  # the situation: an exactly zero row
    rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=0, update="fedavg", max_rounds=1,
                           max_faces=4, max_seconds=None)
    assert rec.batch_size == 20
    assert _score(rec, x).mean_psnr > 25.0


def _narrow(seed: int, protocol: str, epochs: int = 1, batch_size: int | None = None,
            B: int = 8, m: int = 32):
    """A client update of a narrow first layer (3072 -> m): one model (seed 0) for every
    batch, ``load_images("photos32", B, seed=seed)`` as the client's data."""
    x, y = data.load_images("photos32", B, seed=seed)
    xn = data.normalize(x, "photos32")
    model = models.relu_mlp(xn[0].numel(), m, 3, 10, seed=0)
    res = simulate.local_update(model, xn, y, protocol=protocol, lr=0.01, epochs=epochs,
                                batch_size=batch_size, seed=seed)
    dW, db, W0, b0 = updates.weight_update_pair(model.state_dict(), res.state_dict)
    return x, dW, db, W0, b0


def test_the_fedavg_lambda_passes_mixtures_the_certificate_does_not() -> None:
    """m = 32, B = 8, E = 5 full-batch steps: λ with ``update="fedavg"`` checks only that
    zero rows are inactive units, and a column mixing two samples vanishes exactly where both
    are inactive; its own reconstruction is the first sample, exactly, so the test has little
    to catch on a narrow layer. Built directly from the true columns: the certificate
    (``certify.supported``) stands on the zero rows at the noise level, on which a mixture is
    not the only direction, so it holds for the true basis and fails for every mixture, also
    for those whose λ is 1."""
    x, dW, db, W0, b0 = _narrow(seed=4, protocol="fedavg", epochs=5)
    cfg = config.AttackConfig(update="fedavg")
    dec = decompose(dW, floor_rtol=1e-6)
    assert dec.batch_size == 8
    zero_rtol, z_band = tolerances(dec, cfg, torch.float32)
    system = make_system(dec.L, dec.R, db, W0, b0, zero_rtol, z_band, subset=True)
    ctx = search_context(cfg, dec, system, torch.Generator().manual_seed(0),
                         torch.device("cpu"), Clock(None))
    X = data.normalize(x, "photos32").flatten(1).double()
    Qt = columns.normalize_columns(dec.L.T @ (dW @ X.T @ torch.linalg.inv(X @ X.T)))
    assert certify.supported(ctx, Qt)
    lam_one = 0
    for a in range(8):
        for share in (0.3, 3e-5):  # a mixture, and one that is a true column to 1e-5
            b = (a + 1) % 8
            Q = Qt.clone()
            Q[:, a] = columns.normalize_columns(Qt[:, a:a + 1] + share * Qt[:, b:b + 1])[:, 0]
            got = match.sparsity_match(Q, system)
            lam_one += got is not None and got.value == 1.0
            assert not certify.supported(ctx, Q)
    assert lam_one > 0  # the situation: λ alone cannot tell some of them from the truth


@pytest.mark.parametrize(("protocol", "epochs", "batch_size"),
                         [("fedavg", 2, 4), ("fedavg", 5, None), ("fedsgd", 1, None)])
def test_narrow_layer_certificates_are_exact(protocol: str, epochs: int,
                                             batch_size: int | None) -> None:
    """The certificate's contract on a narrow layer (m = 32, B = 8), where few zero rows per
    column give λ little to check: FedAvg with mini-batches of 4 (2 epochs), five full-batch
    steps, and a FedSGD step attacked as a gradient. For every batch, certified ⇒ every
    sample above 90 dB."""
    update = "gradient" if protocol == "fedsgd" else "fedavg"
    for seed in range(6):
        x, dW, db, W0, b0 = _narrow(seed, protocol, epochs=epochs, batch_size=batch_size)
        rec = fl_attack.invert(dW, db, weight=W0, bias=b0, seed=seed, update=update,
                               max_seconds=None)
        if rec.exact:
            assert float(_score(rec, x).psnr.min()) > 90.0, f"batch {seed}"


@pytest.mark.parametrize("update", ["fedavg", "gradient"])
def test_rounds_that_only_grow_the_pool_end_a_fedavg_search(
        monkeypatch: pytest.MonkeyPatch, update: str) -> None:
    """The stop rule on a stuck full basis, built directly: every round adds a new candidate
    to the pool and the selection keeps λ < 1. A FedAvg pool grows by mixtures of similar
    samples every round (τ = 0.2 lets them in), so with ``update="fedavg"`` the search ends
    after ``Tuning.stale_rounds`` rounds in which λ did not change; with ``"gradient"`` a
    growing pool keeps it going to the round cap."""
    _, dW, db, W0, b0 = _fedavg(seed=0, epochs=5, batch_size=None)
    cfg = config.AttackConfig(update=update, max_seconds=None)
    dec = decompose(dW, floor_rtol=1e-6)
    zero_rtol, z_band = tolerances(dec, cfg, torch.float32)
    system = make_system(dec.L, dec.R, db, W0, b0, zero_rtol, z_band,
                         subset=update == "fedavg")
    ctx = search_context(cfg, dec, system, torch.Generator().manual_seed(0),
                         torch.device("cpu"), Clock(None))
    B, m = dec.batch_size, dec.L.shape[0]
    Q = torch.eye(B, dtype=torch.float64)
    stuck = match.Match(value=0.99, per_column=torch.full((B,), m), H=Q, s=Q[0], P=Q)

    def grow(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> None:
        q = torch.randn(B, 1, generator=ctx.generator, dtype=torch.float64)
        pool.add(q, torch.tensor([m]))

    def selection(ctx: SearchContext, state: SearchState, pool: CandidatePool) -> Assessment:
        state.match = stuck
        return Assessment(Q=Q, count=B, done=False)

    monkeypatch.setattr(rounds, "spearpp_round", grow)
    monkeypatch.setattr(rounds, "neighbour_search", lambda *a: None)
    monkeypatch.setattr(certify, "assess", selection)
    monkeypatch.setattr(certify, "finish", lambda ctx, state, pool: (Q, B))
    state, pool = SearchState(), CandidatePool(ctx)
    loop.search(ctx, state, pool)
    assert len(pool) == state.rounds  # the situation: every round grew the pool
    if update == "fedavg":
        assert state.rounds == 1 + ctx.tuning.stale_rounds
    else:
        assert state.rounds == cfg.round_cap(B)
