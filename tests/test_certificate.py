"""When λ = 1 proves a batch: the certificate on batches holding near-duplicate samples.

λ = 1 with all B directions is necessary, not sufficient. When one sample's inactive units
are all inactive for another too (their ReLU patterns nest), a one-parameter family of
reconstructions of the pair has λ = 1, and the layer's update cannot say which one is the
batch. The certificate therefore also asks every column to be pinned down by its own zero
rows (``certify.pinning``: SPEAR's Theorem 3.3 checked on the reconstruction, robust to
losing any one row). The situations are built directly from real images and the batch's
true ∂L/∂Z, so that they hold on any CPU.
"""

from __future__ import annotations

import pytest
import torch

import fl_attack
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.solver import certify, unproven
from fl_attack.steps import select
from fl_attack.steps.decompose import decompose
from fl_attack.steps.scale import make_system, reconstruct
from fl_attack.steps.tolerances import noise_ratio
from fl_attack.testbed import data, metrics, models, views
from strategies import verdicts
from tests.conftest import RealBatch, compute_output_grad

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch_with(x: torch.Tensor, y: torch.Tensor, model: torch.nn.Module,
                name: str = "photos32") -> RealBatch:
    """The first layer's update of the batch ``x``, ``y`` (images in [0, 1]) through
    ``model``, with its true inputs and ∂L/∂Z."""
    xn = data.normalize(x, name)
    G, g = models.layer_gradients(model, xn, y, layer=0)
    lin = models.linear_layers(model)[0]
    return RealBatch(name=name, x=x, y=y, model=model, layer=0, G=G, g=g,
                     W=lin.weight.detach(), b=lin.bias.detach(),
                     X=models.layer_inputs(model, xn).double(),
                     D=compute_output_grad(model, xn, y))


def _nested_pair(seed: int = 6) -> tuple[RealBatch, torch.Tensor]:
    """B = 20 photo crops through a fresh (3072, 200) MLP, sample 1 a copy of sample 0
    moved across the hyperplane of the unit where sample 0 is least active, halfway to the
    next unit's: sample 1's active units are sample 0's less that one (the patterns nest).
    Returns the batch and the two samples' patterns (2, m)."""
    x, y = data.sample_batch("photos32", 20, seed=seed)
    model = models.relu_mlp(x[0].numel(), 200, 3, seed=seed)
    lin = models.linear_layers(model)[0]
    W, b = lin.weight.detach().double(), lin.bias.detach().double()
    xn = data.normalize(x, "photos32").flatten(1).double()
    z = W @ xn[0] + b
    j = int(torch.where(z > 0, z, torch.full_like(z, float("inf"))).argmin())
    u = -W[j] / W[j].norm()
    rate = W @ u
    flips = -z / rate  # the step along u at which each unit changes sign
    flips[j] = float("inf")
    step = 0.5 * (float(z[j]) / float(W[j].norm()) + float(flips[flips > 0].min()))
    x = x.clone()
    moved = (xn[0] + step * u).float().reshape(1, *x.shape[1:])
    x[1] = data.denormalize(moved, "photos32")[0]
    y = y.clone()
    y[1] = y[0]
    t = _batch_with(x, y, model)
    Z = t.X[:2] @ W.T + b
    return t, Z > 0


def test_a_nested_pair_has_a_family_of_lambda_one_bases_and_no_certificate(
        output_side, image_score) -> None:
    """Sample 1's active units are sample 0's less one. The true basis has λ = 1 and
    reconstructs every image exactly, yet it is not certified: sample 0's column shares
    every zero row with sample 1's, so its kernel there is two-dimensional (not pinned), and
    the pinning names the pair as read only up to a mixture. Moving sample 0's column
    towards sample 1's keeps λ = 1 and moves one reconstructed image: the update cannot tell
    which of them is the batch, and no member of the family is certified."""
    t, active = _nested_pair()
    assert int((active[0] & ~active[1]).sum()) == 1 and not bool((active[1] & ~active[0]).any())
    side = output_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.D)
    assert side.lam(Qt) == 1.0
    assert float(image_score(side.reconstruct(Qt), t.x, "photos32").psnr.min()) > 90.0
    pins = certify.pinning(side.ctx, Qt)
    assert not bool(pins.pinned[0]) and pins.pinned[2:].all()
    assert (0, 1) in pins.groups
    assert not side.certified(Qt)
    other = Qt.clone()
    other[:, 0] = normalize_columns(Qt[:, :1] - 0.05 * Qt[:, 1:2])[:, 0]
    assert side.lam(other) == 1.0 and not side.certified(other)
    moved = side.reconstruct(other)
    truth = side.reconstruct(Qt)
    assert float((moved - truth).norm(dim=1).max() / truth.norm(dim=1).max()) > 1e-4


