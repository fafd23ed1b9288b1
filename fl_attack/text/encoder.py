"""Sentences of an encoder's update, searched as wholes (bidirectional attention).

In an encoder (BERT, MiniLM) every position attends to the whole sentence, so no prefix can be
checked on its own as in :mod:`fl_attack.text.sequences`. What the first block gives instead,
with learned positions, is the set of tokens seen at each position (:mod:`.tokens`). Two steps
follow:

1. **Layout** (:func:`layout`): how many sentences of which lengths. Every sentence ends with
   the token that ends the longest one (BERT's ``[SEP]``); the positions where it was seen are
   the sentences' last positions, and the lengths must add up to the rank of block 0's
   MLP-input span (one direction per token position). The per-position sets are trusted only
   when they hold as many (token, position) pairs as block 0's span has directions, or a few
   more (``MAX_EXCESS``; the pairs in a linear dependency are then optional): after the
   embeddings' LayerNorm, the span of the pairs ``(a, p), (a, q), (t, q)`` nearly holds
   ``(t, p)`` too (the inputs are close to a sum of a token part and a position part), so once
   tokens repeat across sentences and positions, every token of the batch passes at every
   position and the first block no longer says where the tokens stand.
2. **Search** (:func:`assemble`): one token per sentence and position, every token seen at a
   position used there, chosen to minimise ``Σ log(1 + score)`` of block 0's MLP inputs
   (bidirectional, each sentence on its own) against their span. Steepest descent over three
   moves: swap two sentences' tokens at one position, swap a segment (a prefix or a suffix)
   between two sentences, give a sentence another token seen at that position (while every
   token that must be used there still is). It ends when
   every position of every sentence lies in the span (the batch is found) or no move helps
   (a local minimum: restart from another assignment).

This search is the project's own; DAGER (Petrov et al., 2024, §5) searches encoders' sentences
with other heuristics.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from fl_attack.core.clock import passed
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span

#: Most (token, position) pairs beyond the span's rank that the search takes on: each such
#: pair is one of a few the span cannot tell apart (two sentences sharing a token at two
#: positions make one), and each is tried as optional.
MAX_EXCESS = 4
#: A pair is optional when its weight in a dependency among the pairs exceeds this.
DEPENDENT = 1e-3
#: Most length layouts tried (sentences ending at the same positions in other counts).
MAX_LAYOUTS = 16
#: Restarts of the search per layout, from other initial assignments.
RESTARTS = 6


@dataclass
class Layout:
    """Sentence lengths (longest first) and the token every sentence ends with."""

    lengths: list[int]
    end: int | None


@dataclass
class Found:
    """What :func:`assemble` found.

    Attributes
    ----------
    tokens : list[list[int]]
        One token list per sentence.
    distances : list[list[tuple[float, float]]]
        Per sentence and position, the relative distance of block 0's MLP input and of block
        1's attention input to their spans.
    worst : float
        The largest score (distance over tilt) of any position at block 0's MLP input.
    stopped : str
        ``"complete"`` (every position in the span), ``"budget"`` or ``"ambiguous"`` (the
        search ended in a local minimum on every restart and layout).
    """

    tokens: list[list[int]]
    distances: list[list[tuple[float, float]]]
    worst: float
    stopped: str


@dataclass
class Pairs:
    """The (token, position) pairs of the first block: per position the tokens seen and which
    of them must be used there (those not in any dependency among the pairs)."""

    candidates: list[torch.Tensor]
    required: list[torch.Tensor]

    def is_required(self, token: int, position: int) -> bool:
        hit = self.candidates[position] == token
        return bool(self.required[position][hit].any())


@torch.no_grad()
def pairs(family: Family, candidates: list[torch.Tensor], rank: int) -> Pairs | None:
    """Which pairs the search must use: all when there are as many pairs as the span has
    directions; otherwise those outside every linear dependency among the pairs (the left
    null space of their vectors), or None when more than ``MAX_EXCESS`` pairs are extra."""
    n = sum(int(c.numel()) for c in candidates)
    if n == rank:
        return Pairs(candidates, [torch.ones_like(c, dtype=torch.bool) for c in candidates])
    if n - rank > MAX_EXCESS or n < rank:
        return None
    x = torch.cat([family.attn_input(0, family.embeddings(c, p)) for p, c in
                   enumerate(candidates)]).double()
    x = x / x.norm(dim=1, keepdim=True)
    u, _, _ = torch.linalg.svd(x, full_matrices=True)
    weight = u[:, rank:].norm(dim=1)
    free = (weight > DEPENDENT).split([int(c.numel()) for c in candidates])
    return Pairs(candidates, [~f for f in free])


def layouts(found: Pairs, total: int, batch_size: int | None) -> list[Layout]:
    """The sentence lengths that fit: each ends where the last position's token was seen, the
    lengths add up to ``total`` (the MLP span's rank), every position has at least as many
    sentences as tokens that must be used there (besides the ending ones), ``batch_size``
    sentences if given.
    """
    candidates = found.candidates
    last = candidates[-1].tolist()
    end = last[0] if len(last) == 1 else None
    if end is None:
        return []
    ends = [p for p, c in enumerate(candidates) if end in c.tolist()]
    need = [int(r[c != end].sum()) for c, r in zip(candidates, found.required, strict=True)]
    out: list[Layout] = []

    def walk(i: int, alive: int, used: int, counts: list[int]) -> None:
        if len(out) >= MAX_LAYOUTS:
            return
        if i < 0:
            if used == total and alive and (batch_size is None or alive == batch_size):
                out.append(Layout(sorted((p + 1 for p, k in zip(ends, counts, strict=True)
                                          for _ in range(k)), reverse=True), end))
            return
        p = ends[i]
        top = (total - used) // (p + 1)
        for k in range(0 if not found.is_required(end, p) else 1, top + 1):
            n = alive + k
            lo = ends[i - 1] + 1 if i else 0
            # positions lo..p are alive for n sentences (the k ending at p included)
            if any(need[q] > n - (k if q == p else 0) for q in range(lo, p + 1)):
                continue
            if batch_size is not None and n > batch_size:
                break
            walk(i - 1, n, used + k * (p + 1), [k, *counts])

    walk(len(ends) - 1, 0, 0, [])
    return out


@torch.no_grad()
def mlp_inputs(family: Family, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Block 0's MLP inputs (N, L, d) of N sentences (N, L), each attending to its own length."""
    n, length = tokens.shape
    e = torch.stack([family.embeddings(tokens[:, p], p) for p in range(length)], dim=1)
    q, k, v = family.qkv(family.attn_input(0, e), 0)
    s = torch.einsum("nphd,nqhd->nhpq", q, k) * family.scaling
    keys = torch.arange(length, device=tokens.device)[None] < lengths[:, None]
    s = s.masked_fill(~keys[:, None, None, :], float("-inf"))
    att = torch.einsum("nhpq,nqhd->nphd", torch.softmax(s, dim=-1), v).flatten(2)
    return family.mlp_input(family.after_attention(e, att))


def scores(family: Family, span: Span, tokens: torch.Tensor, lengths: torch.Tensor
            ) -> torch.Tensor:
    """(N, L) scores at block 0's MLP input (0 past each sentence's end)."""
    h = mlp_inputs(family, tokens, lengths)
    _, sc = span.score(h.flatten(0, 1))
    alive = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
    return sc.view(tokens.shape).masked_fill(~alive, 0.0)


def assemble(family: Family, found: Pairs, spans: dict[str, Span | None],
             options: list[Layout], *, deadline: float | None) -> Found:
    """Search each layout (a few restarts each) until a batch whose every position lies in
    block 0's MLP-input span is found; the best batch seen otherwise."""
    span = spans["mlp"]
    best: tuple[float, torch.Tensor, torch.Tensor] | None = None
    stopped = "ambiguous"
    for option in options:
        for seed in range(RESTARTS):
            if passed(deadline):
                stopped = "budget"
                break
            tokens, lengths = _descend(family, span, found, option, seed, deadline)
            worst = float(scores(family, span, tokens, lengths).max())
            if best is None or worst < best[0]:
                best = (worst, tokens, lengths)
            if worst < ACCEPT:
                return finish(family, spans, tokens, lengths, "complete")
        if stopped == "budget":
            break
    if passed(deadline):
        stopped = "budget"
    if best is None:
        return Found([], [], float("inf"), stopped)
    return finish(family, spans, best[1], best[2], stopped)


def finish(family: Family, spans: dict[str, Span | None], tokens: torch.Tensor,
           lengths: torch.Tensor, stopped: str) -> Found:
    """The :class:`Found` of sentences (N, L) of ``lengths``: each position's distances at
    block 0's MLP input and block 1's attention input, and the worst score."""
    h = mlp_inputs(family, tokens, lengths)
    n, length, d = h.shape
    d_mlp, sc = spans["mlp"].score(h.flatten(0, 1))
    d1 = torch.full_like(d_mlp, float("nan"))
    if spans.get("attn1") is not None:
        with torch.no_grad():
            d1 = spans["attn1"].score(family.attn_input(1, family.after_mlp(h.flatten(0, 1))))[0]
    d_mlp, d1, sc = d_mlp.view(n, length), d1.view(n, length), sc.view(n, length)
    out_t, out_d, worst = [], [], 0.0
    for s in range(n):
        k = int(lengths[s])
        out_t.append(tokens[s, :k].tolist())
        out_d.append(list(zip(d_mlp[s, :k].tolist(), d1[s, :k].tolist(), strict=True)))
        worst = max(worst, float(sc[s, :k].max()))
    return Found(out_t, out_d, worst, stopped)


def _start(found: Pairs, option: Layout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An initial assignment: ending tokens fixed, the others spread over the sentences alive
    (the tokens that must be used first)."""
    candidates = found.candidates
    rng = random.Random(seed)
    lengths = option.lengths
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long,
                         device=candidates[0].device)
    fixed = torch.zeros_like(tokens, dtype=torch.bool)
    for p, cand in enumerate(candidates[: max(lengths)]):
        alive = [s for s, n in enumerate(lengths) if n > p]
        ends = [s for s in alive if lengths[s] == p + 1]
        free = [s for s in alive if lengths[s] > p + 1]
        must = [t for t in cand[found.required[p]].tolist() if t != option.end]
        rest = [t for t in cand[~found.required[p]].tolist() if t != option.end]
        for s in ends:
            tokens[s, p], fixed[s, p] = option.end, True
        rng.shuffle(must)
        rng.shuffle(rest)
        toks = must + rest
        for i, s in enumerate(free):
            tokens[s, p] = toks[i % len(toks)] if toks else option.end
    return tokens, fixed


def _moves(tokens: torch.Tensor, fixed: torch.Tensor, lengths: list[int], found: Pairs,
           end: int | None) -> list[tuple[tuple[int, int, int], ...]]:
    """Every move from ``tokens``: (sentence, position, new token) triples applied together."""
    b = len(lengths)
    t = tokens.tolist()
    out = []
    for a, c in itertools.combinations(range(b), 2):
        top = min(lengths[a], lengths[c])
        diff = [q for q in range(top) if not fixed[a, q] and not fixed[c, q] and t[a][q] != t[c][q]]
        for q in diff:
            out.append(((a, q, t[c][q]), (c, q, t[a][q])))
        for p in range(1, top):
            for seg in ([q for q in diff if q >= p], [q for q in diff if q < p]):
                if len(seg) > 1:
                    out.append(tuple(x for q in seg for x in ((a, q, t[c][q]), (c, q, t[a][q]))))
    for p, cand in enumerate(found.candidates[: max(lengths)]):
        free = [s for s in range(b) if lengths[s] > p and not fixed[s, p]]
        for s in free:
            others = [t[x][p] for x in free if x != s]
            if t[s][p] not in others and found.is_required(t[s][p], p):
                continue                      # its token must stay used at p
            out += [((s, p, int(k)),) for k in cand.tolist() if k != t[s][p] and k != end]
    return out


def _descend(family: Family, span: Span, found: Pairs, option: Layout, seed: int,
             deadline: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steepest descent of ``Σ log(1 + score)`` from one initial assignment."""
    tokens, fixed = _start(found, option, seed)
    lengths = torch.tensor(option.lengths, device=tokens.device)
    cost = torch.log1p(scores(family, span, tokens, lengths)).sum(1)
    while not passed(deadline):
        moves = _moves(tokens, fixed, option.lengths, found, option.end)
        if not moves:
            break
        rows, owner, which = [], [], []
        for i, move in enumerate(moves):
            changed: dict[int, torch.Tensor] = {}
            for s, p, k in move:
                changed.setdefault(s, tokens[s].clone())[p] = k
            for s, row in changed.items():
                rows.append(row)
                owner.append(s)
                which.append(i)
        new = torch.log1p(scores(family, span, torch.stack(rows), lengths[owner])).sum(1)
        delta = torch.zeros(len(moves), dtype=new.dtype, device=new.device)
        delta.index_add_(0, torch.tensor(which, device=new.device), new - cost[owner])
        i = int(delta.argmin())
        if float(delta[i]) >= -1e-9:
            break
        for s, p, k in moves[i]:
            tokens[s, p] = k
        cost = torch.log1p(scores(family, span, tokens, lengths)).sum(1)
    return tokens, lengths
