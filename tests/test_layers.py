"""Other layers (SPEAR §3.2 "input sparsity", §6.2): inverting a layer through its sparse
*inputs*.

A hidden layer of a ReLU MLP sits between two ReLUs: its output gradients ∂L/∂z are sparse (the
ReLU after it, ``sparse="output"``) and so are its inputs x (the ReLU before it,
``sparse="input"``, :mod:`fl_attack.solver.input_side`); ``"auto"`` tries the output side, then the
input side. Everything here runs on real batches (photo crops, MNIST digits) through
:func:`fl_attack.testbed.models.relu_mlp`, and reconstructions are scored against the layer's
true inputs (:func:`fl_attack.testbed.models.layer_inputs`) after matching. "Exact" means a
relative error at the level of float32 rounding of the shared gradient (measured ≤ 4e-5; a
wrong sample is off by 0.1-100), hence the 1e-4 bound.

Each side's certificate is checked on the layer's true directions and beside them (a basis
with one column mixed with another's); ``"auto"``'s choice is checked on constructed side
results. End-to-end attacks assert only what ``fl_attack.invert`` promises whatever its search
finds (:func:`_keeps_promises`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fl_attack
from fl_attack.config import AttackConfig
from fl_attack.core.columns import normalize_columns
from fl_attack.result import certified
from fl_attack.solver import input_side, output_side
from fl_attack.solver.input_side import input_factors, input_match, orient_nonnegative
from fl_attack.steps.decompose import Decomposition, decompose
from fl_attack.steps.scale import LayerSystem
from fl_attack.steps.tolerances import noisy_update, rank_floor, tolerances
from fl_attack.testbed import data, metrics, models
from fl_attack.validation import load_layer

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH = 200
EXACT_RTOL = 1e-4


def _layer_problem(real_batch, name: str, B: int, layer: int, seed: int,
                   model: nn.Module | None = None):
    """A client's FedSGD gradient of ``linear_layers(model)[layer]`` on a real batch (a
    ``relu_mlp`` of width 200 unless ``model`` is given): the shared float32 weight and bias
    gradients, the layer's parameters, its true inputs X (B, n) and output gradients D (m, B),
    float64."""
    return real_batch(name, B, WIDTH, seed, layer=layer, model=model)


def _matched_rel_errors(inputs: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Per true input: ``‖x̂ − x‖ / ‖x‖`` after the optimal assignment (inf if unmatched)."""
    perm = metrics.match(inputs, X)
    R = inputs.double()[perm.clamp_min(0)]
    rel = (R - X).norm(dim=1) / X.norm(dim=1).clamp_min(1e-300)
    rel[perm < 0] = float("inf")
    return rel


def _keeps_promises(rec: fl_attack.Reconstruction, X: torch.Tensor) -> None:
    """What ``invert`` promises whatever its search found, against the layer's true inputs
    ``X``: the batch's shape, finite, λ in [0, 1], and a certificate only for a full λ = 1
    basis whose every input is exact."""
    B = X.shape[0]
    assert rec.batch_size == B and rec.inputs.shape == X.shape, rec.as_dict()
    assert bool(torch.isfinite(rec.inputs).all())
    lam = rec.sparsity_match
    assert lam is not None and 0.0 <= lam <= 1.0
    assert not rec.exact or (lam == 1.0 and rec.n_directions == B), rec.as_dict()
    worst = float(_matched_rel_errors(rec.inputs, X).max())
    assert not rec.exact or worst < EXACT_RTOL, (worst, rec.as_dict())


@dataclass
class InputSide:
    """What the input side derives from an update before it searches
    (``input_side.invert_inputs``), and the certificate it gives a basis."""

    dec: Decomposition
    """Gᵀ = L' R'."""
    system: LayerSystem
    W: torch.Tensor
    b: torch.Tensor

    def basis(self, X: torch.Tensor) -> torch.Tensor:
        """The unit columns (B, B) of the inputs ``X`` (B, n) in the coordinates of L'."""
        return orient_nonnegative(self.dec.L, normalize_columns(self.dec.L.T @ X.T))

    def certified(self, Q: torch.Tensor) -> bool:
        """The input side's certificate of a full basis (``result.certified``: λ = 1, B
        directions, no noise, every input a possible ReLU output)."""
        got = input_match(Q, self.system, self.W, self.b, self.system.t)
        return certified(got.value, Q.shape[1], self.dec.batch_size,
                         noisy=noisy_update(self.dec), nonnegative=bool(got.nonnegative.all()))

    def lam(self, Q: torch.Tensor) -> float:
        return input_match(Q, self.system, self.W, self.b, self.system.t).value

    def inputs(self, Q: torch.Tensor) -> torch.Tensor:
        """(B, n) the inputs of the basis ``Q`` (``input_side.input_factors``)."""
        return input_factors(Q, self.dec.L, self.dec.R, self.system.t)[0]


