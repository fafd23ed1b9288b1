"""UCI Adult loading, decoding and scoring (fl_attack.testbed.tabular) on the real files."""

from __future__ import annotations

import pytest
import torch

from fl_attack.testbed.tabular import (
    ADULT_FEATURES,
    decode,
    load_adult,
    sample_adult_batch,
    score_tabular,
)


@pytest.fixture(scope="module")
def train():
    return load_adult("train")


def test_load_shapes_and_encoding(train):
    n, d = train.features.shape
    assert n == 30162  # complete rows of adult.data (rows with '?' dropped)
    assert d == len(train.columns) == train.num_features
    assert train.features.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert torch.isfinite(train.features).all()
    assert set(train.labels.unique().tolist()) == {0, 1}
    assert 0.2 < train.labels.float().mean() < 0.3  # ~25% earn > 50K
    assert len(train.continuous) == 6 and len(train.categorical) == 8
    # slices tile the columns; each one-hot block sums to 1; continuous columns standardised
    widths = sum(s.stop - s.start for s in train.slices.values())
    assert widths == d and list(train.slices) == list(ADULT_FEATURES)
    for f, cats in train.categorical.items():
        block = train.features[:, train.slices[f]]
        assert block.shape[1] == len(cats)
        assert torch.equal(block.sum(1), torch.ones(n))
        assert "?" not in cats
    cont = train.features[:, [train.slices[f].start for f in train.continuous]].double()
    torch.testing.assert_close(cont.mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(cont.std(0), torch.ones(6, dtype=torch.float64), atol=1e-3, rtol=0)


def test_test_split_labels_and_shared_encoding(train):
    test = load_adult("test")
    assert test.features.shape == (15060, train.num_features)
    assert test.columns == train.columns  # same encoding for both splits
    assert torch.equal(test.mean, train.mean)
    assert set(test.labels.unique().tolist()) == {0, 1}  # '>50K.' parsed
    with pytest.raises(ValueError, match="split"):
        load_adult("validation")


def test_decode_round_trip_of_a_real_row(train):
    # first row of adult.data:
    # 39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White,
    # Male, 2174, 0, 40, United-States, <=50K
    row = decode(train.features[0], train)
    assert row["workclass"] == "State-gov" and row["education"] == "Bachelors"
    assert row["occupation"] == "Adm-clerical" and row["native-country"] == "United-States"
    assert row["sex"] == "Male" and row["race"] == "White"
    expected = {"age": 39, "fnlwgt": 77516, "education-num": 13, "capital-gain": 2174,
                "capital-loss": 0, "hours-per-week": 40}
    for f, v in expected.items():
        assert row[f] == pytest.approx(v, rel=1e-5, abs=1e-3), f
    assert int(train.labels[0]) == 0
    batch = decode(train.features[:3], train)
    assert batch["age"][0] == row["age"] and len(batch["workclass"]) == 3


def test_score_of_a_permuted_exact_copy_is_perfect(train):
    x, y = sample_adult_batch(16, seed=5)
    assert x.shape == (16, train.num_features) and y.shape == (16,)
    x2, _ = sample_adult_batch(16, seed=5)
    assert torch.equal(x, x2)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    score = score_tabular(x[perm], x, train)
    assert score.discrete_accuracy == 1.0 and score.continuous_mae == 0.0
    assert score.assignment == perm.tolist()
    assert set(score.feature_accuracy) == set(train.categorical)
    assert set(score.feature_mae) == set(train.continuous)
    # a perturbed copy scores worse, with the MAE in original units
    noisy = x[perm].clone()
    noisy[:, train.slices["age"]] += 1.0 / float(train.std[0])  # +1 year
    score = score_tabular(noisy, x, train)
    assert score.feature_mae["age"] == pytest.approx(1.0, rel=1e-4)
    assert score.discrete_accuracy == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        score_tabular(x[:3], x, train)
    with pytest.raises(ValueError, match="non-finite"):
        score_tabular(x * float("nan"), x, train)
