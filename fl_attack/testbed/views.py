"""Near-duplicate samples as real client batches hold them: augmented views of one image and
repeated samples.

Real batches hold near-duplicates: two augmented views of one picture, consecutive video
frames, bursts of photos of one scene, repeated records. Their ReLU patterns at a layer differ
on a few units or none, which is where an exact attack's uniqueness argument is thinnest
(``docs/algorithm.md``, "The certificate"). These helpers put such pairs into a batch of real
images, so that benchmarks and tests measure the attack on them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["KINDS", "shifted_view", "with_near_duplicates"]

#: The kinds of near-duplicate :func:`with_near_duplicates` makes.
KINDS = ("view", "repeat")


def shifted_view(image: Tensor, dy: float, dx: float, gain: float) -> Tensor:
    """Another view of ``image`` (C, H, W) in [0, 1]: the same picture cut ``dy``, ``dx``
    pixels further (fractions of a pixel by bilinear interpolation; at the border the edge
    row or column repeats, as a crop of a larger photo would show its neighbours) and its
    brightness scaled by ``gain``, clipped to [0, 1]."""
    if image.ndim != 3:
        raise ValueError(f"image must be (C, H, W), got shape {tuple(image.shape)}")
    h, w = image.shape[1:]
    if abs(dy) >= h - 1 or abs(dx) >= w - 1:
        raise ValueError(f"shift ({dy}, {dx}) does not fit an image of {h}x{w}")
    out = _shift(_shift(image, dy, 1), dx, 2)
    return (out * gain).clamp(0.0, 1.0)


def _shift(image: Tensor, by: float, dim: int) -> Tensor:
    """``image`` moved by ``by`` pixels along ``dim``, linearly interpolated, edges repeated."""
    n = image.shape[dim]
    pos = torch.arange(n, dtype=torch.float64) + by
    lo = pos.floor().clamp(0, n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    t = (pos - pos.floor()).clamp(0.0, 1.0).to(image.dtype)
    t = t.reshape([-1 if d == dim else 1 for d in range(image.ndim)])
    return image.index_select(dim, lo) * (1 - t) + image.index_select(dim, hi) * t


def with_near_duplicates(x: Tensor, y: Tensor, *, pairs: int = 1, kind: str = "view",
                         seed: int = 0, max_shift: float = 0.5,
                         max_gain: float = 0.02) -> tuple[Tensor, Tensor, list[tuple[int, int]]]:
    """A copy of the batch ``x`` (B, C, H, W), ``y`` (B,) in which ``pairs`` samples are
    replaced by near-duplicates of others.

    Sample ``2 i + 1`` becomes a near-duplicate of sample ``2 i`` (same label): with
    ``kind="view"`` a :func:`shifted_view` by up to ``max_shift`` pixels along each axis
    (uniform, so fractions of a pixel: overlapping crops of one photograph) with a gain in
    ``1 ± max_gain``; with ``kind="repeat"`` an exact copy.

    Returns
    -------
    (x, y, pairs)
        The new batch, its labels, and the (original, duplicate) index pairs.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if x.ndim != 4 or y.shape != (x.shape[0],):
        raise ValueError(f"x must be (B, C, H, W) and y (B,), got {tuple(x.shape)}, "
                         f"{tuple(y.shape)}")
    if not 0 <= pairs <= x.shape[0] // 2:
        raise ValueError(f"pairs must be in [0, {x.shape[0] // 2}], got {pairs}")
    if not max_shift > 0 and kind == "view":
        raise ValueError(f"max_shift must be > 0 for views, got {max_shift}")
    rng = np.random.default_rng([seed, 0xD0B])
    x, y = x.clone(), y.clone()
    made = []
    for i in range(pairs):
        a, b = 2 * i, 2 * i + 1
        if kind == "repeat":
            x[b] = x[a]
        else:
            dy, dx = (float(v) for v in rng.uniform(-max_shift, max_shift, size=2))
            gain = float(rng.uniform(1.0 - max_gain, 1.0 + max_gain))
            x[b] = shifted_view(x[a], dy, dx, gain)
        y[b] = y[a]
        made.append((a, b))
    return x, y, made
