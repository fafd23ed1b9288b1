"""An encoder's sentences searched in a relaxation over the tokens seen at each position.

When tokens repeat across an encoder's sentences and positions, block 0's span no longer says
which token stands where (:mod:`fl_attack.text.encoder`): after the embeddings' LayerNorm the
inputs are nearly a sum of a token part and a position part, so every token of a connected
group of (token, position) pairs passes at every position of the group, and the per-position
candidate sets grow to tens of tokens. Block 0's MLP input still separates: a sentence is one
of the batch only if every one of its positions lies in that span, and with one wrong token
every position of the sentence leaves it (bidirectional attention mixes the whole sentence).

That test needs whole sentences, so it is searched as a continuous problem, one sentence at a
time (sentences pass through the encoder independently):

1. Each position ``p`` of a sentence of length ``n`` holds a distribution ``π_p`` over the
   tokens seen there (the last position: the token every sentence ends with); block 0 reads
   the mixture of their residual streams, queries, keys and values (block 0 itself where
   ``π`` is one-hot).
2. The relaxed cost is ``Σ_p dist(m_p, span)²`` of block 0's MLP inputs ``m_p``, plus a
   penalty on overlap with the sentences already found (else a run of another length is drawn
   to a found sentence with one more ending token). Adam on the logits of ``π`` from random
   starts, up to ``MAX_RUNS`` runs of several lengths side by side. Every start leans toward
   the candidates block 0's own span ranks first at each position (:func:`_prior`): the
   batch's (token, position) pairs lie in it to rounding, those it only nearly holds a few
   times farther, so the ranking is a hint, the span test the proof.
3. Every ``CHECK`` steps the most likely token of each position forms a sentence, kept when
   every position lies in the span (:data:`fl_attack.text.span.ACCEPT`). For the ``POLISH``
   lengths whose best run lies nearest the span, the per-position vote of their runs and
   their best run are also finished by local moves (:mod:`fl_attack.text.polish`: runs of
   one length settle a few tokens from a sentence, each at different positions), and so is
   every run about to restart. A run that found one, reached ``STEPS`` or stopped
   improving (``PLATEAU``) restarts from new random logits, a share ``FOCUS`` of the
   restarts at those lengths, tilted toward the tokens their runs agree on. The search ends
   when the sentences found fill the MLP span's rank (every position of the batch accounted
   for), at its budget, or after ``IDLE_STEPS`` without a new one.

The lengths tried are the positions where the ending token was seen, only those that still
fit in the positions not yet accounted for, a third of the restarts at the length that fills
them; the ends are ranked by the ending token's score at block 0 (:func:`_ends`: the batch's
own came first in every batch measured) and the ``r``-th is tried ``1 / (r + 1)`` as often
as the first. A relaxation like this is in the spirit of the gradient-matching attacks (TAG, LAMP),
but its cost is the span test, whose zero is exact, and its tokens are those the first block
allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fl_attack.core.clock import passed
from fl_attack.text import encoder, polish
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span
from fl_attack.text.table import Table, build, mixed

#: Adam steps between two readings of the most likely sentences.
CHECK = 100
#: Steps after which a run that found nothing is restarted.
STEPS = 600
#: Adam's step size on the logits.
LEARNING_RATE = 0.1
#: Spread of the starting logits (wide: the starts begin near different sentences).
INIT_SPREAD = 3.0
#: A run whose cost fell by less than this factor over ``CHECK`` steps (after its first
#: ``2 * CHECK``) has settled in a local minimum and is restarted.
PLATEAU = 0.95
#: Runs per possible sentence length, side by side.
STARTS = 4
#: Steps without a new sentence after which the search gives up.
IDLE_STEPS = 6000
#: Most runs side by side.
MAX_RUNS = 64
#: Weight of the overlap penalty against the sentences found.
OVERLAP = 0.1
#: Lengths whose runs are finished by substitutions (:mod:`.polish`) at each check, those
#: whose best run has the lowest cost per position (see :func:`_starts`).
POLISH = 4
#: Share of the restarts that go to those lengths (the rest cycle over every length).
FOCUS = 0.5
#: A restart at such a length starts tilted by ``LEAN`` toward each token at least
#: ``AGREED`` of that length's better runs hold at its position.
AGREED = 0.75
LEAN = 2 * INIT_SPREAD
#: Weight of block 0's ranking of the candidates in every start (:func:`_prior`).
PRIOR = 3.0


@dataclass
class Relaxed:
    """What :func:`search` found.

    Attributes
    ----------
    sentences : list[list[int]]
        Distinct sentences whose every position lies in block 0's MLP-input span, longest
        first.
    stopped : str
        ``"complete"`` (their positions fill the span's rank), ``"budget"``, or
        ``"ambiguous"`` (``IDLE_STEPS`` steps without a new sentence, or no length left
        that a sentence can end at).
    restarts : int
        Runs restarted (after finding a sentence or ``STEPS`` steps without one).
    """

    sentences: list[list[int]] = field(default_factory=list)
    stopped: str = "ambiguous"
    restarts: int = 0


def _overlap(pi: torch.Tensor, table: Table, alive: torch.Tensor, found: list[list[int]]
             ) -> torch.Tensor:
    """(N,) per found sentence, the squared mean probability of its tokens at its positions
    (over the positions both sentences have)."""
    out = pi.new_zeros(pi.shape[0])
    for sent in found:
        m = min(pi.shape[1], len(sent))
        hit = (table.ids[:m] == torch.tensor(sent[:m], device=pi.device)[:, None]) \
            & table.valid[:m]                                               # (m, K)
        both = alive[:, :m].to(pi.dtype)
        share = ((pi[:, :m] * hit).sum(-1) * both).sum(-1) / both.sum(-1).clamp_min(1)
        out = out + share ** 2
    return out


@dataclass
class _Pool:
    """Relaxed searches run side by side, each restarted when it ends: its logits (N, L, K)
    over the candidates, Adam's moments and step count, its sentence length and age, and the
    tilt (L, K) every start gets (:func:`_prior`)."""

    logits: torch.Tensor
    lengths: torch.Tensor
    mean: torch.Tensor
    square: torch.Tensor
    steps: torch.Tensor
    prior: torch.Tensor

    @classmethod
    def new(cls, table: Table, size: int, ends: list[int], left: int, end: int | None,
            generator: torch.Generator, prior: torch.Tensor | None = None) -> _Pool:
        """``size`` runs, their lengths cycling over the ``ends`` that fit in ``left``."""
        shape = (size, *table.ids.shape)
        pool = cls(table.stream.new_zeros(shape),
                   torch.zeros(size, dtype=torch.long, device=table.ids.device),
                   *(table.stream.new_zeros(shape) for _ in range(2)),
                   torch.zeros(size, dtype=torch.long, device=table.ids.device),
                   table.stream.new_zeros(table.ids.shape) if prior is None else
                   prior.to(table.stream.dtype))
        pool.restart(list(range(size)), _lengths(ends, size, left), table, end, generator)
        return pool

    def restart(self, rows: list[int], lengths: list[int], table: Table, end: int | None,
                generator: torch.Generator) -> None:
        """New random starts for ``rows``, with sentences of ``lengths``."""
        idx = torch.tensor(rows, device=self.logits.device)
        self.lengths[idx] = torch.tensor(lengths, device=self.logits.device)
        width = self.logits.shape[1]
        if max(lengths) > width:       # positions dropped by trim() are needed again
            grow = (0, 0, 0, max(lengths) - width)
            self.logits = torch.nn.functional.pad(self.logits, grow, value=float("-inf"))
            self.mean, self.square = (torch.nn.functional.pad(t, grow) for t in
                                      (self.mean, self.square))
            width = max(lengths)
        mask = table.valid[:width].expand(len(rows), -1, -1).clone()
        last = self.lengths[idx] - 1
        ending = table.ids[last] == end if end is not None else \
            torch.isin(table.ids[last], table.ids[-1][table.valid[-1]])
        mask[torch.arange(len(rows)), last] &= ending
        init = torch.randn(mask.shape, generator=generator).to(self.logits) * INIT_SPREAD
        init = init + self.prior[:width]
        self.logits[idx] = init.masked_fill(~mask, float("-inf"))
        self.mean[idx], self.square[idx], self.steps[idx] = 0.0, 0.0, 0

    def lean(self, rows: list[int], votes: dict[int, tuple[torch.Tensor, torch.Tensor]]
             ) -> None:
        """Tilt the new starts of ``rows`` whose length has a vote (candidate, share per
        position) toward the candidates at least ``AGREED`` of the voters hold."""
        for i in rows:
            length = int(self.lengths[i])
            if length in votes:
                vote, share = votes[length]
                at = torch.nonzero(share >= AGREED).flatten()
                self.logits[i, at, vote[at]] += LEAN

    def trim(self) -> None:
        """Drop the positions past the longest run's sentence."""
        width = int(self.lengths.max())
        if width < self.logits.shape[1]:
            self.logits, self.mean, self.square = (t[:, :width].contiguous() for t in
                                                   (self.logits, self.mean, self.square))

    def alive(self) -> torch.Tensor:
        """(N, L) the positions inside each run's sentence."""
        width = self.logits.shape[1]
        return torch.arange(width, device=self.lengths.device)[None] < self.lengths[:, None]

    def step(self, grad: torch.Tensor) -> None:
        """One Adam step (each run's own step count for the bias correction)."""
        b1, b2 = 0.9, 0.999
        self.steps += 1
        grad = torch.nan_to_num(grad, nan=0.0)
        self.mean.mul_(b1).add_(grad, alpha=1 - b1)
        self.square.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        t = self.steps.to(grad.dtype)[:, None, None]
        m = self.mean / (1 - b1 ** t)
        v = self.square / (1 - b2 ** t)
        self.logits -= LEARNING_RATE * m / (v.sqrt() + 1e-8)


def _cost(family: Family, span: Span, table: Table, pool: _Pool, found: list[list[int]]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's relaxed cost (N,) and its gradient with respect to the pool's logits."""
    logits = pool.logits.detach().requires_grad_()
    alive = pool.alive()
    with torch.enable_grad():
        pi = torch.softmax(logits, -1)
        cost = (span.relative_residual(mixed(family, table, pi, alive)) * alive).sum(-1)
        if found:
            cost = cost + OVERLAP * _overlap(pi, table, alive, found)
        # only the logits' gradient: the model's parameters are the caller's
        (grad,) = torch.autograd.grad(cost.sum(), [logits])
    return cost.detach(), grad


def _rounded(table: Table, pool: _Pool) -> torch.Tensor:
    """(N, L) each run's most likely sentence."""
    choice = pool.logits.argmax(-1)
    return torch.gather(table.ids[:choice.shape[1]].expand(len(choice), -1, -1), 2,
                        choice[..., None])[..., 0]


@torch.no_grad()
def _exact(family: Family, span: Span, table: Table, pool: _Pool) -> dict[int, list[int]]:
    """Per run, its most likely sentence if every position of it lies in the span."""
    tokens = _rounded(table, pool)
    ok = (encoder.scores(family, span, tokens, pool.lengths) < ACCEPT).all(-1)
    return {i: tokens[i, :int(pool.lengths[i])].tolist()
            for i in torch.nonzero(ok).flatten().tolist()}


def _ranked(pool: _Pool, cost: torch.Tensor) -> list[int]:
    """The lengths the runs try, by their best run's cost per position, lowest first (the
    batch's lengths stand out once their runs have settled)."""
    per = cost / pool.lengths
    best: dict[int, float] = {}
    for length, c in zip(pool.lengths.tolist(), per.tolist(), strict=True):
        best[length] = min(c, best.get(length, float("inf")))
    return sorted(best, key=best.__getitem__)


def _vote(table: Table, pool: _Pool, cost: torch.Tensor, length: int
          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The vote of the better half of the runs of ``length``: per position the candidate most
    of them hold (runs of one sentence's length err at different positions) and the share
    that holds it, and the best run."""
    runs = torch.nonzero(pool.lengths == length).flatten()
    runs = runs[torch.argsort(cost[runs])]
    better = runs[:max(1, (len(runs) + 1) // 2)]
    votes = torch.nn.functional.one_hot(pool.logits[better, :length].argmax(-1),
                                        table.ids.shape[1]).sum(0)
    top = votes.max(-1)
    return top.indices, top.values / len(better), int(runs[0])


def _starts(table: Table, pool: _Pool, cost: torch.Tensor, ranked: list[int]
            ) -> list[tuple[int, torch.Tensor]]:
    """Sentences to polish, each with the run it is credited to: for the first ``POLISH``
    lengths ``ranked`` (:func:`_ranked`), the :func:`_vote` of that length's runs and its best
    run's own most likely sentence."""
    out = []
    for length in ranked[:POLISH]:
        vote, _, best = _vote(table, pool, cost, length)
        out.append((best, vote))
        out.append((best, pool.logits[best, :length].argmax(-1)))
    return out


def _polished(family: Family, span: Span, table: Table, pool: _Pool, cost: torch.Tensor,
              ranked: list[int], ending: list[int], skip: dict[int, list[int]],
              tried: set[tuple[int, ...]], deadline: float | None) -> dict[int, list[int]]:
    """Per run, the sentence :func:`polish.polish` reaches from one of :func:`_starts` or
    from the most likely sentence of a run about to restart (``ending``); each start once
    (``tried`` is updated)."""
    out: dict[int, list[int]] = {}
    last = [(i, pool.logits[i, :int(pool.lengths[i])].argmax(-1)) for i in ending]
    for i, start in _starts(table, pool, cost, ranked) + last:
        key = tuple(start.tolist())
        if i in skip or i in out or key in tried:
            continue
        tried.add(key)
        got = polish.polish(family, span, table, start, deadline=deadline)
        if got is not None:
            out[i] = got
    return out


def _ending(pool: _Pool, cost: torch.Tensor, before: torch.Tensor | None) -> list[int]:
    """The runs to restart: those at ``STEPS`` steps, or past their first ``2 * CHECK`` with a
    cost that fell by less than ``PLATEAU`` since the last check (``before``)."""
    stale = pool.steps >= STEPS
    if before is not None and before.shape == cost.shape:
        stale |= (pool.steps >= 2 * CHECK) & (cost > PLATEAU * before)
    return torch.nonzero(stale).flatten().tolist()


def _restart(table: Table, pool: _Pool, cost: torch.Tensor, ranked: list[int],
             done: list[int], fit: list[int], left: int, end: int | None,
             generator: torch.Generator) -> None:
    """Restart the runs ``done``: their lengths cycle over the ends that ``fit`` (see
    :func:`_lengths`), a share ``FOCUS`` of them at the first ``POLISH`` lengths ``ranked``
    that fit, those tilted toward their length's :func:`_vote`."""
    lengths = _lengths(fit, len(done), left)
    focus = [n for n in ranked if n - 1 in fit][:POLISH]
    for j in range(0, int(FOCUS * len(done)) if focus else 0):
        lengths[j] = focus[j % len(focus)]
    votes = {n: _vote(table, pool, cost, n)[:2] for n in focus}
    pool.restart(done, lengths, table, end, generator)
    pool.lean(done, votes)
    pool.trim()


def search(family: Family, candidates: list[torch.Tensor], span: Span, *, end: int | None,
           total: int, deadline: float | None, seed: int = 0,
           first: Span | None = None) -> Relaxed:
    """Sentences of an encoder's batch from the tokens seen at each position.

    Parameters
    ----------
    family
        The encoder's adapter.
    candidates
        Per position, the token ids the first block allows there (:mod:`.tokens`).
    span
        Block 0's MLP-input span.
    end
        The token every sentence ends with, or None when the last position holds several
        candidates: the runs then end with any token seen at the last position (the longest
        sentence ends there), and the first sentence found gives every sentence's.
    total
        The span's rank: the batch's distinct token positions, which the sentences found must
        fill.
    deadline
        ``time.perf_counter()`` value after which the search stops as ``"budget"``.
    seed
        Seeds the starting points.
    first
        Block 0's attention-input span, if read: it ranks the positions a sentence may end
        at (:func:`_ends`), and the lengths tried follow that rank.
    """
    out = Relaxed()
    if not candidates:
        return out
    table = build(family, candidates)
    generator = torch.Generator().manual_seed(seed)
    scores = _scores(family, first, table)
    ends, prior = _ends(table, candidates, end, scores), _prior(scores)
    pool = _Pool.new(table, min(MAX_RUNS, STARTS * len(ends)), ends, total, end, generator,
                     prior)
    idle, before, tried = 0, None, set()
    while not passed(deadline) and idle < IDLE_STEPS:
        for _ in range(CHECK):
            cost, grad = _cost(family, span, table, pool, out.sentences)
            pool.step(grad)
            if passed(deadline):
                break
        idle += CHECK
        exact = _exact(family, span, table, pool)
        ranked = _ranked(pool, cost)
        ending_runs = _ending(pool, cost, before)
        exact.update(_polished(family, span, table, pool, cost, ranked, ending_runs, exact,
                               tried, deadline))
        for sent in exact.values():
            if sent not in out.sentences:
                out.sentences.append(sent)
                idle = 0
        left = total - sum(len(x) for x in out.sentences)
        if left <= 0:
            break
        if end is None and out.sentences:
            end = out.sentences[0][-1]
            ends = [p for p in _ends(table, candidates, end, scores) if p < left]
            if not ends:
                break
            pool = _Pool.new(table, min(MAX_RUNS, STARTS * len(ends)), ends, left, end,
                             generator, prior)
            idle = 0
            continue
        done = sorted(set(exact) | set(ending_runs))
        fit = [p for p in ends if p < left]
        if not fit:
            break
        if done:
            out.restarts += len(done)
            _restart(table, pool, cost, ranked, done, fit, left, end, generator)
        before = cost
    left = total - sum(len(x) for x in out.sentences)
    out.stopped = ("complete" if left == 0 else "budget" if passed(deadline) else
                   "ambiguous")
    out.sentences.sort(key=len, reverse=True)
    return out


@torch.no_grad()
def _scores(family: Family, first: Span | None, table: Table) -> torch.Tensor | None:
    """(L, K) each candidate's score at block 0's attention-input span ``first`` (inf where
    padded), which ranks the ends (:func:`_ends`) and tilts the starts (:func:`_prior`); None
    without ``first``."""
    if first is None:
        return None
    length, k = table.ids.shape
    score = first.score(family.attn_input(0, table.stream.flatten(0, 1)))[1].view(length, k)
    return score.clamp_min(1e-12).masked_fill(~table.valid, float("inf"))


def _ends(table: Table, candidates: list[torch.Tensor], end: int | None,
          scores: torch.Tensor | None) -> list[int]:
    """The positions a sentence may end at: where ``end`` was seen, or, with ``end`` unknown,
    where a token seen at the last position was (the ending token is one of those: the
    longest sentence ends there), last first.

    With ``end`` known and the candidates' :func:`_scores`, they come ordered by the score of
    ``end`` at each position, lowest first: the batch's own (token, position) pairs lie in
    block 0's attention-input span to rounding, those it only nearly holds
    (:mod:`fl_attack.text.encoder`) a few times farther. Measured on MiniLM (8 batches of 4
    WordNet glosses of 16-32 tokens, the ending token seen at 3-20 positions), the sentences'
    ends always came first.
    """
    last = set(candidates[-1].tolist()) if end is None else {end}
    out = [p for p, c in enumerate(candidates) if last & set(c.tolist())][::-1]
    if end is None or scores is None or not out:
        return out
    at = torch.tensor(out, device=scores.device)
    score = scores[at].masked_fill(table.ids[at] != end, float("inf")).min(1).values
    return [out[i] for i in torch.argsort(score, stable=True).tolist()]


def _prior(scores: torch.Tensor | None) -> torch.Tensor | None:
    """(L, K) the tilt of every start: ``-PRIOR * log(score / best score)`` of each candidate
    (:func:`_scores`; 0 for the position's best candidate and where padded); None without
    scores."""
    if scores is None:
        return None
    tilt = -PRIOR * torch.log(scores / scores.min(1, keepdim=True).values)
    return tilt.masked_fill(scores.isinf(), 0.0)


def _lengths(ends: list[int], count: int, left: int) -> list[int]:
    """``count`` sentence lengths over the ends that fit in ``left`` positions, the ``r``-th
    end (best first, :func:`_ends`) ``1 / (r + 1)`` times as often as the first; a third of
    them ``left`` itself where a sentence can end there (one sentence left)."""
    fit = [p + 1 for p in ends if p + 1 <= left] or [min(ends) + 1]
    share = [1 / (r + 1) for r in range(len(fit))]
    credit, total = [0.0] * len(fit), sum(share)
    out = []
    for _ in range(count):          # a smooth weighted round robin
        credit = [c + w for c, w in zip(credit, share, strict=True)]
        i = max(range(len(fit)), key=credit.__getitem__)
        credit[i] -= total
        out.append(fit[i])
    if left in fit and len(fit) > 1:
        out[::3] = [left] * len(out[::3])
    return out


def ending(family: Family, last: torch.Tensor) -> int | None:
    """The token every sentence ends with: the only one seen at the last position (``last``),
    else the config's ``sep_token_id`` where it was seen there, else unknown (None)."""
    if last.numel() == 1:
        return int(last[0])
    sep = getattr(getattr(family.model, "config", None), "sep_token_id", None)
    return int(sep) if isinstance(sep, int) and sep in last.tolist() else None


def read(family: Family, candidates: list[torch.Tensor], spans: dict[str, Span | None], *,
         deadline: float | None) -> encoder.Found:
    """:func:`search` on block 0's MLP-input span, as the encoder path's :class:`Found`."""
    span = spans.get("mlp")
    if span is None:
        raise ValueError("the relaxed search reads block 0's MLP-input span: it is missing")
    got = search(family, candidates, span, end=ending(family, candidates[-1]),
                 total=span.rank, deadline=deadline, first=spans.get("attn0"))
    if not got.sentences:
        return encoder.Found([], [], float("inf"), got.stopped)
    width = max(len(s) for s in got.sentences)
    device = candidates[0].device
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in got.sentences], device=device)
    lengths = torch.tensor([len(s) for s in got.sentences], device=device)
    return encoder.finish(family, spans, tokens, lengths, got.stopped)