def test_the_attack_never_certifies_a_nested_pair(promises) -> None:
    """The default attack on the nested pair: whatever its search returns, no certificate,
    and a full λ = 1 result names the samples it read only up to a mixture; the record's
    reason says so in words."""
    t, _ = _nested_pair()
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, max_seconds=60)
    promises(rec, t.x, "photos32")
    assert not rec.exact
    summary = rec.as_dict()
    if rec.sparsity_match == 1.0 and not rec.partial:
        assert rec.mixed and all(len(group) >= 2 for group in rec.mixed)
        status, reason = verdicts.reconstruction_verdict(summary)
        assert status == verdicts.NOT_CERTIFIED and "mixture" in reason


def test_a_mixture_pinned_only_by_the_rows_where_it_cancels_is_not_pinned(
        real_batch, output_side) -> None:
    """Two samples of a real batch sharing most zero rows; their mixture made to vanish
    exactly on one row where both are active (a ratio for a row). It is the kernel of L on
    the shared zero rows and that row, a one-dimensional kernel: pinned by its rows, like a
    sample's column. Without that one row it is not, and the pinning, which asks every
    column to stay pinned without any one of its rows, refuses it; the true columns pass."""
    t = real_batch("photos32", 20, 200, seed=0)
    side = output_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.D)
    assert certify.pinning(side.ctx, Qt).all
    a = side.most_similar(Qt)[0]
    V = side.dec.L @ Qt
    zero = zero_mask(V, side.system.zero_rtol)
    both = torch.nonzero(~zero[:, 0] & ~zero[:, a]).squeeze(1)
    r = int(both[0])
    ratio = float(V[r, 0] / V[r, a])
    Q = Qt.clone()
    Q[:, 0] = normalize_columns(Qt[:, :1] - ratio * Qt[:, a:a + 1])[:, 0]
    rows = zero_mask(side.dec.L @ Q, side.system.zero_rtol)[:, 0]
    sv = torch.linalg.svdvals(side.dec.L[rows])
    assert float(sv[-2]) > 1e3 * float(sv[-1])  # the situation: pinned by its rows
    pins = certify.pinning(side.ctx, Q)
    assert not bool(pins.pinned[0])
    assert float(pins.margins[0]) <= certify.KERNEL_MARGIN


@pytest.mark.parametrize("kind", ["view", "repeat"])
def test_near_duplicates_are_built_from_the_batch(kind: str) -> None:
    """``views.with_near_duplicates``: sample 2i + 1 becomes a view of sample 2i (shifted by
    a pixel, brightness within 2%) or its exact copy, with its label; the rest is kept."""
    x, y = data.sample_batch("photos32", 8, seed=3)
    x2, y2, pairs = views.with_near_duplicates(x, y, pairs=2, kind=kind, seed=1)
    assert pairs == [(0, 1), (2, 3)]
    assert torch.equal(x2[4:], x[4:]) and torch.equal(x2[0], x[0])
    assert int(y2[1]) == int(y2[0]) and int(y2[3]) == int(y2[2])
    diff = float((x2[1] - x2[0]).abs().mean())
    assert diff == 0.0 if kind == "repeat" else 0.0 < diff < 0.1
    assert float(x2.min()) >= 0.0 and float(x2.max()) <= 1.0
    with pytest.raises(ValueError, match="kind"):
        views.with_near_duplicates(x, y, kind="blur")
    with pytest.raises(ValueError, match="pairs"):
        views.with_near_duplicates(x, y, pairs=5)


