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


def shifted_view(image: Tensor, dy: int, dx: int, gain: float) -> Tensor:
    """Another view of ``image`` (C, H, W) in [0, 1]: the same picture cut ``dy``, ``dx``
    pixels further (the edge row or column repeated, as a crop of a larger photo would show
    its neighbours) and its brightness scaled by ``gain``, clipped to [0, 1]."""
    if image.ndim != 3:
        raise ValueError(f"image must be (C, H, W), got shape {tuple(image.shape)}")
    h, w = image.shape[1:]
    if abs(dy) >= h or abs(dx) >= w:
        raise ValueError(f"shift ({dy}, {dx}) does not fit an image of {h}x{w}")
    rows = (torch.arange(h) + dy).clamp(0, h - 1)
    cols = (torch.arange(w) + dx).clamp(0, w - 1)
    return (image[:, rows][:, :, cols] * gain).clamp(0.0, 1.0)


def with_near_duplicates(x: Tensor, y: Tensor, *, pairs: int = 1, kind: str = "view",
                         seed: int = 0, max_shift: int = 1,
                         max_gain: float = 0.02) -> tuple[Tensor, Tensor, list[tuple[int, int]]]:
    """A copy of the batch ``x`` (B, C, H, W), ``y`` (B,) in which ``pairs`` samples are
    replaced by near-duplicates of others.

    Sample ``2 i + 1`` becomes a near-duplicate of sample ``2 i`` (same label): with
    ``kind="view"`` a :func:`shifted_view` by up to ``max_shift`` pixels (not both zero) with
    a gain in ``1 ± max_gain``; with ``kind="repeat"`` an exact copy.

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
    if max_shift < 1 and kind == "view":
        raise ValueError(f"max_shift must be >= 1 for views, got {max_shift}")
    rng = np.random.default_rng([seed, 0xD0B])
    x, y = x.clone(), y.clone()
    made = []
    for i in range(pairs):
        a, b = 2 * i, 2 * i + 1
        if kind == "repeat":
            x[b] = x[a]
        else:
            dy = dx = 0
            while dy == 0 and dx == 0:
                dy, dx = (int(v) for v in rng.integers(-max_shift, max_shift + 1, size=2))
            gain = float(rng.uniform(1.0 - max_gain, 1.0 + max_gain))
            x[b] = shifted_view(x[a], dy, dx, gain)
        y[b] = y[a]
        made.append((a, b))
    return x, y, made
