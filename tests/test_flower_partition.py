"""IID and Dirichlet (non-IID) partitions of a dataset among clients."""

from __future__ import annotations

import numpy as np
import pytest

from fl_attack_flwr.clients.partition import (
    client_batch,
    dirichlet_partition,
    iid_partition,
    partition,
)


def _check_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n  # disjoint and complete
    assert allidx.min() == 0 and allidx.max() == n - 1


def test_iid_is_balanced_disjoint_and_deterministic() -> None:
    parts = iid_partition(103, 4, seed=7)
    _check_cover(parts, 103)
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    again = iid_partition(103, 4, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = iid_partition(103, 4, seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_skews_labels_and_keeps_every_client_nonempty() -> None:
    labels = np.repeat(np.arange(10), 50)
    skewed = dirichlet_partition(labels, 5, alpha=0.1, seed=0, min_size=5)
    _check_cover(skewed, 500)
    assert min(len(p) for p in skewed) >= 5
    iid = iid_partition(500, 5, seed=0)

    def dominant_share(parts: list[np.ndarray]) -> float:
        return float(np.mean([np.bincount(labels[p], minlength=10).max() / len(p)
                              for p in parts]))

    # small alpha: a client's most common class dominates; IID: about 1/10 of each
    assert dominant_share(skewed) > 0.4 > 0.2 > dominant_share(iid)
    again = dirichlet_partition(labels, 5, alpha=0.1, seed=0, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again, strict=True))


def test_partition_dispatch_and_errors() -> None:
    labels = np.arange(20) % 2
    assert len(partition(labels, 3, scheme="iid")) == 3
    assert len(partition(labels, 3, scheme="dirichlet", alpha=1.0)) == 3
    with pytest.raises(ValueError, match="partitioning"):
        partition(labels, 3, scheme="shards")
    with pytest.raises(ValueError):
        iid_partition(2, 3)
    with pytest.raises(ValueError):
        dirichlet_partition(labels, 2, alpha=0.0)
    with pytest.raises(ValueError):
        dirichlet_partition(labels, 5, alpha=1.0, min_size=5)


def test_client_batch_draws_distinct_samples_of_its_shard() -> None:
    shard = np.arange(100, 140)
    b1 = client_batch(shard, 8, seed=0, server_round=1, partition_id=2)
    assert len(b1) == 8 and len(set(b1.tolist())) == 8 and set(b1) <= set(shard)
    assert np.array_equal(b1, client_batch(shard, 8, seed=0, server_round=1, partition_id=2))
    b2 = client_batch(shard, 8, seed=0, server_round=2, partition_id=2)
    assert not np.array_equal(b1, b2)  # a new batch each round
    assert len(client_batch(shard[:5], 8, seed=0, server_round=1, partition_id=0)) == 5
