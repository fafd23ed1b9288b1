"""Local moves that finish a nearly found encoder sentence.

The relaxed search (:mod:`fl_attack.text.relaxed`) often settles with a few positions on
wrong tokens. Rounded to its most likely tokens such a run is no sentence of the batch, and
every one of its positions leaves block 0's MLP-input span (bidirectional attention spreads
one wrong token over the whole sentence), yet the right move brings the whole sentence nearer.
So from the rounded sentence each step tries, in one batch,

- every candidate token at every position but the last (the ending token), then the best of
  these together at 1, 2, 4, ... positions (:func:`combined`);
- the right tokens in the wrong order (:func:`rearranged`): two tokens up to three positions
  apart swapped, a segment of three to six tokens rotated by one (the relaxation often holds
  a segment shifted by one position, its first or last token out of place);
- two neighbouring positions changed together, each to one of its ``TOP`` best single
  substitutions (:func:`paired`): a token moves its neighbour's MLP input too, so a wrong pair
  of neighbours may be nearer only when both change,

and keeps the sentence nearest the span, until a sentence passes the span test or nothing
brings it nearer: a steepest descent on the discrete problem the relaxation approximates.

"Nearest" is the sum over positions of the squared relative distance, in float32
(:meth:`fl_attack.text.span.Span.relative_residual`): it ranks, and the sentence kept is
tested in float64 through the model before it is returned. Measured on MiniLM (a WordNet
batch of 8, 52 candidates per position, 3 or 5 wrong tokens put in at random), substitutions
alone: the squared distances finish 21 of 24 and 9 of 24 sentences, the sum of
``log(1 + score)`` 16 and 3. From the relaxation's own runs (32 runs at each of the 4 lengths
of a batch of WordNet glosses of 17-32 tokens, 600 steps each) substitutions alone finish 7 of
128 runs, with the rearrangements and pairs 32 of 128, in twice the time per run. Block 0 is
read from the candidates' precomputed table (:mod:`fl_attack.text.table`).
"""

from __future__ import annotations

import torch

from fl_attack.core.clock import passed
from fl_attack.text import encoder
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span
from fl_attack.text.table import Table, chosen

#: Most steps from one sentence (a step makes one move, :func:`combined` one or more
#: substitutions).
STEPS = 16
#: Best single substitutions per position that :func:`paired` combines with a neighbour's.
TOP = 4
#: Longest segment :func:`rearranged` rotates.
MAX_SEGMENT = 6
#: Neighbouring sentences evaluated together (bounds the memory of one step).
CHUNK = 512


