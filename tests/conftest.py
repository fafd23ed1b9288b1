"""Fixtures shared by the attack tests.

* ``one_thread``: one torch thread for a whole test module. A module asks for it with
  ``pytestmark = pytest.mark.usefixtures("one_thread")``.
* ``real_batch``: a real batch (photo crops, MNIST digits) through a fresh ReLU MLP, with the
  gradient of one linear layer, the layer's parameters, its true inputs and its true output
  gradient ∂L/∂Z. Tests use these to build the situation they need from the ground truth.
* ``output_side``: the output side's own context for an update (decomposition, tolerances,
  λ system and search context, built as ``fl_attack.solver.output_side.solve`` builds them). Its
  ``certified`` is the certificate that ``fl_attack.invert`` computes for a basis.
* ``mix``: a basis with one column mixed with another (the wrong column of similar samples).
* ``image_score``: PSNR of reconstructed rows against a batch's images after the optimal
  matching, the papers' score.
* ``promises``: what ``fl_attack.invert`` promises whatever its search found (shape, λ in
  [0, 1], a certificate only for a full λ = 1 basis of exact images).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from fl_attack.config import AttackConfig
from fl_attack.core.clock import Clock
from fl_attack.core.columns import normalize_columns, zero_mask
from fl_attack.result import Reconstruction, certified
from fl_attack.solver import certify, unproven
from fl_attack.solver.pool import CandidatePool
from fl_attack.solver.state import SearchContext, search_context
from fl_attack.steps import match, polish
from fl_attack.steps.decompose import Decomposition, decompose
from fl_attack.steps.scale import LayerSystem, make_system, reconstruct
from fl_attack.steps.tolerances import output_tolerances, rank_floor
from fl_attack.testbed import data, metrics, models
from fl_attack.validation import load_layer


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread while a module runs. The test machines have 2 shared cores, and
    oversubscribed OpenMP threads made the same attack up to 40x slower (0.3 s -> 11 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class RealBatch:
    """A real batch through a ReLU MLP, seen at one of its linear layers."""

    name: str
    """The data set (``fl_attack.testbed.data``)."""
    x: torch.Tensor
    """(B, ...) the images, in [0, 1]."""
    y: torch.Tensor
    """(B,) the labels."""
    model: nn.Module
    layer: int
    """Index into ``models.linear_layers(model)``."""
    G: torch.Tensor
    """(m, n) the layer's weight gradient as a client shares it (float32 unless asked)."""
    g: torch.Tensor
    """(m,) its bias gradient."""
    W: torch.Tensor
    """(m, n) the layer's weight (detached, the model's dtype)."""
    b: torch.Tensor
    """(m,) its bias."""
    X: torch.Tensor
    """(B, n) float64: the layer's true inputs (for layer 0 the normalised, flattened images)."""
    D: torch.Tensor
    """(m, B) float64: the true ∂L/∂Z of the layer, G = D X."""


def compute_output_grad(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                        layer: int = 0) -> torch.Tensor:
    """(m, B) ∂L/∂Z of ``linear_layers(model)[layer]`` for the batch's mean cross-entropy: the
    factor that autograd multiplies with the layer's inputs to form its weight gradient."""
    lin = models.linear_layers(model)[layer]
    outs: list[torch.Tensor] = []
    hook = lin.register_forward_hook(lambda _m, _a, out: outs.append(out))
    try:
        with torch.enable_grad():
            p = next(model.parameters())
            loss = nn.functional.cross_entropy(model(inputs.to(p)), torch.as_tensor(labels))
            (D,) = torch.autograd.grad(loss, outs[0])
    finally:
        hook.remove()
    return D.detach().double().T


def make_real_batch(name: str, B: int, m: int, seed: int, *, layer: int = 0,
                    model: nn.Module | None = None, depth: int = 3,
                    dtype: torch.dtype = torch.float32) -> RealBatch:
    """``data.sample_batch(name, B, seed)`` through ``models.relu_mlp(n, m, depth, seed)`` (or
    ``model``); ``dtype=torch.float64`` runs a float64 copy of the model and gives float64
    gradients."""
    x, y = data.sample_batch(name, B, seed=seed)
    xn = data.normalize(x, name)
    if model is None:
        model = models.relu_mlp(xn[0].numel(), m, depth, seed=seed)
    if dtype == torch.float64:
        model, xn = model.double(), xn.double()
    G, g = models.layer_gradients(model, xn, y, layer=layer, dtype=dtype)
    lin = models.linear_layers(model)[layer]
    X = models.layer_inputs(model, xn, layer=layer).double()
    return RealBatch(name=name, x=x, y=y, model=model, layer=layer, G=G, g=g,
                     W=lin.weight.detach(), b=lin.bias.detach(), X=X,
                     D=compute_output_grad(model, xn, y, layer))


