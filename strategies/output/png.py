"""Pictures of reconstructions: a grid of images as a PNG (no pyplot state)."""

from __future__ import annotations

import io
import math

import numpy as np

MARK_RGB = (0.13, 0.63, 0.30)
"""The frame colour of a marked tile (green): a sample verified on its own."""
FLAG_RGB = (0.90, 0.45, 0.05)
"""The frame colour of a flagged tile (orange): a sample that keeps its batch unproven."""


def image_grid(images: np.ndarray, *, ncols: int | None = None, pad: int = 2,
               min_side: int = 256, marked: np.ndarray | None = None,
               flagged: np.ndarray | None = None) -> np.ndarray:
    """Tile ``(B, C, H, W)`` images in ``[0, 1]`` into one ``uint8`` RGB grid.

    Values are clipped to ``[0, 1]``; one-channel images are shown as grey. The grid is upscaled
    by an integer factor (nearest neighbour) so that it is at least ``min_side`` pixels wide:
    32x32 reconstructions are unreadable at their native size. ``marked`` (``(B,)`` booleans)
    frames those tiles in :data:`MARK_RGB` (the padding around them), so a report can single
    out the samples it can vouch for one by one; ``flagged`` frames tiles in :data:`FLAG_RGB`,
    the samples it names as not proven.
    """
    x = np.asarray(images, dtype=np.float64)
    if x.ndim != 4 or x.shape[0] == 0:
        raise ValueError(f"expected a non-empty (B, C, H, W) array, got shape {x.shape}")
    b, c, h, w = x.shape
    if c == 1:
        x = np.repeat(x, 3, axis=1)
    elif c != 3:
        raise ValueError(f"images must have 1 or 3 channels, got {c}")
    x = np.nan_to_num(np.clip(x, 0.0, 1.0), nan=0.0)
    cols = ncols or int(math.ceil(math.sqrt(b)))
    rows = int(math.ceil(b / cols))
    grid = np.ones((rows * (h + pad) + pad, cols * (w + pad) + pad, 3))
    for name, flags, rgb in (("marked", marked, MARK_RGB), ("flagged", flagged, FLAG_RGB)):
        if flags is None:
            continue
        flags = np.asarray(flags, dtype=bool)
        if flags.shape != (b,):
            raise ValueError(f"{name} must have one flag per image ({b}), got shape "
                             f"{flags.shape}")
        for i in np.flatnonzero(flags):
            r, k = divmod(int(i), cols)
            grid[r * (h + pad): (r + 1) * (h + pad) + pad,
                 k * (w + pad): (k + 1) * (w + pad) + pad] = rgb
    for i in range(b):
        r, k = divmod(i, cols)
        y0, x0 = pad + r * (h + pad), pad + k * (w + pad)
        grid[y0 : y0 + h, x0 : x0 + w] = x[i].transpose(1, 2, 0)
    scale = max(1, int(math.ceil(min_side / grid.shape[1])))
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    return (grid * 255.0 + 0.5).astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an ``(H, W, 3)`` uint8 image as PNG (matplotlib's writer, no pyplot state)."""
    from matplotlib import image as mpimg

    buf = io.BytesIO()
    mpimg.imsave(buf, rgb, format="png")
    return buf.getvalue()