@pytest.mark.parametrize(("summary", "words"), [
    ({"mixed": [[3, 7]], "noisy": False, "update": "gradient"}, "mixture"),
    ({"mixed": [], "noisy": False, "update": "fedavg"}, "sum of local steps"),
    ({"mixed": [], "noisy": True, "noise_std": 1e-3, "update": "gradient"}, "noise detected"),
    ({"mixed": [], "noisy": False, "update": "gradient"}, "pinned"),
])
def test_a_full_lambda_one_result_without_certificate_says_why(summary: dict,
                                                               words: str) -> None:
    """λ = 1 with all B directions, not certified: the reason names the condition that
    failed (a mixed group, a FedAvg sum, noise, or a column its zero rows do not pin)."""
    result = {"batch_size": 20, "n_directions": 20, "exact": False, "sparsity_match": 1.0,
              **summary}
    status, reason = verdicts.reconstruction_verdict(result)
    assert status == verdicts.NOT_CERTIFIED and reason is not None and words in reason


def test_a_sample_given_twice_is_read_once_and_counted(output_side, image_score) -> None:
    """A clean FedSGD batch of 20 photo crops in which sample 1 repeats sample 0: the update
    has rank 19. Told the batch size (20, as a server reads it from the reply), the attack
    reads the 19 distinct samples where the spectrum ends (the 20th direction is rounding)
    and says one sample is not separated (``merged``), which is then not certified (the
    batch of 20 is not read sample by sample); every one of the 20 images has its
    reconstruction when a reconstruction may stand for both copies."""
    x, y = data.sample_batch("photos32", 20, seed=2)
    x, y, _ = views.with_near_duplicates(x, y, pairs=1, kind="repeat")
    model = models.relu_mlp(x[0].numel(), 200, 3, seed=2)
    t = _batch_with(x, y, model)
    side = output_side(t.G, t.g, t.W, t.b, batch_size=20)
    assert side.B == 19 and side.dec.readings() == (19,)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, batch_size=20,
                           max_seconds=60)
    assert rec.batch_size == 19 and rec.merged == 1 and rec.inputs.shape == (19, 3072)
    assert rec.as_dict()["merged"] == 1 and not rec.exact
    images = data.denormalize(rec.inputs.float().reshape(-1, 3, 32, 32), "photos32")
    assert metrics.score_batch(images, x, shared=True).n_matched == 20


def test_given_a_batch_size_the_noisy_spectrum_reads_fewer_of_both_readings_are_tried() -> None:
    """DP-SGD (clipping 1, noise 0.05 x the clipped gradient's median entry on the mean) of
    20 photo crops holding two overlapping crops of one picture (a third of a pixel apart):
    the pair's second direction sinks into the noise and the spectrum reads 19. Given
    B = 20, the decomposition keeps both readings (19 and 20) instead of forcing 20, and the
    attack returns one of them, saying how many samples it did not separate."""
    from experiments.bench_dp import dp_updates

    x, y = data.sample_batch("photos32", 20, seed=3)
    x, y, _ = views.with_near_duplicates(x, y, pairs=1, seed=3, max_shift=0.3)
    xn = data.normalize(x, "photos32")
    model = models.relu_mlp(3072, 200, 3, seed=3)
    u = dp_updates(model, xn, y, clip=1.0, fracs=[0.05], lr=0.1, delta=1e-5, seed=3,
                   engine="opacus")[0.05]
    free = decompose(u.dw.double(), floor_rtol=1e-6)
    assert free.batch_size < 20  # the situation: the spectrum reads fewer
    given = decompose(u.dw.double(), batch_size=20, floor_rtol=1e-6)
    assert given.readings() == (free.batch_size, 20)
    assert given.at(free.batch_size).L.shape == (200, free.batch_size)
    rec = fl_attack.invert(u.dw, u.db, weight=u.w0, bias=u.b0, seed=0, batch_size=20,
                           max_seconds=20)
    assert rec.batch_size in (free.batch_size, 20) and not rec.exact
    assert rec.batch_size + rec.merged == 20
    assert rec.batch_size_readings == (free.batch_size, 20)


