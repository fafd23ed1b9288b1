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
#: The most sentences one reading may put after one prefix: a larger coefficient is not a
#: count (the reading has not settled) and would make the recomputed batch explode.
MAX_COUNT = 8


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
                 prefixes: list[list[int]], leaves: int, *, rounds: int = 4) -> Endings:
    """Read the tokens that follow each prefix from the output weight's gradient.

    The first reading assumes one sentence per leaf with an unknown label and reads the leaves
    only; each later one recomputes the update with the labels read so far (so the known part
    includes their input-side gradients, which tied embeddings mix into the same rows) and
    reads what is left at every prefix, until two readings agree or ``rounds`` are spent.

    Parameters
    ----------
    model
        The model the client started from (eval mode is the caller's).
    weight
        The output layer's weight parameter (the tied embedding where tied).
    observed
        Its gradient (or update), (V, d).
    prefixes
        The prefixes a sentence may end after: first the ``leaves`` (no kept extension: a
        sentence surely ends there), then every shorter prefix of them (a sentence may end
        there too, e.g. "thank you" beside "thank you very much").
    leaves
        How many of ``prefixes`` are leaves.
    rounds
        The most readings.
    """
    obs = observed.double()
    guess: list[list[tuple[int, int]]] | None = None
    settled = False
    for _ in range(rounds):
        found = _read(model, weight, obs, prefixes, leaves, guess, first=guess is None)
        if found.labels == guess:
            settled = True
            break
        guess = found.labels
        if sum(c for labels in guess for _, c in labels) > 2 * leaves + MAX_COUNT:
            break                      # more sentences than the prefixes can hold
    return _whole_inner_ends(found, leaves, settled)


def _whole_inner_ends(found: Endings, leaves: int, settled: bool) -> Endings:
    """Inner ends kept only where the readings settled (two in a row agreed) and the last one
    is a whole count of sentences: a reading that has not settled (left padding's unmodelled
    labels, noise, spurious ends that come and go) leaves none there."""
    for j in range(leaves, len(found.labels)):
        keep = [i for i, c in enumerate(found.coefficients[j])
                if settled and abs(c - round(c)) <= INTEGER_TOL]
        found.labels[j] = [found.labels[j][i] for i in keep]
        found.coefficients[j] = [found.coefficients[j][i] for i in keep]
    return found


def _read(model: nn.Module, weight: nn.Parameter, obs: torch.Tensor,
          prefixes: list[list[int]], leaves: int, guess: list[list[tuple[int, int]]] | None,
          *, first: bool) -> Endings:
    """One reading: the coefficients of ``R = −N (G / α − G_known)`` in the prefixes' ends.

    ``obs`` is the observed gradient in float64. The batch recomputed holds each guessed
    sentence, and each leaf without a guess with an open end; an inner prefix needs no row of
    its own, its ``h`` is a leaf's at its length.
    """
    batch, open_end, ends = [], [], []
    for j, prefix in enumerate(prefixes):
        labels = (guess[j] if guess else None) or ([(None, 1)] if j < leaves else [])
        for tok, count in labels:
            for _ in range(count):
                batch.append(prefix + ([] if tok is None else [tok]))
                open_end.append(tok is None)
                ends.append(len(prefix) - 1)
    device = weight.device
    ids, mask = padded(batch, device)
    ends_t = torch.as_tensor(ends, device=device)
    with torch.enable_grad():
        logits, heads = logits_and_head_inputs(model, ids, mask)
        loss, n = next_token_loss(logits, ids, mask, open_ends=torch.where(
            torch.as_tensor(open_end, device=device), ends_t, -1))
        (known,) = torch.autograd.grad(loss, [weight])
    cols = leaves if first else len(prefixes)      # inner ends once the leaves' are known
    h = _head_inputs(heads.detach(), batch, prefixes[:cols]).double()
    known = known.double()
    alpha = _fit_scale(obs, known, skip=len(prefixes) * 2)
    coef = -n * (obs / alpha - known) @ torch.linalg.pinv(h)           # (V, prefixes)
    if guess:
        for j, labels in enumerate(guess):
            for tok, count in labels:
                coef[tok, j] += count
    labels, values = [[] for _ in prefixes], [[] for _ in prefixes]
    inputs = {t for prefix in prefixes for t in prefix}
    for j in range(cols):
        col = coef[:, j]
        top = _candidates(col)
        if first:
            top = _first_candidate(col, top, inputs) or top[:1]
        labels[j] = [(int(v), min(MAX_COUNT, max(1, round(float(col[v]))))) for v in top]
        values[j] = [float(col[v]) for v in top]
    return Endings(labels, values, alpha)


def _candidates(col: torch.Tensor, k: int = 8) -> list[int]:
    """The ``k`` tokens of largest coefficient above 0.5, largest first."""
    top = torch.nonzero(col > 0.5).flatten()
    return [int(v) for v in top[torch.argsort(col[top], descending=True)][:k]]


def _first_candidate(col: torch.Tensor, top: list[int], inputs: set[int]) -> list[int]:
    """The first reading's label of one prefix: the largest candidate that is no input token
    of the batch and reads as a whole count, when there is one (else none: the largest).

    The first reading leaves every sentence's last label unknown, and with it that position's
    gradient into the input embeddings: with tied embeddings, the rows of the batch's input
    tokens then carry a part the reading does not model, and such a token can outweigh the true
    label (measured: a model one FedSGD round past SmolLM2's weights read " Cape", an input
    token of another sentence, at 1.83 where the true label read 1.03). Later readings model
    the labels read, so this matters only for the first."""
    clean = [v for v in top if v not in inputs and abs(float(col[v]) - round(float(col[v])))
             <= INTEGER_TOL]
    return clean[:1]


def _head_inputs(heads: torch.Tensor, batch: list[list[int]], prefixes: list[list[int]]
                 ) -> torch.Tensor:
    """The output layer's input after each prefix, taken from a batch row that starts with it
    (causal attention: the same prefix gives the same hidden states)."""
    rows = []
    for prefix in prefixes:
        i = next(i for i, s in enumerate(batch) if s[: len(prefix)] == prefix)
        rows.append(heads[i, len(prefix) - 1])
    return torch.stack(rows)


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
