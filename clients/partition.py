"""Split one dataset among federated clients: IID shards or label-skewed Dirichlet shards.

Every client and the server compute the same partition from the same inputs (dataset labels,
number of partitions, seed), so no index list has to be shipped around: a client only needs its
``partition-id``. The audit's ground truth (which samples a client trained on) is still reported
explicitly by the client, because the server must not rely on reproducing the client's sampling.

Both functions return *global* indices into the dataset, sorted within each partition.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PARTITIONINGS: tuple[str, ...] = ("iid", "dirichlet")


def _check_parts(num_samples: int, num_partitions: int) -> None:
    if not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive int, got {num_partitions!r}")
    if num_samples < num_partitions:
        raise ValueError(
            f"cannot split {num_samples} samples into {num_partitions} non-empty partitions"
        )


def iid_partition(num_samples: int, num_partitions: int, *, seed: int = 0) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` with ``seed`` and cut it into near-equal shards.

    Shard sizes differ by at most one. Deterministic given the arguments.
    """
    _check_parts(num_samples, num_partitions)
    perm = np.random.default_rng([seed, 0x11D]).permutation(num_samples)
    return [np.sort(shard).astype(np.int64) for shard in np.array_split(perm, num_partitions)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    num_partitions: int,
    *,
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed (non-IID) shards: each class is split among clients by ``Dir(alpha)``.

    The usual scheme of Hsu et al. (2019): for every class ``c`` draw proportions
    ``p ~ Dir(alpha * 1_K)`` over the ``K`` clients and hand out that class's (shuffled) samples
    in those proportions. Small ``alpha`` gives few classes per client, large ``alpha`` tends to
    IID. Draws are repeated (up to ``max_tries``) until every client holds at least ``min_size``
    samples, so that each can train; a ``ValueError`` says so when that is impossible.
    """
    y = np.asarray(labels).reshape(-1)
    _check_parts(len(y), num_partitions)
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha!r}")
    if min_size * num_partitions > len(y):
        raise ValueError(
            f"{len(y)} samples cannot give {num_partitions} partitions of >= {min_size}"
        )
    rng = np.random.default_rng([seed, 0xD1])
    classes = np.unique(y)
    for _ in range(max_tries):
        shards: list[list[int]] = [[] for _ in range(num_partitions)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(num_partitions, float(alpha)))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for k, part in enumerate(np.split(idx, cuts)):
                shards[k].extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split gave every one of {num_partitions} partitions "
        f">= {min_size} samples in {max_tries} tries; raise alpha or the dataset size"
    )


def partition(
    labels: Sequence[int] | np.ndarray,
    num_partitions: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Dispatch to :func:`iid_partition` or :func:`dirichlet_partition` by ``scheme``."""
    if scheme == "iid":
        return iid_partition(len(np.asarray(labels).reshape(-1)), num_partitions, seed=seed)
    if scheme == "dirichlet":
        return dirichlet_partition(
            labels, num_partitions, alpha=alpha, seed=seed, min_size=min_size
        )
    raise ValueError(f"unknown partitioning {scheme!r}; expected one of {PARTITIONINGS}")


def client_batch(shard: np.ndarray, batch_size: int, *, seed: int, server_round: int,
                 partition_id: int) -> np.ndarray:
    """The samples a client trains on in one round: ``batch_size`` distinct draws from its shard.

    Seeded by ``(seed, server_round, partition_id)`` so a round is reproducible and rounds differ.
    A shard smaller than ``batch_size`` is used whole. Returns global indices (unsorted: the
    order the client feeds them to the model).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng([seed, server_round, partition_id, 0xBA7C])
    take = min(int(batch_size), len(shard))
    return np.asarray(shard)[rng.choice(len(shard), size=take, replace=False)].astype(np.int64)


def eval_split(shard: np.ndarray, eval_size: int, *,
               held_out: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(train pool, evaluation samples)`` of one client's shard.

    The evaluation samples are the shard's first ``eval_size`` (at least one). With
    ``held_out`` they are kept out of the training pool, so that the accuracy the client
    reports is measured on samples the model never trained on; a ``ValueError`` says so when
    that leaves nothing to train on. Without it the pool is the whole shard (the evaluation
    samples are trained on as well).
    """
    shard = np.asarray(shard)
    take = max(1, int(eval_size))
    evaluation = shard[:take]
    if not held_out:
        return shard, evaluation
    if take >= len(shard):
        raise ValueError(f"eval-size {take} leaves none of this shard's {len(shard)} samples "
                         "to train on (eval-held-out)")
    return shard[take:], evaluation