def test_a_near_copy_of_a_column_is_never_proven(real_batch, output_side) -> None:
    """A basis holding a sample's column twice, the second mixed with a little of another
    sample (what swaps produced on a trained model's update, whose weak samples barely move
    a strong column's zeros): the certificate does not prove it, and settling it leaves a
    finite basis."""
    t = real_batch("photos32", 20, 200, seed=0)
    side = output_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.D)
    a = side.most_similar(Qt)[0]
    Q = Qt.clone()
    Q[:, a] = normalize_columns(Qt[:, :1] + 1e-6 * Qt[:, a:a + 1])[:, 0]
    proof = certify.prove(side.ctx, Q)
    assert not proof.pinning.all
    assert bool(torch.isfinite(proof.Q).all())


def test_a_swap_never_puts_a_spare_within_the_tolerance_of_the_others_span() -> None:
    """The best swap by the score is refused when its pivot |a_i| (the spare's coordinate on
    the column it replaces) is below that column's ``min_pivot``: the spare would lie closer
    to the other columns' span than the selection's tolerance (a near-copy of a column)."""
    A = torch.tensor([[1e-5, 0.9], [0.6, 0.3], [0.8, 0.3]], dtype=torch.float64)

    def trial(u, i, a_i, ok, ratio):  # prefers the smallest pivot: a near-copy
        return 1.0 / a_i.abs()[0]

    assert select.best_swap(A, trial, base=0.0, positions=3, chunk=64) == (0, 0)
    chosen = select.best_swap(A, trial, base=0.0, positions=3, chunk=64,
                              min_pivot=torch.full((3,), 1e-3, dtype=torch.float64))
    assert chosen is not None and abs(float(A[chosen[1], chosen[0]])) > 1e-3


def test_one_samples_error_estimate_is_the_updates_noise_ratio() -> None:
    """For one sample the per-sample error estimate is the batch's noise ratio (noise edge over
    the one singular value), the quantity the certificate bounds: the per-sample measure
    generalises it."""
    x, y = data.sample_batch("mnist", 1, seed=4)
    model = models.relu_mlp(784, 200, 3, seed=4)
    G, g = models.first_layer_gradients(model, data.normalize(x, "mnist"), y)
    dec = decompose(G.double(), batch_size=1)
    system = make_system(dec.L, dec.R, g.double(), None, None, 1e-4)
    Q = torch.ones(1, 1, dtype=torch.float64)
    X, s = reconstruct(Q, system)
    err = unproven.sample_errors(dec, Q, s, X)
    assert float(err[0]) == pytest.approx(noise_ratio(dec), rel=1e-9)