def _input_side(G: torch.Tensor, g: torch.Tensor, W: torch.Tensor,
                b: torch.Tensor) -> InputSide:
    cfg = AttackConfig(sparse="input")
    layer = load_layer(G, g, W, b, None, "cpu", cfg)
    dec = decompose(layer.weight_grad.T, floor_rtol=rank_floor(layer.precision))
    zero_rtol, z_band = tolerances(dec, cfg, layer.precision)
    t = torch.linalg.lstsq(dec.R.T, layer.bias_grad[:, None]).solution[:, 0]
    system = LayerSystem(L=dec.L, R=dec.R, t=t, WR=None, bias=None, zero_rtol=zero_rtol,
                         weight=None, z_band=z_band)
    assert layer.weight is not None and layer.bias is not None
    return InputSide(dec=dec, system=system, W=layer.weight, b=layer.bias)


def _mix_inputs(side: InputSide, Qt: torch.Tensor, X: torch.Tensor, a: int,
                share: float) -> torch.Tensor:
    """The input basis with column a mixed with the input sharing most of its zero entries."""
    zero = (X == 0).double()
    shared = zero @ zero.T
    shared.fill_diagonal_(-1)
    b = int(shared[a].argmax())
    Q = Qt.clone()
    Q[:, a] = normalize_columns(Qt[:, a:a + 1] + share * Qt[:, b:b + 1])[:, 0]
    return orient_nonnegative(side.dec.L, Q)


def _assert_input_side_sound(t) -> None:
    """On the true inputs of a layer preceded by a ReLU: the input side's certificate holds
    and its inputs are exact; with one input mixed with the one sharing most of its zero
    entries (30%, 1%, 0.1%) it fails, and every other input stays exact (in input mode
    x_i = L' q_i / (q_iᵀ t) depends on its own column only)."""
    side = _input_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.X)
    assert side.certified(Qt)
    X = side.inputs(Qt)
    assert float(_matched_rel_errors(X, t.X).max()) < EXACT_RTOL
    B = t.X.shape[0]
    for a in range(B):
        for share in (0.3, 1e-2, 1e-3):
            Q = _mix_inputs(side, Qt, t.X, a, share)
            assert not side.certified(Q), (a, share)
            others = [j for j in range(B) if j != a]
            rel = (side.inputs(Q)[others] - X[others]).norm(dim=1) / X[others].norm(dim=1)
            assert float(rel.max()) < EXACT_RTOL, (a, share)


def _assert_output_side_sound(t, output_side, mix) -> None:
    """On the true output gradients: the output side's certificate holds and its inputs are
    exact; with one column mixed with the most similar sample's (30%, 1%) it fails."""
    side = output_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.D)
    assert side.certified(Qt)
    assert float(_matched_rel_errors(side.reconstruct(Qt), t.X).max()) < EXACT_RTOL
    partner = side.most_similar(Qt)
    for a in range(Qt.shape[1]):
        for share in (0.3, 1e-2):
            assert not side.certified(mix(Qt, a, partner[a], share)), (a, share)


@pytest.mark.parametrize(("name", "seed"), [("photos32", 1), ("mnist", 0)])
def test_middle_layer_both_sides_certify_the_truth(name: str, seed: int, real_batch,
                                                   output_side, mix) -> None:
    """Layer 2 (between two ReLUs), B = 10: both sides' certificates hold for the layer's
    true directions, which give its inputs exactly, and refuse a basis with a column mixed
    with a similar sample's. Each side's attack, and ``"auto"``, keeps its promises."""
    t = _layer_problem(real_batch, name, 10, 1, seed)
    _assert_output_side_sound(t, output_side, mix)
    _assert_input_side_sound(t)
    for sparse in ("output", "input", "auto"):
        rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed, sparse=sparse)
        assert rec.config is not None and rec.config.sparse in ("output", "input")
        assert sparse == "auto" or rec.config.sparse == sparse
        _keeps_promises(rec, t.X)