@pytest.fixture(scope="session")
def real_batch() -> Callable[..., RealBatch]:
    """:func:`make_real_batch`: ``real_batch(name, B, m, seed, layer=0, model=None, ...)``."""
    return make_real_batch


@pytest.fixture(scope="session")
def output_grad() -> Callable[..., torch.Tensor]:
    """:func:`compute_output_grad`: ``output_grad(model, inputs, labels, layer=0)``, the
    (m, B) true ∂L/∂Z of a layer."""
    return compute_output_grad


@dataclass
class OutputSide:
    """What the output side of the attack derives from an update before it searches, and the
    certificate it gives a basis."""

    cfg: AttackConfig
    dec: Decomposition
    system: LayerSystem
    ctx: SearchContext

    @property
    def B(self) -> int:
        return self.dec.batch_size

    def basis(self, D: torch.Tensor) -> torch.Tensor:
        """The unit columns (B, B) of the output gradients ``D`` (m, B) in the coordinates of
        L: the true basis when ``D`` is the true ∂L/∂Z (or its FedAvg sum)."""
        return normalize_columns(self.dec.L.T @ D.to(self.dec.L))

    def lam(self, Q: torch.Tensor) -> float:
        """λ of the basis ``Q`` (B, B) (``match.sparsity_match``)."""
        got = match.sparsity_match(Q, self.system)
        assert got is not None, "no weight and bias: no λ"
        return got.value

    def certified(self, Q: torch.Tensor) -> bool:
        """The certificate of a full basis ``Q`` found whole, as
        ``fl_attack.solver.output_side`` gives it (``result.certified``: λ = 1, B directions, no
        noise, and with ``update="fedavg"`` ``certify.supported``)."""
        return certified(self.lam(Q), Q.shape[1], self.B, noisy=self.ctx.noisy,
                         supported=certify.supported(self.ctx, Q))

    def reconstruct(self, Q: torch.Tensor) -> torch.Tensor:
        """(B, n) the inputs of the basis ``Q`` (``scale.reconstruct``)."""
        return reconstruct(Q, self.system)[0]

    def admitted(self, q: torch.Tensor) -> torch.Tensor | None:
        """What the search keeps of a direction ``q`` (B,): rounded to the kernel of its zero
        rows (``polish.polish``) and offered to the pool (``CandidatePool.add``: enough
        zeros, no coincidental zero row). The unit column kept, or None when it is refused."""
        qp, zeros, _, lev = polish.polish(self.dec.L, q.reshape(-1, 1), n_rows=self.ctx.n_rows(),
                                          zero_rtol=self.system.zero_rtol)
        pool = CandidatePool(self.ctx)
        pool.add(qp, zeros, lev)
        return pool.columns[:, 0] if len(pool) else None

    def most_similar(self, Q: torch.Tensor) -> list[int]:
        """For each column of ``Q`` (B, B), the other column sharing most of its zero rows."""
        zero = zero_mask(self.dec.L @ Q, self.system.zero_rtol).double()
        shared = zero.T @ zero
        shared.fill_diagonal_(-1)
        return shared.argmax(dim=1).tolist()


def mixed(Q: torch.Tensor, a: int, b: int, share: float) -> torch.Tensor:
    """The basis ``Q`` with its column a replaced by the unit mixture q_a + share q_b: the
    wrong column a search stalls at when two samples are alike."""
    out = Q.clone()
    out[:, a] = normalize_columns(Q[:, a:a + 1] + share * Q[:, b:b + 1])[:, 0]
    return out


def make_output_side(G: torch.Tensor, g: torch.Tensor, W: torch.Tensor | None = None,
                     b: torch.Tensor | None = None, **options: object) -> OutputSide:
    """The output side's context for the update (G, g) of a layer (W, b), with the attack's
    ``options`` (e.g. ``update="fedavg"``), from the same validation, decomposition and
    tolerances as ``fl_attack.invert``."""
    cfg = AttackConfig.from_options(None, **options)
    layer = load_layer(G, g, W, b, None, "cpu", cfg)
    dec = decompose(layer.weight_grad, batch_size=cfg.batch_size, rank_margin=cfg.rank_margin,
                    floor_rtol=rank_floor(layer.precision), noise_floor=layer.rounding_edge)
    zero_rtol, z_band = output_tolerances(dec, cfg, layer.precision, layer.device)
    system = make_system(dec.L, dec.R, layer.bias_grad, layer.weight, layer.bias, zero_rtol,
                         z_band, subset=cfg.update == "fedavg")
    ctx = search_context(cfg, dec, system, torch.Generator().manual_seed(0), layer.device,
                         Clock(None))
    return OutputSide(cfg=cfg, dec=dec, system=system, ctx=ctx)