def test_the_reasons_name_each_unproven_row_once_with_its_first_failed_condition() -> None:
    """Noise names every row but the verified ones; a FedAvg sum names each row by a failed
    per-sample condition where it has one, else as a sum; otherwise each row gets the
    first condition it fails, in the order not found, rounding, mismatch, mixture, unpinned,
    then "incomplete" while a row not verified had its direction completed, and a row that
    passes them all is not named."""
    errors = torch.tensor([1e-7, 1e-2, 1e-7, 1e-7, 1e-7, 1e-7, 1e-7])
    found = torch.tensor([True, True, True, True, True, False, True])
    pinned = torch.tensor([True, False, False, True, False, False, True])
    per_column = torch.tensor([1.0, 1.0, 1.0, 0.99, 1.0, 1.0, 1.0])
    pinned[0] = False  # row 0 unpinned and outside every group
    got = unproven.reasons(batch_size=7, errors=errors, bound=1e-3, noisy=False, fedavg=False,
                           found=found, pinned=pinned, mixed=((2, 4),), per_column=per_column)
    assert got == ((0, "unpinned"), (1, "rounding"), (2, "mixture"), (3, "mismatch"),
                   (4, "mixture"), (5, "not-found"), (6, "incomplete"))
    # the completed row read on its own through the next layer: the others are judged as usual
    settled = unproven.reasons(batch_size=7, errors=errors, bound=1e-3, noisy=False,
                               fedavg=False, found=found, pinned=pinned, mixed=((2, 4),),
                               per_column=per_column, verified=(5,))
    assert settled == got[:5]
    noisy = unproven.reasons(batch_size=3, errors=None, bound=1e-3, noisy=True, fedavg=False,
                             found=None, pinned=None, mixed=(), per_column=None, verified=(1,))
    assert noisy == ((0, "noise"), (2, "noise"))
    fedavg = unproven.reasons(batch_size=3, errors=torch.tensor([1e-7, 1e-2, 1e-7]), bound=1e-3,
                              noisy=False, fedavg=True, found=None, pinned=None, mixed=(),
                              per_column=None)
    assert fedavg == ((0, "fedavg"), (1, "rounding"), (2, "fedavg"))
    clean = unproven.reasons(batch_size=2, errors=torch.tensor([1e-8, 1e-7]), bound=1e-3,
                             noisy=False, fedavg=False, found=None, pinned=None, mixed=(),
                             per_column=None, weak_spectrum=True)
    assert clean == ((1, "rounding"),)  # the weak spectrum names its most exposed row


def test_the_verdict_names_the_samples_not_proven() -> None:
    """A record whose full λ = 1 batch is not certified says which samples keep it so, by
    reason and row, beside the batch-wide reason."""
    facts = {"batch_size": 4, "n_directions": 4, "exact": False, "sparsity_match": 1.0,
             "noisy": False, "rounding_limited": True, "mixed": [],
             "unproven": [[1, "rounding"], [3, "rounding"]]}
    status, reason = verdicts.reconstruction_verdict(facts)
    assert status == verdicts.NOT_CERTIFIED
    assert "the samples not proven, by row of the reconstruction: 2 held by the update only " \
           "near its noise or float32 rounding (rows 1, 3)" in reason
    facts["unproven"] = [[0, "noise"]]
    assert "not proven" not in verdicts.reconstruction_verdict(facts)[1]
    partial = {"batch_size": 4, "n_directions": 3, "exact": False, "sparsity_match": 1.0,
               "noisy": False, "verified": [0],
               "unproven": [[1, "incomplete"], [2, "not-found"], [3, "incomplete"]]}
    status, reason = verdicts.reconstruction_verdict(partial)
    assert status == verdicts.PARTIAL and "1 sample(s) verified" in reason
    assert "2 found, but read through the completed directions (rows 1, 3)" in reason
    # the plugin (torch-free) words exactly the library's per-sample reasons
    assert verdicts.PER_SAMPLE_UNPROVEN == unproven.PER_SAMPLE <= set(unproven.REASONS)


def test_the_report_frames_the_samples_not_proven() -> None:
    """The pictures of the rows a record names as not proven are framed in orange, in the
    pictures' shown order (the originals' when the ground truth matched them); batch-wide
    reasons frame nothing."""
    import dataclasses

    import numpy as np

    from strategies.output.png import FLAG_RGB, image_grid
    from strategies.results.records import ClientAudit

    images = np.zeros((4, 1, 4, 4))
    record = ClientAudit(server_round=1, node_id=1, status=verdicts.NOT_CERTIFIED,
                          attack={"unproven": [[1, "rounding"], [2, "fedavg"]]},
                          recon_images=images, matching=np.array([3, 2, 1, 0]))
    flags = record.unproven_pictures()
    assert flags is not None and flags.tolist() == [False, False, True, False]
    grid = image_grid(images, flagged=flags, min_side=1)
    orange = (np.asarray(FLAG_RGB) * 255.0 + 0.5).astype(np.uint8)
    assert (grid == orange).all(axis=2).any() and not (grid[:6, :6] == orange).all(axis=2).any()
    noisy = dataclasses.replace(record, attack={"unproven": [[0, "noise"]]})
    assert noisy.unproven_pictures() is None