@pytest.mark.parametrize(
    ("name", "B", "layer", "seed"),
    [("mnist", 20, 1, 2), ("mnist", 20, 2, 2), ("photos32", 10, 2, 1), ("photos32", 20, 1, 2)],
)
def test_input_side_certifies_layers_2_and_3(name: str, B: int, layer: int, seed: int,
                                             real_batch) -> None:
    """``sparse="input"`` on layers 2 and 3 (indices 1, 2), whose inputs are post-ReLU and
    sparse: the certificate holds for the true inputs, which the input side gives exactly,
    and refuses a basis with one input mixed with a similar one (every other input staying
    exact). The photo crops at B = 20 are the hard case (samples share most of their ReLU
    pattern). The attack keeps its promises."""
    t = _layer_problem(real_batch, name, B, layer, seed)
    assert float((t.X == 0).double().mean()) > 0.3  # the situation: post-ReLU inputs are sparse
    _assert_input_side_sound(t)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed, sparse="input")
    assert rec.config is not None and rec.config.sparse == "input"
    _keeps_promises(rec, t.X)


def test_input_side_photos_b20_certificate_is_sound(real_batch) -> None:
    """Photos, B = 20, layer 2, the first four batches, where a search may find 19 of the 20
    inputs (a sample whose zero set nearly coincides with another's, e.g. 95 of its 100 zeros
    shared) and hold a spurious mixture as the 20th. Built directly on each batch: a basis
    with any one input mixed with the input sharing most of its zeros (30%, 1%, 0.1%) is not
    certified, yet each of the other 19 inputs it gives is exact; the true basis is
    certified and exact."""
    for seed in range(4):
        _assert_input_side_sound(_layer_problem(real_batch, "photos32", 20, 1, seed))


def test_auto_falls_back_to_the_input_side(real_batch) -> None:
    """A narrow layer (200 → 50) at B = 20: several samples have fewer than B − 1 zeros in
    ∂L/∂z, so their output columns never enter the pool (a candidate needs at least B zeros)
    and the output side cannot be certified. ``"auto"`` therefore always attacks the input
    side too, whose certificate holds for the true inputs (sparse enough), and keeps its
    promises."""
    seed, B = 0, 20
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, WIDTH), nn.ReLU(),
                              nn.Linear(WIDTH, 50), nn.ReLU(), nn.Linear(50, 10))
    t = _layer_problem(real_batch, "mnist", B, 1, seed, model=model)
    assert int((t.D == 0).sum(dim=0).min()) < B - 1  # the situation: no output-side column
    _assert_input_side_sound(t)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed, sparse="auto",
                           max_rounds=2)
    assert rec.timings.get("other_side", 0.0) > 0.0  # both sides ran
    _keeps_promises(rec, t.X)


def _candidate(inputs: torch.Tensor, lam: float, exact: bool = False,
               side: str = "output") -> fl_attack.Reconstruction:
    """A side's result as ``"auto"`` sees it (only what the ranking may look at is filled in)."""
    B = inputs.shape[0]
    return fl_attack.Reconstruction(inputs=inputs, batch_size=B, sparsity_match=lam, exact=exact,
                                    n_directions=B, method="spear++", seconds=0.25,
                                    config=AttackConfig(sparse=side))


def test_auto_ranks_the_sides_by_their_inputs_not_their_lambda(real_batch) -> None:
    """``"auto"``'s rule (``both_sides.better_side``) on two constructed results for the same
    real layer (photos, B = 20, layer 2): an "output side" whose every input is a signed mixture
    of the true ones (what a wrong basis gives: X̂ = M X) with the higher λ, and an "input side"
    with 17 of 20 inputs right. Each side's λ comes from its own factorisation, so the rule
    scores both by ``side_score`` on the same footing and must return the input side whatever
    the two λ say; a certified side wins; ties go to the output side."""
    from fl_attack.solver.both_sides import better_side, side_score

    t = _layer_problem(real_batch, "photos32", 20, 1, 0)
    G, X = t.G, t.X
    dec = decompose(G.double(), floor_rtol=1e-6)
    zero_rtol, z_band = tolerances(dec, AttackConfig(), torch.float32)
    gen = torch.Generator().manual_seed(0)
    B = X.shape[0]
    M = torch.eye(B, dtype=X.dtype) + 0.3 * torch.randn(B, B, generator=gen, dtype=X.dtype)
    mixed = M @ X
    partly = X.clone()
    partly[:3] = X[:3] - 0.5 * X[3:6]
    Gd, Wd, bd = G.double(), t.W.double(), t.b.double()
    kw = {"zero_rtol": zero_rtol, "z_band": z_band}
    truth, good, bad = (side_score(Y, Gd, Wd, bd, **kw) for Y in (X, partly, mixed))
    assert truth > good > bad, (truth, good, bad)
    for lam_out, lam_in in ((0.95, 0.80), (0.50, 0.99)):
        out, inp = _candidate(mixed, lam_out), _candidate(partly, lam_in)
        best, other = better_side(out, inp, Gd, Wd, bd, **kw)
        assert best is inp and other is out
    out = _candidate(mixed, 1.0, exact=True)  # a certified side comes first
    assert better_side(out, _candidate(X, 0.9), Gd, Wd, bd, **kw)[0] is out
    out, inp = _candidate(partly, 0.9), _candidate(partly.clone(), 0.99)  # a tie
    assert better_side(out, inp, Gd, Wd, bd, **kw)[0] is out
    # without W and b only the row test (ReLU outputs are non-negative) can rank the sides
    out, inp = _candidate(mixed, 0.95), _candidate(X, 0.8)
    assert better_side(out, inp, Gd, None, None, **kw)[0] is inp


