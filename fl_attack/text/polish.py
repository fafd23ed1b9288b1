"""Single-token substitutions that finish a nearly found encoder sentence.

The relaxed search (:mod:`fl_attack.text.relaxed`) often settles with one or two positions on
a wrong token. Rounded to its most likely tokens such a run is no sentence of the batch, and
every one of its positions leaves block 0's MLP-input span (bidirectional attention spreads
one wrong token over the whole sentence), yet the wrong position stands out: replacing its
token by the right one brings every position back, and its own position is the one pushed
furthest. So from the rounded sentence, each step tries every candidate token at the
``WORST`` positions of highest score but the last (the ending token) in one batch and keeps
the substitution whose positions lie nearest the span, until a sentence passes the span
test or no substitution improves it: a greedy descent on the discrete problem the relaxation
approximates. Block 0 is read from the candidates' precomputed table
(:mod:`fl_attack.text.table`), and a sentence found is checked once more through the model.
"""

from __future__ import annotations

import torch

from fl_attack.core.clock import passed
from fl_attack.text import encoder
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span
from fl_attack.text.table import Table, chosen

#: Most substitutions tried in sequence from one sentence.
STEPS = 4
#: Positions tried at each step: those scoring highest. A wrong token's own position scores
#: highest among the positions it pushes out of the span (measured on MiniLM: 7 of 8 single
#: wrong tokens in 30-token sentences, the eighth second).
WORST = 3


def _cost(scores: torch.Tensor) -> torch.Tensor:
    """(N,) a sentence's distance from the batch: the sum over its positions of
    ``log(1 + score)`` (scores span orders of magnitude; one wrong token raises them all)."""
    return torch.log1p(scores).sum(-1)


def neighbours(choice: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
    """(M, n) the sentence ``choice`` (n,) (candidate indices) with one of ``positions``
    replaced by each of its candidates (``valid`` (L, K)); the sentence itself among them."""
    where = torch.nonzero(valid[positions])                                # (M, 2)
    where[:, 0] = positions[where[:, 0]]
    rows = choice.expand(len(where), -1).clone()
    rows[torch.arange(len(where)), where[:, 0]] = where[:, 1]
    return rows


def _scores(family: Family, span: Span, table: Table, rows: torch.Tensor) -> torch.Tensor:
    """(M, n) the span scores of each position of the sentences ``rows`` (candidate indices)."""
    alive = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    h = chosen(family, table, rows, alive)
    return span.score(h.flatten(0, 1))[1].view(rows.shape)


@torch.no_grad()
def polish(family: Family, span: Span, table: Table, choice: torch.Tensor, *,
           deadline: float | None = None) -> list[int] | None:
    """The sentence of the batch a few substitutions from ``choice``, or None.

    Parameters
    ----------
    family
        The encoder's adapter.
    span
        Block 0's MLP-input span.
    table
        The candidates at each position.
    choice
        (n,) the sentence as candidate indices into ``table``, ending with the ending token
        (kept).
    deadline
        ``time.perf_counter()`` value after which no further step starts.

    Returns
    -------
    list[int] | None
        The token ids of a sentence every position of which lies in the span
        (``score < ACCEPT``, checked through the model), reached by at most ``STEPS``
        single-token substitutions each of which lowers the cost; else None.
    """
    n = choice.numel()
    at = torch.arange(n, device=choice.device)
    free = table.valid[:n - 1].sum(1) > 1               # positions with a choice to make
    if not bool(free.any()):
        return None
    now = _scores(family, span, table, choice[None])[0]
    best = float(_cost(now))
    for _ in range(STEPS):
        if passed(deadline):
            return None
        ranked = now[:-1].masked_fill(~free, float("-inf"))
        worst = torch.topk(ranked, min(WORST, int(free.sum()))).indices
        rows = neighbours(choice, table.valid, worst)
        sc = _scores(family, span, table, rows)
        for i in torch.nonzero((sc < ACCEPT).all(-1)).flatten().tolist():
            tokens = table.ids[at, rows[i]]
            length = torch.tensor([tokens.numel()], device=tokens.device)
            if bool((encoder.scores(family, span, tokens[None], length) < ACCEPT).all()):
                return tokens.tolist()
        cost = _cost(sc)
        pick = int(cost.argmin())
        if float(cost[pick]) >= best:
            return None
        best, choice, now = float(cost[pick]), rows[pick], sc[pick]
    return None
