"""SPEAR(++) on the real UCI Adult table (issue #3 item 5): exact recovery of tabular rows.

SPEAR's tabular experiment: a batch of B = 16 Adult rows, the first layer of a 6-layer ReLU MLP of
width 200 (5 hidden layers + the output layer), FedSGD. The paper reports 100% discrete accuracy
and a continuous MAE of 20.4 (original units). An exact attack must do better on the continuous
features: the only error left is float32 rounding of the shared gradient (~1e-5 relative), i.e.
about 1e-5 standard deviations per value — well under a unit of any feature.

The rows come from the real ``adult.data`` file; nothing here is synthetic or hard-coded: the
scores are computed from the attack's output against the client's true batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import fl_attack
from fl_attack.testbed import models, tabular

B = 16
WIDTH = 200
HIDDEN = 5  # SPEAR's "6-layer MLP": 5 hidden Linear+ReLU layers and the output layer
# Success must not hinge on the wall clock of a shared CI machine: the search is bounded by its
# deterministic caps (SPEAR++ max_rounds, SPEAR max_samples); this is only a safety net.
BUDGET_S = 120.0


@pytest.fixture(scope="module")
def adult() -> tabular.AdultData:
    return tabular.load_adult("train")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run torch on one thread: on an oversubscribed 2-core machine two OpenMP threads made the
    same attack up to 40x slower (0.3 s -> 11 s), one thread keeps this file at ~20 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _attack(adult: tabular.AdultData, seed: int, method: str
            ) -> tuple[fl_attack.Reconstruction, torch.Tensor]:
    """A client's FedSGD gradient of the first layer on a real Adult batch, inverted."""
    x, y = tabular.sample_adult_batch(B, seed=seed)
    model = models.relu_mlp(adult.num_features, WIDTH, HIDDEN, num_classes=2, seed=seed)
    G, g = models.first_layer_gradients(model, x, y)
    lin = models.linear_layers(model)[0]
    rec = fl_attack.invert(G, g, weight=lin.weight.detach(), bias=lin.bias.detach(),
                           method=method, seed=seed, max_seconds=BUDGET_S)
    return rec, x


@pytest.mark.parametrize(("method", "seed"), [("spear++", 1), ("spear++", 2), ("spear++", 4),
                                              ("spear", 4)])
def test_adult_batch_is_recovered_exactly(adult: tabular.AdultData, method: str,
                                          seed: int) -> None:
    rec, x = _attack(adult, seed, method)
    assert rec.batch_size == B and rec.n_directions == B
    assert rec.inputs.shape == (B, adult.num_features)
    score = tabular.score_tabular(rec.inputs.float(), x, adult)
    # issue #3 target: >= 99% of the (row, categorical feature) pairs decoded right
    assert score.discrete_accuracy >= 0.99, score.feature_accuracy
    # exact recovery: the error is float32 rounding of the gradient, far below SPEAR's 20.4
    assert score.continuous_mae < 1.0, score.feature_mae
    for k, f in enumerate(adult.continuous):  # every feature within 1e-3 of its std
        assert score.feature_mae[f] < 1e-3 * float(adult.std[k]), (f, score.feature_mae[f])
    # the encoded rows themselves, one-hot blocks included, match to float32 precision
    matched = x[torch.tensor(score.assignment)].double()
    assert float((rec.inputs - matched).abs().max()) < 1e-3
    assert rec.exact and rec.sparsity_match == 1.0  # self-certified without ground truth


def test_scores_detect_a_wrong_reconstruction(adult: tabular.AdultData) -> None:
    """The metrics above can fail: a reconstruction of another batch scores far below target."""
    x, _ = tabular.sample_adult_batch(B, seed=1)
    other, _ = tabular.sample_adult_batch(B, seed=2)
    score = tabular.score_tabular(other, x, adult)
    assert score.discrete_accuracy < 0.99
    assert score.continuous_mae > 1.0