def neighbours(choice: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
    """(M, n) the sentence ``choice`` (n,) (candidate indices) with one of ``positions``
    replaced by each of its candidates (``valid`` (L, K)); the sentence itself among them."""
    where = torch.nonzero(valid[positions])                                # (M, 2)
    where[:, 0] = positions[where[:, 0]]
    rows = choice.expand(len(where), -1).clone()
    rows[torch.arange(len(where)), where[:, 0]] = where[:, 1]
    return rows


def _cost(family: Family, span: Span, table: Table, rows: torch.Tensor,
          deadline: float | None) -> torch.Tensor | None:
    """(M,) each sentence's (candidate indices, (M, n)) summed squared relative distance of
    its positions to the span, float32; None once the deadline has passed."""
    out = []
    for lo in range(0, len(rows), CHUNK):
        if passed(deadline):
            return None
        part = rows[lo:lo + CHUNK]
        alive = torch.ones(part.shape, dtype=torch.bool, device=part.device)
        out.append(span.relative_residual(chosen(family, table, part, alive)).sum(-1))
    return torch.cat(out)


def _passes(family: Family, span: Span, tokens: torch.Tensor) -> bool:
    """Whether every position of the sentence ``tokens`` (n,) lies in the span, through the
    model in float64 (:func:`fl_attack.text.encoder.scores`)."""
    length = torch.tensor([tokens.numel()], device=tokens.device)
    return bool((encoder.scores(family, span, tokens[None], length) < ACCEPT).all())


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
        (``score < ACCEPT``, checked through the model), ``choice`` itself or reached in at most
        ``STEPS`` moves, each of which brings it nearer the span; else None.
    """
    n = choice.numel()
    at = torch.arange(n, device=choice.device)
    free = torch.nonzero(table.valid[:n - 1].sum(1) > 1).flatten()   # a choice to make
    if passed(deadline):
        return None
    if _passes(family, span, table.ids[at, choice]):
        return table.ids[at, choice].tolist()
    if not free.numel():
        return None
    now = _cost(family, span, table, choice[None], deadline)
    if now is None:
        return None
    best = float(now[0])
    for _ in range(STEPS):
        rows = neighbours(choice, table.valid, free)
        cost = _cost(family, span, table, rows, deadline)
        if cost is None:
            return None
        moves = torch.cat([combined(choice, rows, cost, best),
                           rearranged(choice, table, free), paired(choice, rows, cost)])
        cost = _cost(family, span, table, moves, deadline)
        if cost is None:
            return None
        pick = int(cost.argmin())
        if float(cost[pick]) >= best:
            return None
        best, choice = float(cost[pick]), moves[pick]
        tokens = table.ids[at, choice]
        if _passes(family, span, tokens):
            return tokens.tolist()
    return None


def combined(choice: torch.Tensor, rows: torch.Tensor, cost: torch.Tensor, now: float
             ) -> torch.Tensor:
    """(M, n) sentences applying at once the best substitutions of the first 1, 2, 4, ... and
    all positions whose best substitution lowers the cost below ``now``, by gain.

    ``rows`` are ``choice`` with one substitution each, ``cost`` theirs. No two positions
    taken are adjacent: a token moves its own position's and the next one's MLP input most
    (one attention head of MiniLM's block 0 reads the neighbour), so the gains of adjacent
    substitutions do not add up. The step keeps the lowest-cost of these (one substitution
    among them), so several wrong tokens go in one step where that pays. Measured on MiniLM
    (two WordNet batches of 8, sentences of 7-31 tokens, 3-12 wrong tokens put in at random):
    52 of 96 sentences finished, 48 by one substitution per step, in half the time.
    """
    diff = rows != choice
    changed, moved = diff.int().argmax(1), diff.any(1)
    seen: set[int] = set()
    picks: list[tuple[int, int]] = []
    for i in torch.argsort(cost).tolist():
        if float(cost[i]) >= now:
            break
        p = int(changed[i])
        if not bool(moved[i]) or p in seen:
            continue
        seen.add(p)                               # its best substitution: the first seen
        if all(abs(p - q) > 1 for q, _ in picks):
            picks.append((p, int(rows[i, p])))
    sizes = sorted({min(2 ** j, len(picks)) for j in range(len(picks).bit_length() + 1)}
                   - {0})
    out = []
    for m in sizes:
        row = choice.clone()
        for p, k in picks[:m]:
            row[p] = k
        out.append(row)
    return torch.stack(out) if out else choice[None]


def rearranged(choice: torch.Tensor, table: Table, free: torch.Tensor) -> torch.Tensor:
    """(M, n) ``choice`` with its own tokens reordered: two ``free`` positions up to three
    apart swapped, or a run of 3 to ``MAX_SEGMENT`` free positions rotated by one either way;
    only where every token moved is a candidate at its new position."""
    n = choice.numel()
    ids = table.ids[torch.arange(n, device=choice.device), choice].tolist()
    index = [{t: k for k, (t, ok) in enumerate(zip(table.ids[q].tolist(),
                                                   table.valid[q].tolist(), strict=True)) if ok}
             for q in range(n)]
    free_set = set(free.tolist())
    orders: list[dict[int, int]] = []
    for p in sorted(free_set):
        orders += [{p: ids[q], q: ids[p]} for q in range(p + 1, p + 4)
                   if q in free_set and ids[p] != ids[q]]
        for length in range(3, MAX_SEGMENT + 1):
            span = range(p, p + length)
            if not all(q in free_set for q in span):
                break
            seg = ids[p:p + length]
            orders += [dict(zip(span, r, strict=True)) for r in (seg[1:] + seg[:1],
                                                                 seg[-1:] + seg[:-1])
                       if r != seg]
    out = []
    for order in orders:
        if all(t in index[q] for q, t in order.items()):
            row = choice.clone()
            for q, t in order.items():
                row[q] = index[q][t]
            out.append(row)
    return torch.stack(out) if out else choice[None]


def paired(choice: torch.Tensor, rows: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """(M, n) ``choice`` with two neighbouring positions changed together, each to one of its
    ``TOP`` best single substitutions (``rows``, one substitution each, and their ``cost``)."""
    diff = rows != choice
    changed, moved = diff.int().argmax(1), diff.any(1)
    best: dict[int, list[int]] = {}
    for i in torch.argsort(cost).tolist():
        if bool(moved[i]):
            top = best.setdefault(int(changed[i]), [])
            if len(top) < TOP:
                top.append(int(rows[i, int(changed[i])]))
    out = []
    for p, mine in best.items():
        for a in mine:
            for b in best.get(p + 1, []):
                row = choice.clone()
                row[p], row[p + 1] = a, b
                out.append(row)
    return torch.stack(out) if out else choice[None]
