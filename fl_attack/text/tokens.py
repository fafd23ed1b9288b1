"""The token filter: which vocabulary tokens the first block saw (DAGER §4.1).

Block 0's attention projections read ``norm(embedding)`` at every position (plus the learned
position embedding where the model has one). Every vocabulary token is one candidate input;
those whose vector lies in the span of block 0's gradient rows are the batch's tokens at the
positions that carry a loss gradient. With rotary positions the input does not depend on the
position (the rotation comes after the projection), so one pass over the vocabulary gives the
whole bag; with learned positions each position is checked in turn, which also gives the
tokens allowed at each position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fl_attack.core.clock import passed
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span

#: Vocabulary rows normalised and projected per chunk.
VOCAB_CHUNK = 8192


@dataclass
class TokenFilter:
    """Tokens found, per position (one entry for position-free inputs).

    Attributes
    ----------
    candidates : list[torch.Tensor]
        Token ids that may stand at each position; rotary models: one list, every position.
    accepted_max, rejected_min : float
        Largest score (:meth:`Span.score`) of a kept token and smallest of a rejected one.
    stopped : str
        ``"complete"`` or ``"budget"``.
    twins : list[list[int]]
        Kept tokens whose embedding rows are identical (a vocabulary can hold such, e.g.
        untrained tokens): the update cannot tell them apart.
    """

    candidates: list[torch.Tensor]
    accepted_max: float
    rejected_min: float
    stopped: str = "complete"
    twins: list[list[int]] = field(default_factory=list)


@torch.no_grad()
def filter_tokens(family: Family, span: Span, *, deadline: float | None,
                  max_positions: int | None = None) -> TokenFilter:
    """Check every vocabulary token (at every position, for learned positions) against the span.

    Parameters
    ----------
    family
        The model's adapter.
    span
        Block 0's attention-input span.
    deadline
        ``time.perf_counter()`` value after which the filter stops as ``"budget"``.
    max_positions
        Learned positions only: the most positions checked (default: the model's).
    """
    if not family.positional_inputs:
        ids, acc, rej = _scan(family, span, 0)
        return TokenFilter([ids], acc, rej, twins=_twins(family, ids))
    limit = max_positions or family.max_positions()
    cands, acc, rej = [], 0.0, float("inf")
    for p in range(limit):
        if passed(deadline):
            return TokenFilter(cands, acc, rej, stopped="budget")
        ids, a, r = _scan(family, span, p)
        acc, rej = max(acc, a), min(rej, r)
        if ids.numel() == 0:
            break
        cands.append(ids)
    kept = torch.unique(torch.cat(cands)) if cands else torch.zeros(0, dtype=torch.long)
    return TokenFilter(cands, acc, rej, twins=_twins(family, kept))


def _twins(family: Family, ids: torch.Tensor) -> list[list[int]]:
    """Groups of kept tokens with identical embedding rows."""
    if ids.numel() < 2:
        return []
    _, inverse, counts = torch.unique(family.embed.weight[ids].detach(), dim=0,
                                      return_inverse=True, return_counts=True)
    return [ids[inverse == g].tolist() for g in torch.nonzero(counts > 1).flatten().tolist()]


def _scan(family: Family, span: Span, position: int) -> tuple[torch.Tensor, float, float]:
    """Token ids whose score at ``position`` is below ``ACCEPT``, and the margin seen."""
    kept, acc, rej = [], 0.0, float("inf")
    device = family.embed.weight.device
    for lo in range(0, family.vocab_size, VOCAB_CHUNK):
        ids = torch.arange(lo, min(lo + VOCAB_CHUNK, family.vocab_size), device=device)
        _, d = span.score(family.attn_input(0, family.embeddings(ids, position)))
        ok = d < ACCEPT
        if ok.any():
            acc = max(acc, float(d[ok].max()))
            kept.append(ids[ok])
        if (~ok).any():
            rej = min(rej, float(d[~ok].min()))
    ids = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long, device=device)
    return ids, acc, rej
