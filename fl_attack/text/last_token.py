"""The last token of each sentence, read from the output layer's gradient.

Under next-token loss the last position of a sentence has no label, so its token reaches no
span; but it *is* the label of the position before, and the output layer's weight gradient is
``(1/N) Σ_p (softmax(z_p) − e_{y_p}) h_pᵀ`` over the labelled positions (``h_p`` the output
layer's input). Once every prefix is known, the server computes everything in that sum but the
unknown labels' one-hot parts: ``R = −N (G / α − G_known)`` is then ``Σ_s e_{y_s} h_sᵀ`` over the
sentences' last labelled positions, and row ``v`` of ``R`` expressed in the ``h_s`` gives, for
each sentence end, how many sentences end with token ``v`` there (an integer: 1, or more for
repeated sentences and for sentences that share their prefix). ``α`` (the update's unknown
scale: learning rate, sum or mean) is fitted on the rows no label touches.

With tied embeddings the output weight is the input embedding, whose gradient also holds the
input positions' gradients on the rows of tokens in the batch: there the coefficients are
only approximate, and the recomputed update (:mod:`fl_attack.text.certify`) decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fl_attack.text.batch import logits_and_head_inputs, next_token_loss, padded

#: A coefficient within this of an integer ≥ 1 reads as that many sentences ending there.
INTEGER_TOL = 0.1


@dataclass
class Endings:
    """What the output layer's gradient says about each prefix's end.

    Attributes
    ----------
    labels : list[list[tuple[int, int]]]
        Per prefix, ``(token, count)`` of the sentences ending there (empty: none read).
    coefficients : list[list[float]]
        The raw coefficient behind each label (its distance to the integer is the evidence).
    scale : float
        α, the fitted scale of the update relative to a mean next-token loss gradient.
    """

    labels: list[list[tuple[int, int]]]
    coefficients: list[list[float]]
    scale: float


def read_endings(model: nn.Module, weight: nn.Parameter, observed: torch.Tensor,
                 prefixes: list[list[int]], counts: list[int] | None = None) -> Endings:
    """Read the tokens that follow each prefix from the output weight's gradient.

    Parameters
    ----------
    model
        The model the client started from (eval mode is the caller's).
    weight
        The output layer's weight parameter (the tied embedding where tied).
    observed
        Its gradient (or update), (V, d).
    prefixes
        Each sentence's tokens but its last.
    counts
        Sentences per prefix (default 1 each), as a first reading may have told.
    """
    counts = counts or [1] * len(prefixes)
    batch = [p for p, c in zip(prefixes, counts, strict=True) for _ in range(c)]
    device = weight.device
    ids, mask = padded(batch, device)
    ends = torch.as_tensor([len(p) - 1 for p in batch], device=device)
    with torch.enable_grad():
        logits, heads = logits_and_head_inputs(model, ids, mask)
        loss, n = next_token_loss(logits, ids, mask, open_ends=ends)
        (known,) = torch.autograd.grad(loss, [weight])
    rows = torch.arange(len(batch), device=device)
    h = heads[rows, ends].detach().double()
    first = torch.as_tensor([sum(counts[:i]) for i in range(len(prefixes))], device=device)
    h = h[first]                                                      # one row per prefix
    obs, known = observed.double(), known.double()
    alpha = _fit_scale(obs, known, skip=len(prefixes) * 2)
    resid = -n * (obs / alpha - known)                                # Σ_s e_{y_s} h_sᵀ
    coef = resid @ torch.linalg.pinv(h)                               # (V, prefixes)
    labels, values = [], []
    for j in range(len(prefixes)):
        col = coef[:, j]
        top = torch.nonzero(col > 0.5).flatten()
        top = top[torch.argsort(col[top], descending=True)][:8]
        labels.append([(int(v), max(1, round(float(col[v])))) for v in top])
        values.append([float(col[v]) for v in top])
    return Endings(labels, values, alpha)


def _fit_scale(obs: torch.Tensor, known: torch.Tensor, *, skip: int) -> float:
    """Least-squares α in ``obs ≈ α known`` over the rows, leaving out the ``skip`` rows that fit
    worst (those the unknown labels touch)."""
    alpha = float((obs * known).sum() / (known * known).sum().clamp_min(1e-300))
    for _ in range(2):
        bad = (obs - alpha * known).norm(dim=1)
        keep = torch.ones(obs.shape[0], dtype=torch.bool, device=obs.device)
        keep[torch.topk(bad, min(skip, obs.shape[0] - 1)).indices] = False
        o, k = obs[keep], known[keep]
        alpha = float((o * k).sum() / (k * k).sum().clamp_min(1e-300))
    if alpha == 0.0:
        raise ValueError("the output layer's gradient is zero")
    return alpha
