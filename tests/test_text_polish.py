"""Local moves finishing an encoder sentence (``fl_attack.text.polish``).

Contracts: the neighbours of a sentence are it with one of the positions named replaced by a
candidate there, each candidate once; a sentence one substitution from one of the batch,
whatever position it is wrong at, is finished (the batch's sentence is among its neighbours
and nearest the span of them all); a sentence of the batch is returned as it is; the
combined moves apply each position's best improving substitution, best first, never two
adjacent positions; the rearrangements are the sentence's own tokens swapped (up to three
apart) or a segment rotated by one, at free positions and only where each token moved is a
candidate there; the paired moves change two neighbours to their best single substitutions;
a sentence with two neighbours swapped or a segment shifted by one is finished in one step
(every token of the bag a candidate everywhere); whatever polish returns passes the span
test, keeps the ending token and differs from where it started only where the first block
left a choice; no step starts after the deadline.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fl_attack.testbed import text as tt  # noqa: E402
from fl_attack.text import polish  # noqa: E402
from fl_attack.text.attack import _eval, _spans, _validated  # noqa: E402
from fl_attack.text.encoder import scores  # noqa: E402
from fl_attack.text.families import family_of  # noqa: E402
from fl_attack.text.span import ACCEPT  # noqa: E402
from fl_attack.text.table import build  # noqa: E402
from fl_attack.text.tokens import filter_tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CLS, SEP = 1, 2


def _batch() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    inner = (torch.randperm(487, generator=g)[:21] + 3).tolist()
    truth = [[CLS, *inner[:9], SEP], [CLS, *inner[9:15], SEP], [CLS, *inner[15:], SEP]]
    truth[1][2], truth[2][3] = truth[0][2], truth[0][5]      # tokens shared across sentences
    return truth


def _setting():
    truth = _batch()
    model = tt.tiny_bert()
    grads = tt.classification_gradients(model, truth, [0, 1, 0])
    family = family_of(model)
    with _eval(model):
        spans, _ = _spans(family, _validated(family, grads), None)
        bag = filter_tokens(family, spans["attn0"], deadline=None)
    return truth, family, spans["mlp"], build(family, bag.candidates)


def _indices(table, sentence: list[int]) -> torch.Tensor:
    return torch.tensor([int(torch.nonzero(table.ids[p] == t)[0])
                         for p, t in enumerate(sentence)])


def _passes(family, span, sentence: list[int]) -> bool:
    with torch.no_grad():
        sc = scores(family, span, torch.tensor([sentence]), torch.tensor([len(sentence)]))
    return bool((sc < ACCEPT).all())


def test_the_neighbours_change_one_of_the_positions_named():
    valid = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]]).bool()
    choice = torch.tensor([0, 1, 1, 0])
    rows = polish.neighbours(choice, valid, torch.tensor([2, 1]))
    assert len(rows) == int(valid[1:3].sum())
    assert ((rows != choice).sum(1) <= 1).all()
    assert (rows[:, [0, 3]] == 0).all()
    assert {tuple(r) for r in rows.tolist()} == {
        (0, 1, 1, 0), (0, 0, 1, 0), (0, 2, 1, 0), (0, 1, 0, 0)}


def test_combined_moves_take_the_best_improving_substitutions_never_adjacent():
    choice = torch.tensor([0, 0, 0, 0, 0, 0])
    # one substitution each: (position, candidate, cost); the current cost is 10
    subs = [(1, 1, 4.0), (1, 2, 3.0), (2, 1, 2.0), (3, 1, 5.0), (4, 2, 9.0), (4, 1, 12.0),
            (5, 1, 11.0)]
    rows = choice.repeat(len(subs), 1)
    for i, (p, k, _) in enumerate(subs):
        rows[i, p] = k
    cost = torch.tensor([c for *_, c in subs])
    moves = polish.combined(choice, rows, cost, 10.0)
    # by gain: position 2 (cost 2), then 1 (adjacent to 2: left out), 3 (adjacent), 4 (cost 9)
    assert moves.tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 1, 0, 2, 0]]
    assert polish.combined(choice, rows, cost, 1.0).tolist() == [choice.tolist()]


def test_one_wrong_token_is_replaced_wherever_it_is():
    truth, family, span, table = _setting()
    tried = 0
    for sent in truth:
        assert _passes(family, span, sent)                   # the premise: the batch passes
        right = _indices(table, sent)
        assert polish.polish(family, span, table, right) == sent
        for q in range(1, len(sent) - 1):
            others = [k for k in torch.nonzero(table.valid[q]).flatten().tolist()
                      if k != int(right[q])]
            for k in others[:2]:
                start = right.clone()
                start[q] = k
                tried += 1
                got = polish.polish(family, span, table, start)
                assert got is not None, (sent, q)
                assert _passes(family, span, got) and got[-1] == SEP
                assert got in truth
                assert sum(a != b for a, b in zip(
                    got, table.ids[torch.arange(len(sent)), start].tolist(), strict=True)) == 1
    assert tried >= 3          # the shared tokens give those positions other candidates


def test_what_polish_returns_passes_and_is_within_reach():
    truth, family, span, table = _setting()
    g = torch.Generator().manual_seed(0)
    for sent in truth:
        n = len(sent)
        for _ in range(3):
            start = torch.randint(0, 1 << 30, (n,), generator=g) % table.valid[:n].sum(1)
            start[-1] = _indices(table, sent)[-1]
            got = polish.polish(family, span, table, start)
            if got is not None:
                tokens = table.ids[torch.arange(n), start].tolist()
                assert _passes(family, span, got) and got[-1] == SEP
                fixed = table.valid[:n].sum(1) < 2
                assert all(a == b for a, b, f in zip(got, tokens, fixed.tolist(), strict=True)
                           if f)


def test_polish_starts_no_step_after_its_deadline():
    truth, family, span, table = _setting()
    starts = []
    for sent in truth:
        right = _indices(table, sent)
        for q in range(1, len(sent) - 1):
            if int(table.valid[q].sum()) > 1:
                start = right.clone()
                start[q] = (int(right[q]) + 1) % int(table.valid[q].sum())
                starts.append(start)
    done = [s for s in starts if polish.polish(family, span, table, s) is not None]
    assert done                                     # some are finished without a deadline
    assert all(polish.polish(family, span, table, s, deadline=0.0) is None for s in done)


def _tiny_table(tokens: list[list[int]]):
    """A table of 3 positions whose candidates are ``tokens`` (token ids 0-9, no model)."""
    from fl_attack.text.table import Table

    k = max(map(len, tokens))
    ids = torch.tensor([t + [0] * (k - len(t)) for t in tokens])
    valid = torch.tensor([[True] * len(t) + [False] * (k - len(t)) for t in tokens])
    z = torch.zeros(len(tokens), k, 1)
    return Table(z, (z, z, z), ids, valid)


def test_rearrangements_are_swaps_and_rotations_of_candidates_at_free_positions():
    # position p holds candidates ids[p]; the sentence is 5, 6, 7, 8, 9 (index 0 everywhere)
    cands = [[5], [6, 7, 8], [7, 6, 8], [8, 6, 7, 9], [9]]
    table = _tiny_table(cands)
    choice = torch.zeros(5, dtype=torch.long)
    rows = polish.rearranged(choice, table, torch.tensor([1, 2, 3]))
    got = {tuple(table.ids[torch.arange(5), r].tolist()) for r in rows}
    assert got == {(5, 7, 6, 8, 9), (5, 8, 7, 6, 9), (5, 6, 8, 7, 9),   # swaps
                   (5, 7, 8, 6, 9), (5, 8, 6, 7, 9)}                    # rotations of 1-3
    # 9 is no candidate at positions 1-3 and position 4 is not free: nothing moves it
    assert all(r[0] == 0 and r[4] == 0 for r in rows.tolist())


def test_paired_moves_change_two_neighbours_to_their_best_substitutions():
    choice = torch.zeros(4, dtype=torch.long)
    subs = [(1, 1, 3.0), (1, 2, 1.0), (2, 1, 2.0), (3, 1, 0.5)]   # (position, candidate, cost)
    rows = choice.repeat(len(subs), 1)
    for i, (p, k, _) in enumerate(subs):
        rows[i, p] = k
    cost = torch.tensor([c for *_, c in subs])
    got = {tuple(r) for r in polish.paired(choice, rows, cost).tolist()}
    assert got == {(0, 1, 1, 0), (0, 2, 1, 0), (0, 0, 1, 1)}


def test_swapped_tokens_and_a_shifted_segment_are_finished_in_one_step(monkeypatch):
    # one step: substitutions alone cannot change neighbouring positions together
    monkeypatch.setattr(polish, "STEPS", 1)
    truth, family, span, _ = _setting()
    bag = sorted({t for s in truth for t in s})
    n = max(map(len, truth))
    table = build(family, [torch.tensor(bag)] * n)
    sent = truth[0]
    right = _indices(table, sent)
    swapped, shifted = right.clone(), right.clone()
    swapped[[2, 3]] = right[[3, 2]]
    shifted[3:8] = right[[4, 5, 6, 7, 3]]
    for start in (swapped, shifted):
        assert polish.polish(family, span, table, start) == sent
