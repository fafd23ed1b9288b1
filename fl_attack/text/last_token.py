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
                 prefixes: list[list[int]], *, rounds: int = 4) -> Endings:
    """Read the tokens that follow each prefix from the output weight's gradient.

    The first reading assumes one sentence per prefix and an unknown label; each later one
    recomputes the update with the labels read so far (so the known part includes their
    input-side gradients, which tied embeddings mix into the same rows) and reads what is
    left, until two readings agree or ``rounds`` are spent.

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
    rounds
        The most readings.
    """
    guess: list[list[tuple[int, int]]] | None = None
    for _ in range(rounds):
        found = _read(model, weight, observed, prefixes, guess, first=guess is None)
        if found.labels == guess:
            break
        guess = found.labels
    return found


def _read(model: nn.Module, weight: nn.Parameter, observed: torch.Tensor,
          prefixes: list[list[int]], guess: list[list[tuple[int, int]]] | None, *,
          first: bool) -> Endings:
    """One reading: the coefficients of ``R = −N (G / α − G_known)`` in the prefixes' ends."""
    rows_of: list[list[int]] = []
    batch, open_end = [], []
    for j, prefix in enumerate(prefixes):
        labels = (guess[j] if guess else None) or [(None, 1)]
        rows_of.append([])
        for tok, count in labels:
            for _ in range(count):
                rows_of[j].append(len(batch))
                batch.append(prefix + ([] if tok is None else [tok]))
                open_end.append(tok is None)
    device = weight.device
    ids, mask = padded(batch, device)
    ends = torch.as_tensor([len(prefixes[j]) - 1 for j, rs in enumerate(rows_of) for _ in rs],
                           device=device)
    is_open = torch.as_tensor(open_end, device=device)
    with torch.enable_grad():
        logits, heads = logits_and_head_inputs(model, ids, mask)
        loss, n = next_token_loss(logits, ids, mask,
                                  open_ends=torch.where(is_open, ends, -1))
        (known,) = torch.autograd.grad(loss, [weight])
    h = heads[torch.as_tensor([rs[0] for rs in rows_of], device=device),
              torch.as_tensor([len(p) - 1 for p in prefixes], device=device)].detach().double()
    obs, known = observed.double(), known.double()
    alpha = _fit_scale(obs, known, skip=len(prefixes) * 2)
    coef = -n * (obs / alpha - known) @ torch.linalg.pinv(h)           # (V, prefixes)
    if guess:
        for j, labels in enumerate(guess):
            for tok, count in labels:
                coef[tok, j] += count
    labels, values = [], []
    for j in range(len(prefixes)):
        col = coef[:, j]
        top = torch.nonzero(col > 0.5).flatten()
        top = top[torch.argsort(col[top], descending=True)][: 1 if first else 8]
        labels.append([(int(v), max(1, round(float(col[v])))) for v in top])
        values.append([float(col[v]) for v in top])
    return Endings(labels, values, alpha)


def _fit_scale(obs: torch.Tensor, known: torch.Tensor, *, skip: int) -> float:
    """Least-squares α in ``obs ≈ α known`` over the rows, leaving out the ``skip`` rows that fit
    worst (those the unknown labels touch). Row sums are formed once: ``‖o − αk‖² = oo − 2α ok
    + α² kk`` per row."""
    oo, ok, kk = (obs * obs).sum(1), (obs * known).sum(1), (known * known).sum(1)
    keep = torch.ones_like(ok, dtype=torch.bool)
    alpha = 0.0
    for _ in range(3):
        den = float(kk[keep].sum())
        alpha = float(ok[keep].sum()) / den if den > 0 else 0.0
        bad = oo - 2 * alpha * ok + alpha * alpha * kk
        keep = torch.ones_like(keep)
        keep[torch.topk(bad, min(skip, bad.numel() - 1)).indices] = False
    if alpha == 0.0:
        raise ValueError("the output layer's gradient is zero")
    return alpha
