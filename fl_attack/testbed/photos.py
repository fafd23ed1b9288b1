"""Real photographs cut into square crops: the image pools of ``testbed.data``'s photo datasets.

Crops are drawn from photographs that ship with ``scikit-image`` and matplotlib, so they load
without network access. A pool is one deterministic sequence of distinct, textured crops per
seed (:class:`_CropPool`); :func:`photo_pool` caches the most recent pools in memory.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GREY_SOURCES", "INK_SOURCES", "PHOTO_SETS", "PHOTO_SOURCES", "photo_pool", "texture"]

#: Real RGB photographs from ``skimage.data`` that load without network access (checked with
#: scikit-image 0.26). ``cat`` is left out (same photo as ``chelsea``), as are the synthetic
#: ``colorwheel`` / ``logo``; ``stereo_motorcycle`` contributes its left view only. A crop's
#: label is its source photo's index in this tuple, modulo 10.
PHOTO_SOURCES: tuple[str, ...] = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "stereo_motorcycle",
)

#: Real greyscale photographs of ``skimage.data`` (no network needed; ``horse``, ``text`` and
#: the microscopy images are left out: silhouettes, print and cells are not photographs).
GREY_SOURCES: tuple[str, ...] = ("camera", "brick", "grass", "gravel", "coins", "moon", "page",
                                 "clock")

#: Greyscale images of ink, cells and a silhouette on a plain ground, used by no other
#: dataset: the printed text, the microscopy cells and the black-and-white horse of
#: ``skimage.data``.
INK_SOURCES: tuple[str, ...] = ("text", "cell", "horse")

#: The source photographs of each crop dataset; ``mpl:`` names matplotlib's sample data.
PHOTO_SETS: dict[str, tuple[str, ...]] = {
    "photos32": PHOTO_SOURCES,
    "photos64": PHOTO_SOURCES,
    "greys32": GREY_SOURCES,
    "hopper32": ("mpl:grace_hopper.jpg",),
    "mixed32": (*PHOTO_SOURCES, *GREY_SOURCES, "mpl:grace_hopper.jpg"),
    "ink28": INK_SOURCES,
}

# Photo-crop generation parameters (see _CropPool).
_MIN_STD = 0.04  # reject crops whose mean per-channel std is below this: sky, black border
_MIN_GRAD = 0.01  # ... or whose mean |finite difference| is below this: smooth, textureless
_DUP_MSE = 1e-3  # two crops closer than this (PSNR > 30 dB) count as duplicates; keep the first


def _read_photo(src: str) -> np.ndarray:
    """One source photograph as an ``(H, W, 3)`` uint8 array (greyscale replicated)."""
    if src.startswith("mpl:"):
        import matplotlib
        import matplotlib.image

        img = matplotlib.image.imread(Path(matplotlib.get_data_path(), "sample_data", src[4:]))
    else:
        import skimage.data

        img = getattr(skimage.data, src)()
        if isinstance(img, tuple):  # stereo_motorcycle -> (left, right, disparity)
            img = img[0]
    img = np.asarray(img)
    if img.dtype == bool:  # a binary image (horse): black and white
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return np.array(img[..., :3], dtype=np.uint8, order="C")  # a writable copy


@functools.lru_cache(maxsize=4)
def _photos(sources: tuple[str, ...]) -> tuple[tuple[Tensor, ...], ...]:
    """Each source photo as a pyramid of float32 ``(3, H, W)`` tensors in [0, 1].

    Level ``l`` is the photo downscaled by ``2**l`` (antialiased); cutting large crops from a
    coarser level keeps resizing cheap without changing the result visibly.
    """
    out = []
    for src in sources:
        img = _read_photo(src)
        level = torch.from_numpy(img).permute(2, 0, 1).float().div_(255.0).contiguous()
        levels = [level]
        while min(level.shape[1:]) >= 256:
            level = F.avg_pool2d(level[None], 2)[0].contiguous()
            levels.append(level)
        out.append(tuple(levels))
    return tuple(out)


def texture(images: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels of ``(..., H, W)`` images, the average of
    the vertical and the horizontal one: how textured they are (crops below ``_MIN_GRAD`` are
    rejected as smooth), as a 0-dim tensor."""
    return 0.5 * (
        (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
        + (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    )


def _textured(crop: Tensor) -> bool:
    """Reject flat crops (black border, sky) and smooth, textureless ones."""
    if crop.flatten(1).std(dim=1).mean() < _MIN_STD:
        return False
    return bool(texture(crop) >= _MIN_GRAD)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one thread: thousands of tiny per-crop ops are >10x slower multithreaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _CropPool:
    """A growing pool of distinct, textured square crops of the source photos (one per seed).

    Each crop picks a photo uniformly (balanced labels), then draws until one is accepted: a
    crop side log-uniform in ``[0.75*S, min(H, W)/2]`` for output side ``S`` (24 px to 150..700
    px depending on the photo for ``S = 32``), a uniform position, resized to ``S x S`` with an
    antialiased bilinear filter. Rejected: flat crops (mean per-channel std < ``_MIN_STD``),
    smooth ones (mean absolute finite difference < ``_MIN_GRAD``) and near-duplicates (MSE <
    ``_DUP_MSE``, i.e. PSNR > 30 dB) of an earlier accepted crop. Acceptance only depends on
    earlier draws, so the pool is one deterministic sequence per seed: asking for more crops
    extends it, and the first ``n`` never change.
    """

    def __init__(self, name: str, side: int, seed: int) -> None:
        self.side = side
        self.sources = PHOTO_SETS[name]
        self.rng = np.random.default_rng([seed, self.side])
        self.images = torch.empty((0, 3, self.side, self.side), dtype=torch.float32)
        self.thumbs = torch.empty((0, 3 * 64), dtype=torch.float32)
        self.labels = torch.empty(0, dtype=torch.int64)
        self.count = 0

    def get(self, size: int) -> tuple[Tensor, Tensor]:
        """The first ``size`` crops and labels (views; callers must not modify them)."""
        if size > self.count:
            with _one_thread():
                self._grow(size)
        return self.images[:size], self.labels[:size]

    def _grow(self, size: int) -> None:
        cap = max(size, 2 * self.images.shape[0])
        if cap > self.images.shape[0]:
            n = self.count
            images = torch.empty((cap, 3, self.side, self.side), dtype=torch.float32)
            thumbs = torch.empty((cap, 3 * 64), dtype=torch.float32)
            labels = torch.empty(cap, dtype=torch.int64)
            images[:n], thumbs[:n], labels[:n] = self.images[:n], self.thumbs[:n], self.labels[:n]
            self.images, self.thumbs, self.labels = images, thumbs, labels
        photos = _photos(self.sources)
        while self.count < size:
            k = int(self.rng.integers(len(photos)))
            crop, thumb = self._draw(photos[k], k)
            self.images[self.count] = crop
            self.thumbs[self.count] = thumb
            self.labels[self.count] = k % 10
            self.count += 1

    def _draw(self, pyramid: tuple[Tensor, ...], k: int) -> tuple[Tensor, Tensor]:
        side, rng, n = self.side, self.rng, self.count
        h, w = pyramid[0].shape[1:]
        min_side = round(0.75 * side)
        log_lo, log_hi = np.log(min_side), np.log(max(min_side, min(h, w) // 2))
        for _ in range(1000):
            s = int(round(np.exp(rng.uniform(log_lo, log_hi))))
            y = int(rng.integers(0, h - s + 1))
            x = int(rng.integers(0, w - s + 1))
            lv = 0  # coarsest pyramid level that still oversamples the output by >= 2x
            while lv + 1 < len(pyramid) and s >> (lv + 1) >= 2 * side:
                lv += 1
            sl = s >> lv
            crop = pyramid[lv][None, :, y >> lv : (y >> lv) + sl, x >> lv : (x >> lv) + sl]
            if sl != side:
                crop = F.interpolate(
                    crop, size=(side, side), mode="bilinear", antialias=True, align_corners=False
                )
            crop = crop[0].clamp_(0.0, 1.0)
            if not _textured(crop):
                continue
            thumb = F.adaptive_avg_pool2d(crop, 8).flatten()  # MSE of 8x8 means <= full MSE
            if n:
                close = ((self.thumbs[:n] - thumb) ** 2).mean(dim=1) < _DUP_MSE
                if close.any():
                    idx = close.nonzero().flatten()
                    if (((self.images[idx] - crop) ** 2).flatten(1).mean(dim=1) < _DUP_MSE).any():
                        continue
            return crop, thumb
        raise RuntimeError(f"no usable crop of {self.sources[k]!r} in 1000 draws")


_POOLS: OrderedDict[tuple[str, int], _CropPool] = OrderedDict()
_POOLS_LOCK = threading.Lock()
_MAX_POOLS = 8


def photo_pool(name: str, side: int, seed: int, size: int) -> tuple[Tensor, Tensor]:
    """First ``size`` ``side x side`` crops of the pool for ``(name, seed)`` and their labels
    (views: callers must not modify them), cached in memory (8 most recent pools)."""
    with _POOLS_LOCK:
        pool = _POOLS.pop((name, seed), None) or _CropPool(name, side, seed)
        _POOLS[(name, seed)] = pool
        while len(_POOLS) > _MAX_POOLS:
            _POOLS.popitem(last=False)
        return pool.get(size)