def test_auto_returns_the_side_its_rule_picks(monkeypatch: pytest.MonkeyPatch,
                                              real_batch) -> None:
    """``"auto"`` on a layer between two ReLUs (photos, B = 20, layer 2), with each side's
    result built directly (``output_side.invert_output``, ``input_side.invert_inputs``
    monkeypatched): a certified output side is returned as it is and the input side is not
    run; an uncertified one is followed by the input side, and ``"auto"`` returns exactly
    what ``better_side`` picks of the two, with the other side's time."""
    from fl_attack.solver import both_sides

    t = _layer_problem(real_batch, "photos32", 20, 1, 0)
    wrong = t.X + 0.3 * t.X.roll(1, dims=0)
    outs: list[fl_attack.Reconstruction] = []

    def fake_output(layer, cfg, seed, clock, dec=None):
        outs.append(_candidate(t.X if certify_output else wrong, 1.0 if certify_output else 0.9,
                               exact=certify_output))
        return outs[-1]

    def fake_input(layer, cfg, seed, clock):
        if certify_output:
            raise AssertionError("the input side ran after a certified output side")
        return _candidate(t.X.clone(), 0.95, side="input")

    seen: list[tuple[fl_attack.Reconstruction, ...]] = []
    rule = both_sides.better_side

    def spy(out, inp, *args, **kw):
        best, other = rule(out, inp, *args, **kw)
        seen.append((best, other))
        return best, other

    monkeypatch.setattr(output_side, "invert_output", fake_output)
    monkeypatch.setattr(input_side, "invert_inputs", fake_input)
    monkeypatch.setattr(both_sides, "better_side", spy)
    certify_output = True
    auto = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, sparse="auto")
    assert auto is outs[-1] and auto.exact and not seen
    assert "other_side" not in auto.timings
    certify_output = False
    auto = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, sparse="auto")
    assert len(seen) == 1
    best, other = seen[0]
    assert auto is best and best.config is not None and best.config.sparse == "input"
    assert auto.timings["other_side"] == other.seconds > 0.0


def test_auto_on_a_very_narrow_layer_does_not_crash(real_batch) -> None:
    """A 200 → 30 layer at B = 20: pool columns with fewer than B − 1 zeros reach the output
    side's neighbour search, which must not assume a (B-1)-dim range; ``"auto"`` gets past the
    output side and returns a valid result (the input side's certificate holds for the true
    inputs)."""
    seed, B = 0, 20
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, WIDTH), nn.ReLU(),
                              nn.Linear(WIDTH, 30), nn.ReLU(), nn.Linear(30, 10))
    t = _layer_problem(real_batch, "mnist", B, 1, seed, model=model)
    _assert_input_side_sound(t)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=seed, sparse="auto",
                           max_rounds=2)
    _keeps_promises(rec, t.X)


def test_output_layer_is_never_certified(real_batch) -> None:
    """The logits layer is preceded by a ReLU but not followed by one: the input side's
    true directions still give its inputs exactly (B = 5 < 10 classes), but the ReLU-pattern
    certificate does not apply: λ < 1 for the true inputs, and nothing the attack returns
    is marked exact (module docstring of fl_attack.solver.input_side)."""
    t = _layer_problem(real_batch, "mnist", 5, 3, 1)
    assert t.G.shape == (10, WIDTH)
    side = _input_side(t.G, t.g, t.W, t.b)
    Qt = side.basis(t.X)
    assert float(_matched_rel_errors(side.inputs(Qt), t.X).max()) < EXACT_RTOL
    assert side.lam(Qt) < 1.0 and not side.certified(Qt)
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, sparse="input",
                           max_rounds=2)
    assert not rec.exact
    assert rec.sparsity_match is not None and rec.sparsity_match < 1.0
    assert rec.inputs.shape == t.X.shape


