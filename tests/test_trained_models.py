"""The attack on models that have trained: the situations training creates, built directly
from a ReLU MLP trained a few hundred SGD steps on real MNIST digits.

A trained model's ∂L/∂Z columns keep fewer zeros than the papers' threshold asks (units
active for every sample), and its confidently classified samples contribute gradients orders
of magnitude below the others, down to the float32 rounding of the update. The attack's
contract there: the relaxed second pass admits the true columns, a clean gradient whose
weakest samples sit at the rounding is searched as clean and never certified, and whatever
the search finds, ``invert`` keeps its promises.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fl_attack
from fl_attack.core.columns import ColumnNoiseRtol, zero_mask
from fl_attack.solver import certify
from fl_attack.solver.state import relaxed
from fl_attack.steps import filtering
from fl_attack.steps.decompose import decompose
from fl_attack.steps.tolerances import (
    exact_possible,
    noisy_update,
    rounding_edge,
    rounding_limited,
)
from fl_attack.testbed import data, models
from tests.conftest import RealBatch, compute_output_grad

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mnist_model() -> dict[int, dict[str, torch.Tensor]]:
    """A (784, 200, 200, 200, 10) ReLU MLP's weights after 0, 300 and 1500 SGD steps
    (batches of 64, lr 0.05) on 3,000 MNIST digits."""
    x, y = data.load_images("mnist", 3000, seed=0)
    xn = data.normalize(x, "mnist")
    model = models.relu_mlp(784, 200, 3, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    states, done = {}, 0
    for K in (0, 300, 1500):
        for _ in range(done, K):
            idx = torch.randint(0, 3000, (64,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xn[idx]), y[idx]).backward()
            opt.step()
        done = K
        states[K] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def _batch(states: dict, K: int, seed: int = 0, B: int = 20) -> RealBatch:
    """A fresh batch of digits (not trained on) through the model trained K steps."""
    model = models.relu_mlp(784, 200, 3)
    model.load_state_dict(states[K])
    x, y = data.load_images("mnist", 3000 + (seed + 1) * B, seed=0)
    x, y = x[-B:], y[-B:]
    xn = data.normalize(x, "mnist")
    G, g = models.first_layer_gradients(model, xn, y)
    lin = models.linear_layers(model)[0]
    return RealBatch(name="mnist", x=x, y=y, model=model, layer=0, G=G, g=g,
                     W=lin.weight.detach(), b=lin.bias.detach(),
                     X=models.layer_inputs(model, xn).double(),
                     D=compute_output_grad(model, xn, y))


def test_a_trained_models_columns_pass_only_the_relaxed_threshold(mnist_model, output_side,
                                                                  image_score,
                                                                  promises) -> None:
    """After 300 steps some of the batch's true columns keep fewer zeros than the papers'
    threshold (each unit inactive with probability 1/2) but more than the second pass's; the
    true basis has λ = 1, every column pinned, and is exact; the attack keeps its promises."""
    t = _batch(mnist_model, 300, seed=1)
    side = output_side(t.G, t.g, t.W, t.b)
    zeros = (t.D == 0).sum(dim=0)
    papers = filtering.min_zero_count(200, side.cfg.p_false_reject)
    assert side.ctx.min_zeros == papers and int(zeros.min()) < papers  # the situation
    low = relaxed(side.ctx)
    assert low is not None and low.min_zeros <= int(zeros.min())
    assert low.cfg.first_slice(200, noisy=False)
    Qt = side.basis(t.D)
    assert side.lam(Qt) == 1.0  # the situation
    assert certify.pinning(side.ctx, Qt).all and side.certified(Qt)
    assert float(image_score(side.reconstruct(Qt), t.x, "mnist").psnr.min()) > 90.0
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_seconds=60)
    promises(rec, t.x, "mnist")


def test_samples_at_or_below_the_rounding_are_counted_and_never_certified(mnist_model) -> None:
    """After 1,500 steps the batch's per-sample gradients spread over more than six orders of
    magnitude: the weakest samples sit at or below the float32 rounding of the update, which
    then holds fewer than 20 samples. The spectrum ends at the rounding floor right after the
    ones it holds (rounding-limited: searched as clean, not noisy). Given the batch size, the
    attack says how many samples the update did not separate and certifies nothing."""
    t = _batch(mnist_model, 1500, seed=2)
    contrib = t.D.norm(dim=0) * t.X.norm(dim=1)
    dec = decompose(t.G.double(), floor_rtol=1e-6)
    assert float(contrib.max() / contrib.min()) > 1e6 and dec.batch_size < 20  # the situation
    assert not exact_possible(dec) and rounding_limited(dec) and not noisy_update(dec)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_seconds=20,
                           batch_size=20)
    assert rec.batch_size + rec.merged == 20 and rec.merged > 0
    assert not rec.exact and not rec.noisy and rec.inputs.shape == (rec.batch_size, 784)
    assert bool(torch.isfinite(rec.inputs).all())


def test_each_columns_zero_test_follows_the_noise_on_it(mnist_model, output_side) -> None:
    """After 1,500 steps the update holds samples 10⁴ times weaker than its strongest, so the
    batch-wide zero test must be loose enough for their columns, known only to the rounding;
    the strongest column's small non-zero entries fall below it, and polishing would force
    them to zero (a mixture passing as that sample's column). The search's zero test is per
    column, from the noise on L q: it gives the strongest true column exactly its true zeros,
    and keeps the batch-wide test for a column as noisy as the weakest."""
    t = _batch(mnist_model, 1500, seed=2)
    side = output_side(t.G, t.g, t.W, t.b)
    rtol = side.system.zero_rtol
    assert isinstance(rtol, ColumnNoiseRtol)
    L = side.dec.L.double()
    contrib = t.D.norm(dim=0) * t.X.norm(dim=1)
    d = t.D[:, int(contrib.argmax())]
    V = L @ (L.T @ d)[:, None]
    assert bool((zero_mask(V, float(rtol))[:, 0] & (d != 0)).any())  # the situation
    assert torch.equal(zero_mask(V, rtol)[:, 0], d == 0)
    weakest = L[:, -1:]  # the least singular direction: the noise the loose test is set for
    assert torch.equal(zero_mask(weakest, rtol), zero_mask(weakest, float(rtol)))
    assert type(rtol * 1e-2) is float  # derived tolerances stay batch-wide


def _stored_step(t: RealBatch, lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first layer's weight and bias after one SGD step stored in float32, as a client
    sends them back, and the rounding that storing added to the weight."""
    exact = t.W.double() - lr * t.G.double()
    stored = exact.float()
    return stored, (t.b - lr * t.g).float(), stored.double() - exact


def test_the_stored_weights_rounding_is_never_read_as_samples(mnist_model) -> None:
    """After 1,500 steps a step at lr 0.001 changes the weights by less than their float32
    spacing in many entries: the update W₀ - W_E carries the weights' rounding, a full-rank
    bulk far above the update's own precision, which the spectrum alone reads as almost 200
    samples. Told that the weights are stored in float32, the attack reads no singular value
    within ``rank_margin`` x the rounding's estimated size as a sample, and never more samples
    than the batch holds."""
    t = _batch(mnist_model, 1500, seed=2)
    w_e, b_e, rounding = _stored_step(t, 1e-3)
    update = t.W.double() - w_e.double()  # as ``weight_update_pair`` forms it
    assert decompose(update, floor_rtol=1e-6).batch_size > 20  # the situation
    edge = rounding_edge(t.W, update, "float32")
    assert 0.1 * edge < float(torch.linalg.matrix_norm(rounding, 2)) < 1.5 * edge
    dec = decompose(update, floor_rtol=1e-6, noise_floor=edge)
    S = dec.singular_values
    assert dec.batch_size <= 20 and float(S[dec.batch_size - 1]) > 2.0 * edge
    rec = fl_attack.invert(update, t.b.double() - b_e.double(), weight=t.W, bias=t.b,
                           weights_dtype="float32", seed=0, max_seconds=10)
    assert rec.batch_size <= 20 and not rec.exact


def test_a_fedavg_sums_rounding_spike_is_not_a_sample_nor_noise(mnist_model) -> None:
    """A FedAvg weight difference (5 full-batch local steps at lr 0.01) of the model after 300
    steps, stored in float32: the sum of B = 20 samples' steps has rank 20, but storing W_E
    swallows update entries whole, so the rounding has a component along the update that
    stands more than ``rank_margin`` estimates out of its bulk. Read with the weights' dtype,
    no value within ``decompose.ROUNDING_MARGIN`` estimates of the rounding is a sample, and
    the update is searched as clean and rounding-limited, not as a noisy one."""
    from fl_attack.model import updates
    from fl_attack.steps.decompose import ROUNDING_MARGIN
    from fl_attack.testbed import simulate

    t = _batch(mnist_model, 300, seed=1)
    xn = data.normalize(t.x, "mnist")
    res = simulate.local_update(t.model, xn, t.y, protocol="fedavg", lr=0.01, epochs=5, seed=0)
    update, _, _, _ = updates.weight_update_pair(t.model.state_dict(), res.state_dict)
    edge = rounding_edge(t.W, update, "float32")
    S = torch.linalg.svdvals(update.double())
    assert 2.0 * edge < float(S[20]) < ROUNDING_MARGIN * edge < float(S[19])  # the situation
    dec = decompose(update, noise_floor=edge)
    assert dec.batch_size == 20
    assert rounding_limited(dec) and not noisy_update(dec)
    assert dec.at(20).rounding_floor == dec.rounding_floor == ROUNDING_MARGIN * edge


def test_an_audit_reads_a_float32_replys_rounding_as_rounding(mnist_model,
                                                              task_identity: None) -> None:
    """The Flower audit knows the dtype a reply's weights come in: it passes it on, so a
    trained model's tiny step is read at the samples it holds, never as the spectrum of its
    rounding (then the audit would have to fall back on ``num-examples``)."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fl_attack_flwr import AttackSettings, AuditingStrategy, verdicts
    from tests.flower_fakes import FakeGrid, content, fedavg, reply

    t = _batch(mnist_model, 1500, seed=2)
    w_e, b_e, _ = _stored_step(t, 1e-3)
    before = {k: v.clone() for k, v in mnist_model[1500].items()}
    after = {**before, "1.weight": w_e, "1.bias": b_e}
    audited = AuditingStrategy(fedavg(), attack=AttackSettings(executor="inline",
                                                               max_seconds=10.0),
                               protocol="fedsgd")
    list(audited.configure_train(1, ArrayRecord(before), ConfigRecord(), FakeGrid([11])))
    audited.aggregate_train(1, [reply(11, content(after, 0, num=20))])
    audited.close()
    (record,) = audited.records
    said = " ".join(filter(None, (record.reason, record.error)))
    assert record.status in verdicts.RECONSTRUCTED, (record.status, said)
    assert record.batch_size <= 20 and "attacked at B =" not in said


def test_a_pass_at_the_round_cap_that_gained_is_followed_by_another(mnist_model, output_side,
                                                                    monkeypatch) -> None:
    """Under a time budget, the relaxed passes go on while each ends at the round cap with
    more columns than the one before, and stop at the first that gains nothing; without a
    budget, or with an explicit ``max_rounds``, there is one relaxed pass. Built directly:
    the passes' outcomes are scripted (``loop.search`` replaced), the context is a trained
    model's, whose relaxed threshold exists."""
    import dataclasses

    from fl_attack.core.clock import Clock
    from fl_attack.solver import output_side as output_side_module
    from fl_attack.solver.pool import CandidatePool
    from fl_attack.solver.state import SearchState

    t = _batch(mnist_model, 300, seed=1)
    side = output_side(t.G, t.g, t.W, t.b)
    assert relaxed(side.ctx) is not None  # the situation: a second pass exists
    B = side.B

    def run(found: list[int], clock: Clock, max_rounds: int | None = None) -> list[int]:
        script, calls = iter(found), []

        def search(ctx, state, pool):
            calls.append(ctx.min_zeros)
            state.stopped = "rounds"
            return torch.eye(B, dtype=torch.float64), next(script)

        monkeypatch.setattr(output_side_module.loop, "search", search)
        cfg = dataclasses.replace(side.ctx.cfg, max_rounds=max_rounds)
        ctx = dataclasses.replace(side.ctx, clock=clock, cfg=cfg)
        output_side_module._search(ctx, SearchState(), CandidatePool(ctx))
        return calls

    first, low = side.ctx.min_zeros, relaxed(side.ctx).min_zeros
    # gains 10, then 5, then nothing: the first pass, three relaxed, stop
    assert run([B - 20, B - 10, B - 5, B - 5, B - 1], Clock(600.0)) == [first] + [low] * 3
    assert run([B - 20, B - 10, B - 5], Clock(None)) == [first, low]
    assert run([B - 20, B - 10, B - 5], Clock(600.0), max_rounds=50) == [first, low]
    assert run([B - 20, B - 20, B - 1], Clock(600.0)) == [first, low]  # nothing gained


def test_a_fedavg_sums_zero_test_is_per_column_too(mnist_model, output_side) -> None:
    """A FedAvg weight difference (5 full-batch local steps at lr 0.01, stored in float32) of
    the model after 1,500 steps holds samples orders of magnitude apart, as a gradient does.
    Each column sums its sample's ∂L/∂Z over the steps, zero exactly at the units inactive at
    every step; the batch-wide test, loose enough for the weakest columns, takes small entries
    of the strongest for zeros (a mixture with a weak column then passes as sparse). The
    per-column test gives the strongest column exactly its zeros."""
    from fl_attack.model import updates
    from fl_attack.testbed import simulate

    t = _batch(mnist_model, 1500, seed=2)
    xn = data.normalize(t.x, "mnist")
    res = simulate.local_update(t.model, xn, t.y, protocol="fedavg", lr=0.01, epochs=5, seed=0)
    dw, db, _, _ = updates.weight_update_pair(t.model.state_dict(), res.state_dict)
    replay = models.relu_mlp(784, 200, 3)
    replay.load_state_dict(t.model.state_dict())
    replay = replay.double()
    opt = torch.optim.SGD(replay.parameters(), lr=0.01)
    D = torch.zeros(200, t.x.shape[0], dtype=torch.float64)
    for _ in range(5):  # the client's steps again in float64: Σ_t lr ∂L/∂Z_t per sample
        D += 0.01 * compute_output_grad(replay, xn.double(), t.y)
        opt.zero_grad()
        nn.functional.cross_entropy(replay(xn.double()), t.y).backward()
        opt.step()
    side = output_side(dw, db, t.W, t.b, update="fedavg", weights_dtype="float32")
    rtol = side.system.zero_rtol
    assert isinstance(rtol, ColumnNoiseRtol)
    L = side.dec.L.double()
    contrib = D.norm(dim=0) * t.X.norm(dim=1)
    d = D[:, int(contrib.argmax())]
    V = L @ (L.T @ d)[:, None]
    assert bool((zero_mask(V, float(rtol))[:, 0] & (d != 0)).any())  # the situation
    assert torch.equal(zero_mask(V, rtol)[:, 0], d == 0)