@pytest.fixture(scope="session")
def output_side() -> Callable[..., OutputSide]:
    """:func:`make_output_side`: ``output_side(G, g, W, b, **options)``."""
    return make_output_side


@pytest.fixture(scope="session")
def mix() -> Callable[[torch.Tensor, int, int, float], torch.Tensor]:
    """:func:`mixed`: ``mix(Q, a, b, share)``, the basis with column a mixed with column b."""
    return mixed


def score_images(inputs: torch.Tensor, x: torch.Tensor, name: str) -> metrics.MatchedScore:
    """Per-image PSNR of the rows ``inputs`` (normalised, flat) against the images ``x`` of
    data set ``name``, after the optimal matching (``metrics.score_batch``)."""
    images = data.denormalize(inputs.float().reshape(-1, *x.shape[1:]), name)
    return metrics.score_batch(images, x)


@pytest.fixture(scope="session")
def image_score() -> Callable[[torch.Tensor, torch.Tensor, str], metrics.MatchedScore]:
    """:func:`score_images`: ``image_score(inputs, x, name)``."""
    return score_images


def check_promises(rec: Reconstruction, x: torch.Tensor, name: str,
                   exact_db: float | None = 90.0) -> None:
    """What ``fl_attack.invert`` promises whatever its search found, for a batch of images
    ``x`` of data set ``name`` at the attacked layer: a batch of the right shape, finite, λ
    in [0, 1] (or None without weight and bias), chance zeros only at λ = 1, and a
    certificate only for a full λ = 1 basis whose every image is exact (above ``exact_db``,
    90 dB: the papers' "exact"; None where the update's own precision is less and the caller
    checks the certified batch against the true directions' instead); a FedAvg sum's λ at most
    the share of directions found; every row the result
    says was verified on its own is a sample of the batch; and a batch the output side did
    not certify names the rows that keep it unproven (``Reconstruction.unproven``), each once,
    with a known reason, none of them verified, unless samples were merged; with a completed
    direction, every row not verified."""
    B = x.shape[0]
    assert rec.batch_size == B and rec.inputs.shape == (B, x[0].numel()), rec.as_dict()
    assert bool(torch.isfinite(rec.inputs).all())
    lam = rec.sparsity_match
    assert lam is None or 0.0 <= lam <= 1.0
    assert not rec.exact or (lam == 1.0 and rec.n_directions == B), rec.as_dict()
    assert rec.chance_zeros == 0 or lam == 1.0, rec.as_dict()
    if lam is not None and rec.config is not None and rec.config.update == "fedavg":
        assert lam <= rec.n_directions / B, rec.as_dict()  # a completed column is no evidence
    if exact_db is not None:
        worst = float(score_images(rec.inputs, x, name).psnr.min())
        assert not rec.exact or worst > exact_db, (worst, rec.as_dict())
    named = [row for row, _ in rec.unproven]
    assert len(set(named)) == len(named) and all(0 <= r < B for r in named), rec.unproven
    assert all(why in unproven.REASONS for _, why in rec.unproven), rec.unproven
    assert not set(named) & set(rec.verified) and not (rec.exact and named), rec.as_dict()
    if rec.sample_errors is not None and not rec.exact and not rec.merged:
        assert named, rec.as_dict()  # an uncertified batch names what keeps it unproven
    if any(why == "not-found" for _, why in rec.unproven):  # a completed column: no row holds
        assert set(named) | set(rec.verified) == set(range(B)), rec.as_dict()
    if rec.verified:  # each verified row is one of the batch's samples, to 10⁻³
        rows = rec.inputs[list(rec.verified)].double()
        truth = data.normalize(x, name).reshape(B, -1).to(rows)  # the inputs' space
        err = torch.cdist(rows, truth).min(dim=1).values / truth.norm(dim=1).min()
        assert float(err.max()) < 1e-3, (err.max(), rec.as_dict())


@pytest.fixture(scope="session")
def promises() -> Callable[..., None]:
    """:func:`check_promises`: ``promises(rec, x, name, exact_db=90.0)``."""
    return check_promises


@pytest.fixture
def task_identity() -> Iterator[None]:
    """FedAvg creates instruction Messages, which read the (process-wide) task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def world() -> dict[str, object]:
    """A global model and three clients' (nodes 11-13) real FedSGD updates on disjoint MNIST
    batches (``tests.flower_fakes.fedsgd_world``)."""
    from tests.flower_fakes import fedsgd_world

    return fedsgd_world()