def test_input_side_never_certifies_dense_inputs(real_batch) -> None:
    """Layer 1 sees normalised pixels: signed, dense, not ReLU outputs. The input side's
    certificate needs every input to be a possible ReLU output, so even the true inputs are
    not certified, and the attack never claims an exact result."""
    t = _layer_problem(real_batch, "photos32", 10, 0, 0)
    assert float((t.X < 0).double().mean()) > 0.1  # the situation: signed inputs
    side = _input_side(t.G, t.g, t.W, t.b)
    assert not side.certified(side.basis(t.X))
    rec = fl_attack.invert(t.G, t.g, weight=t.W, bias=t.b, seed=0, sparse="input", max_rounds=1)
    assert not rec.exact
    _keeps_promises(rec, t.X)


def test_bad_input_raises_clear_errors() -> None:
    """B ≥ the layer's width, NaN gradients and an unknown side are rejected with ValueError."""
    x, y = data.sample_batch("mnist", 12, seed=0)
    model = models.relu_mlp(784, 8, 3, seed=0)  # layer 2 is Linear(8, 8): 12 samples > 8
    G, g = models.layer_gradients(model, data.normalize(x, "mnist"), y, layer=1)
    lin = models.linear_layers(model)[1]
    W, b = lin.weight.detach(), lin.bias.detach()
    with pytest.raises(ValueError, match=r"sparse='input'.*B >= min\(m, n\)"):
        fl_attack.invert(G, g, weight=W, bias=b, sparse="input")
    with pytest.raises(ValueError, match=r"B >= min\(m, n\)"):
        fl_attack.invert(G, g, weight=W, bias=b, sparse="auto")
    bad = G.clone()
    bad[3, 5] = float("nan")
    for side in ("input", "auto"):
        with pytest.raises(ValueError, match="non-finite"):
            fl_attack.invert(bad, g, weight=W, bias=b, sparse=side)
    with pytest.raises(ValueError, match="bias_grad"):
        fl_attack.invert(G, g[:-1], weight=W, bias=b, sparse="input")
    with pytest.raises(ValueError, match="unknown sparse"):
        fl_attack.invert(G, g, sparse="inputs")


def test_input_side_lambda_forgives_a_chance_zero_but_not_a_mixture(real_batch) -> None:
    """Input-mode λ (``input_side.pattern_match``) uses the output side's chance-zero rule.

    Layer 2, photos, B = 20, the true inputs and output gradients: λ = 1. With one active
    unit's gradient shrunk below the float32 zero test (what a tiny ∂L/∂y does by chance;
    none of the 80 layer-2..5 batches of the layers benchmark's grid has one below the
    ambiguous band, so it is planted here) λ stays 1 and the entry is reported; with one
    input mixed with its neighbour the ReLU law breaks and nothing is forgiven.
    """
    from fl_attack.solver.input_side import pattern_match

    t = _layer_problem(real_batch, "photos32", 20, 1, 0)
    B = 20
    D, X = t.D.T, t.X  # (B, m) true ∂L/∂z, (B, n) true inputs
    W, b = t.W.double(), t.b.double()
    one = torch.ones(B, dtype=torch.float64)
    kw = {"zero_rtol": 1e-4, "z_band": 1e-5}
    truth = pattern_match(X, D, one, W, b, **kw)
    assert truth.value == 1.0 and truth.chance_zeros == 0
    Z = X @ W.T + b  # (B, m)
    i, j = divmod(int(torch.argmax(torch.where(Z > 0, Z, 0.0))), Z.shape[1])  # surely active
    planted = D.clone()
    planted[i, j] = 1e-8 * D[i].abs().max()
    chance = pattern_match(X, planted, one, W, b, **kw)
    assert chance.value == 1.0 and chance.chance_zeros == 1
    share = (X == 0).double() @ (X == 0).double().T  # inputs sharing most zero entries
    share.fill_diagonal_(-1)
    mixed = X.clone()
    mixed[0] = X[0] + 0.1 * X[int(share[0].argmax())]
    wrong = pattern_match(mixed, planted, one, W, b, **kw)
    assert wrong.value < 1.0 and wrong.chance_zeros == 0
