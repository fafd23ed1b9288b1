"""A reconstruction as pictures, and the pictures scored against the truth.

* :class:`InputView` turns the attacked layer's reconstructed inputs (``(B, n)`` numbers) into
  what an auditor can look at: images of a known or inferred shape, scaled back to ``[0, 1]``
  (the dataset's normalisation, a given mean/std or transform, else per-image min-max), or the
  rows of a table when the inputs are not images.
* :class:`GroundTruth` is the audit mode's dataset, indexed by the sample ids the plugin's own
  clients report; :func:`score_images` matches reconstructions to originals and gives PSNR.
* :func:`pictures_of` does both for one attack's outcome: its :class:`Pictures` go into the
  reply's record (``results.records.build_record``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.jobs.outcome import AttackOutcome


def infer_image_shape(n: int) -> tuple[int, int, int] | None:
    """``(C, H, W)`` of a square image with ``n`` values (3 channels, else 1), or ``None``."""
    for channels in (3, 1):
        if n % channels == 0:
            side = math.isqrt(n // channels)
            if side >= 4 and side * side * channels == n:
                return channels, side, side
    return None


@dataclass
class InputView:
    """How reconstructed inputs become pictures.

    Parameters
    ----------
    dataset : str, optional
        A dataset of ``fl_attack.testbed.data``: its image shape and normalisation are used.
    input_shape : tuple of int, optional
        ``(C, H, W)`` of the model's input; ``None``: from ``dataset``, else inferred when the
        input size is a square image with 1 or 3 channels (the report says so).
    transform : callable or (mean, std), optional
        Undoes the clients' input normalisation: a function of a ``(B, C, H, W)`` tensor, or
        per-channel ``(mean, std)`` sequences. ``None``: per-image min-max scaling.
    """

    dataset: str | None = None
    input_shape: tuple[int, int, int] | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | tuple[Iterable[float],
                                                             Iterable[float]] | None = None

    def shape_for(self, n: int) -> tuple[tuple[int, int, int] | None, bool]:
        """``(shape, inferred)`` for inputs of ``n`` values (shape ``None``: not images)."""
        if self.input_shape is not None:
            shape = tuple(int(s) for s in self.input_shape)
            if int(np.prod(shape)) != n:
                raise ValueError(f"input_shape {shape} has {int(np.prod(shape))} values but the "
                                 f"attacked layer takes {n}")
            return (shape[0], shape[1], shape[2]), False
        if self.dataset is not None:
            from fl_attack.testbed.data import image_shape

            shape = image_shape(self.dataset)
            if int(np.prod(shape)) == n:
                return shape, False
        return infer_image_shape(n), True

    def model_shape(self) -> tuple[int, int, int] | None:
        """The model's input shape, when given or known from the dataset."""
        if self.input_shape is not None:
            return (int(self.input_shape[0]), int(self.input_shape[1]),
                    int(self.input_shape[2]))
        if self.dataset is not None:
            from fl_attack.testbed.data import image_shape

            return image_shape(self.dataset)
        return None

    def bounds(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel box that pixels in ``[0, 1]`` occupy in the model's input space, when
        the normalisation is known as ``(mean, std)`` or from the dataset."""
        if self.transform is not None and not callable(self.transform):
            mean, std = (np.atleast_1d(np.asarray(list(v), dtype=np.float64))
                         for v in self.transform)
        elif self.transform is None and self.dataset is not None:
            from fl_attack.testbed.data import normalize

            shape = self.model_shape()
            assert shape is not None
            lo = normalize(torch.zeros(shape, dtype=torch.float64), self.dataset)
            hi = normalize(torch.ones(shape, dtype=torch.float64), self.dataset)
            return (tuple(float(v) for v in lo[:, 0, 0]), tuple(float(v) for v in hi[:, 0, 0]))
        else:
            return None
        return (tuple(float(v) for v in -mean / std), tuple(float(v) for v in (1 - mean) / std))

    def scale_words(self, inferred: bool) -> str:
        """How :meth:`images` brings inputs into ``[0, 1]``, in words (``inferred``: the shape
        was inferred)."""
        if self.transform is not None and callable(self.transform):
            return "the model's inputs mapped back by input_transform, clipped to [0, 1]"
        if self.transform is not None:
            return "the model's inputs times std plus mean (input_transform), clipped to [0, 1]"
        if self.dataset is not None and not inferred:
            return f"the model's inputs denormalised as {self.dataset}, clipped to [0, 1]"
        return "each image scaled from its own minimum to its maximum (no input_transform given)"

    def images(self, inputs: np.ndarray) -> tuple[np.ndarray | None, bool]:
        """``((B, C, H, W) images in [0, 1] or None, shape inferred)`` of reconstructed inputs."""
        x = torch.as_tensor(np.array(inputs, dtype=np.float64))  # a writable copy
        if x.ndim != 2 or not bool(torch.isfinite(x).all()):
            return None, False
        shape, inferred = self.shape_for(int(x.shape[1]))
        if shape is None:
            return None, False
        x = x.reshape(-1, *shape)
        if self.transform is not None and callable(self.transform):
            x = self.transform(x)
        elif self.transform is not None:
            mean, std = (torch.as_tensor(list(v), dtype=x.dtype) for v in self.transform)
            x = x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
        elif self.dataset is not None and not inferred:
            from fl_attack.testbed.data import denormalize

            x = denormalize(x, self.dataset)
        else:
            lo = x.flatten(1).amin(dim=1).view(-1, 1, 1, 1)
            hi = x.flatten(1).amax(dim=1).view(-1, 1, 1, 1)
            x = (x - lo) / (hi - lo).clamp_min(1e-12)
        return x.clamp(0.0, 1.0).numpy(), inferred


class GroundTruth:
    """The audit's ground truth: the dataset the clients load, indexed by sample id.

    Used in audit mode only, where the plugin's clients report the samples they trained on.
    Loading is lazy and cached (photo pools take a while to generate).
    """

    def __init__(self, dataset: str, size: int | None = None, *, seed: int = 0,
                 root: str | None = None) -> None:
        self.dataset, self.size, self.seed, self.root = dataset, size, seed, root
        self._images: torch.Tensor | None = None

    def images(self, indices: Iterable[int]) -> torch.Tensor:
        """``(B, C, H, W)`` float images in ``[0, 1]`` for the given dataset indices."""
        if self._images is None:
            from fl_attack.testbed.data import load_images

            self._images, _ = load_images(self.dataset, self.size, seed=self.seed,
                                          root=self.root)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if idx.numel() == 0:
            raise ValueError("no sample indices")
        if int(idx.min()) < 0 or int(idx.max()) >= self._images.shape[0]:
            raise ValueError(f"sample index out of range [0, {self._images.shape[0]})")
        return self._images[idx]


@dataclass
class Score:
    """Reconstructions matched to originals: per-original PSNR and SSIM, the matched pictures."""

    psnr: list[float]
    psnr_mean: float
    matching: np.ndarray
    matched: np.ndarray
    """``(B_true, C, H, W)``: each original's reconstruction (grey where none matched)."""
    ssim: list[float]
    ssim_mean: float


def score_images(recon: np.ndarray, originals: torch.Tensor) -> Score:
    """Match reconstructed to true images (Hungarian) and score them (PSNR and SSIM, range
    [0, 1])."""
    from fl_attack.testbed.metrics import score_batch

    rec = torch.as_tensor(recon, dtype=torch.float64)
    orig = originals.double()
    score = score_batch(rec, orig, data_range=1.0, with_ssim=True)
    matched = np.full(tuple(orig.shape), 0.5)
    hit = score.perm >= 0
    matched[hit.numpy()] = rec[score.perm[hit]].numpy()
    assert score.ssim is not None  # with_ssim
    return Score([float(v) for v in score.psnr], float(score.mean_psnr), score.perm.numpy(),
                 matched, [float(v) for v in score.ssim], float(score.ssim.mean()))


@dataclass(frozen=True)
class Pictures:
    """A reconstruction as pictures; with ground truth, matched to the originals and scored."""

    recon_images: np.ndarray | None = field(default=None, repr=False)
    """``(B, C, H, W)`` in ``[0, 1]``, in the originals' order when they are known."""
    original_images: np.ndarray | None = field(default=None, repr=False)
    matching: np.ndarray | None = field(default=None, repr=False)
    psnr: list[float] | None = None
    psnr_mean: float | None = None
    ssim: list[float] | None = None
    ssim_mean: float | None = None
    true_batch_size: int | None = None
    note: str | None = None
    """How the inputs were shown (not images; shape inferred)."""
    estimated: np.ndarray | None = field(default=None, repr=False)
    """Pictures estimated from features: ``(B, C, H, W)`` in ``[0, 1]``, row i from row i of
    the reconstructed features (not reordered)."""
    estimated_scale: str | None = None
    """How :attr:`estimated` was brought into ``[0, 1]`` from the model's input space."""
    error: str | None = None
    """Why the pictures or the scores could not be made."""


def pictures_of(outcome: AttackOutcome, facts: ReplyFacts, view: InputView,
                truth: GroundTruth | None) -> Pictures:
    """Pictures of a reconstruction; with ground truth, matched to the originals and scored.

    Inputs of the model's own input layer are shown as they are; features of a later layer
    are shown as the pictures estimated from them (``outcome.pixels``), or as a table of
    numbers when there are none (features and photos do not compare, so they are not scored).
    Never raises: what could not be shown or scored is the pictures' ``error``.
    """
    px = outcome.pixels
    if facts.reads == "features" and (px is None or px.images is None):
        rows = Pictures(note="No pictures: these are features, shown as numbers.")
        return rows if px is None or px.error is None else Pictures(note=rows.note,
                                                                    error=px.error)
    flat = outcome.inputs if facts.reads != "features" else px.images.reshape(
        px.images.shape[0], -1)
    try:
        images, inferred = view.images(flat)
    except ValueError as exc:
        return Pictures(error=f"pictures: {exc}")
    if images is None:
        return Pictures(note="The inputs are not images: the first reconstructed rows are "
                             "shown as numbers.")
    note = (f"Input shape {images.shape[1:]} inferred from the layer's {images[0].size} "
            "inputs; pictures scaled per image.") if inferred else None
    kept = {} if facts.reads != "features" else {"estimated": images,
                                                  "estimated_scale": view.scale_words(inferred)}
    if truth is None or not facts.sample_indices:
        return Pictures(recon_images=images, note=note, **kept)
    try:
        originals = truth.images(facts.sample_indices)
        score = score_images(images, originals)
    except ValueError as exc:
        return Pictures(recon_images=images, note=note, error=f"scoring failed: {exc}", **kept)
    return Pictures(recon_images=score.matched, original_images=originals.numpy(),
                    matching=score.matching, psnr=score.psnr, psnr_mean=score.psnr_mean,
                    ssim=score.ssim, ssim_mean=score.ssim_mean,
                    true_batch_size=int(originals.shape[0]), note=note, **kept)
