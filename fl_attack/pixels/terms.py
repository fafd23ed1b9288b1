"""The terms of the pixel objective: feature match, smoothness priors, gradient consistency.

Each term is a function of a batch of candidate images laid out as ``(R * B, C, H, W)``
(R restarts of the B samples, restart-major) and returns one value per image or per restart,
so that one backward pass optimises every restart at once and each can be judged on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["OPPONENT", "feature_residuals", "gradient_mismatch", "total_variation"]

OPPONENT = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 0.0], [1.0, 1.0, -2.0]])
OPPONENT = OPPONENT / OPPONENT.norm(dim=1, keepdim=True)
"""Orthonormal opponent colour transform (rows: luminance, red-green, yellow-blue). Natural
images vary far less in colour than in brightness from pixel to pixel, the decorrelation that
feature visualisation parametrises images in (Olah et al., *Feature Visualization*,
Distill 2017)."""


def feature_residuals(features: Tensor, target: Tensor) -> Tensor:
    """Squared relative feature error per image: ``‖f(x̂_i) − F_i‖² / ‖F_i‖²``.

    The feature-inversion term of SPEAR §6.4 and of the Cocktail Party Attack's feature
    inversion (Kariyappa et al., ICML 2023): the candidate's features against the exact ones
    recovered from the linear layer. Relative, so every sample counts the same whatever its
    feature norm.

    Parameters
    ----------
    features : (R * B, n) tensor
        ``f(x̂)`` for the candidates.
    target : (B, n) tensor
        The recovered features ``F``; repeated over the R restarts.

    Returns
    -------
    (R * B,) tensor
    """
    reps = features.shape[0] // target.shape[0]
    goal = target.repeat(reps, 1)
    return (features - goal).pow(2).sum(1) / goal.pow(2).sum(1).clamp_min(1e-30)


def total_variation(images: Tensor, scale: Tensor, chroma_weight: float) -> Tensor:
    """Anisotropic total variation per image, colour differences weighted ``chroma_weight``.

    TV is the image prior of Inverting Gradients (Geiping et al., NeurIPS 2020, §4): mean
    absolute difference of neighbouring pixels. Images are divided by ``scale`` (the box width
    per channel) so that the weight does not depend on the normalisation. For three channels
    the differences are taken in the opponent colour space (:data:`OPPONENT`): luminance's
    plus ``chroma_weight`` times the colour channels' mean; the features of a CNN at
    initialisation tell colour apart poorly, and natural images keep their colour smooth.

    Parameters
    ----------
    images : (N, C, H, W) tensor
    scale : (C, 1, 1) tensor
        Box width per channel.
    chroma_weight : float
        Weight of the colour channels' variation relative to luminance (three channels only).

    Returns
    -------
    (N,) tensor
    """
    x = images / scale
    if x.shape[1] == 3 and chroma_weight != 1.0:
        x = torch.einsum("kc,nchw->nkhw", OPPONENT.to(x), x)
    dh = (x[..., 1:, :] - x[..., :-1, :]).abs().mean((2, 3))
    dw = (x[..., :, 1:] - x[..., :, :-1]).abs().mean((2, 3))
    per_channel = dh + dw
    if x.shape[1] == 3 and chroma_weight != 1.0:
        return per_channel[:, 0] + chroma_weight * per_channel[:, 1:].mean(1)
    return per_channel.mean(1)


def gradient_mismatch(features: Tensor, upstream: Tensor, params: Sequence[Tensor],
                      observed: Sequence[Tensor], norms: Sequence[Tensor]) -> Tensor:
    """Per-restart relative squared error of the parameter gradient the candidates imply.

    For a candidate batch ``x̂`` (one restart), backpropagating each sample's *known*
    ``∂L/∂features_i`` (from SPEAR's exact ``∂L/∂Z`` of the attacked layer) through the layers
    before it gives their gradient ``Σ_i J_θ(x̂_i)ᵀ u_i``; the observed update must equal it.
    This is gradient matching (Geiping et al., NeurIPS 2020) restricted to the layers before the
    attacked one, with the upstream gradient known per sample instead of left to the labels;
    as the upstream's scale is known, it compares magnitudes too (squared error over the
    observed norm, not the cosine).

    Parameters
    ----------
    features : (R * B, n) tensor
        ``f(x̂)``, built with autograd through ``params``.
    upstream : (B, n) tensor
        ``∂L/∂features`` per sample (times the learning rate when ``observed`` are updates).
    params : sequence of tensors
        The parameters the gradient is taken of (leaves of ``features``' graph).
    observed : sequence of tensors
        Their observed summed gradient (or weight update), same order.
    norms : sequence of 0-d tensors
        ``‖observed‖²``, same order.

    Returns
    -------
    (R,) tensor
        Σ over parameters of ``‖Σ_i J_θ(x̂_i)ᵀ u_i − g‖² / ‖g‖²`` for each restart.
    """
    b = upstream.shape[0]
    out = []
    for chunk in features.split(b):
        grads = torch.autograd.grad(chunk, list(params), grad_outputs=upstream,
                                    create_graph=True)
        out.append(sum((g - o).pow(2).sum() / n for g, o, n in zip(grads, observed, norms,
                                                                   strict=True)))
    return torch.stack(out)

