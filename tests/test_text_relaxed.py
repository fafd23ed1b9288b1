"""The relaxed search over whole sentences of an encoder (``fl_attack.text.relaxed``).

Contracts: the relaxation at one-hot weights is block 0 itself; every sentence the search
returns lies, position by position, in block 0's MLP-input span (with the ending token
unknown, or known and the ends and starts ranked by block 0's span); a search that ends
``complete`` has filled the span's rank with the batch's sentences; the ends come ordered by
the ending token's score at block 0, and the lengths tried follow that order, the ``r``-th
``1 / (r + 1)`` as often as the first; the starts' tilt is 0 at each position's best
candidate and negative elsewhere; the caller's model gains no
gradient; the search ends at its deadline; through ``invert_text`` a batch whose first block
does not separate the positions is certified only when exact, and otherwise says so
(``limit == "positions"``).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers")

from fl_attack.testbed import text as tt  # noqa: E402
from fl_attack.text import invert_text, relaxed  # noqa: E402
from fl_attack.text.attack import _eval, _spans, _validated  # noqa: E402
from fl_attack.text.encoder import mlp_inputs, pairs  # noqa: E402
from fl_attack.text.families import family_of  # noqa: E402
from fl_attack.text.span import ACCEPT  # noqa: E402
from fl_attack.text.table import build, chosen, mixed  # noqa: E402
from fl_attack.text.tokens import filter_tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CLS, SEP = 1, 2


def _shared(seed: int, lengths: list[int]) -> list[list[int]]:
    """``[CLS] ... [SEP]`` sentences of random tokens, three of them repeated at other
    positions of other sentences (with the ends at several positions, the first block then
    does not say which token stands where)."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.randperm(487, generator=g)[: sum(n - 2 for n in lengths)] + 3
    out, at = [], 0
    for n in lengths:
        out.append([CLS, *inner[at: at + n - 2].tolist(), SEP])
        at += n - 2
    out[1][1], out[2][2], out[1][5] = out[0][1], out[0][4], out[2][3]
    return out


def _setting(truth: list[list[int]]):
    model = tt.tiny_bert()
    grads = tt.classification_gradients(model, truth, [i % 2 for i in range(len(truth))])
    family = family_of(model)
    with _eval(model):
        spans, _ = _spans(family, _validated(family, grads), None)
        bag = filter_tokens(family, spans["attn0"], deadline=None)
    return model, family, spans, bag


def test_the_relaxation_at_one_hot_weights_is_block_0():
    truth = _shared(0, [9, 7, 6])
    _, family, _, bag = _setting(truth)
    table = build(family, bag.candidates)
    width = max(map(len, truth))
    pi = torch.zeros(len(truth), width, table.ids.shape[1])
    tokens = torch.zeros(len(truth), width, dtype=torch.long)
    for s, sent in enumerate(truth):
        for p, t in enumerate(sent):
            pi[s, p, int(torch.nonzero(table.ids[p] == t)[0])] = 1.0
            tokens[s, p] = t
    lengths = torch.tensor([len(s) for s in truth])
    alive = torch.arange(width)[None] < lengths[:, None]
    with torch.no_grad():
        got = mixed(family, table, pi, alive)
        at = chosen(family, table, pi.argmax(-1), alive)
        want = mlp_inputs(family, tokens, lengths)
    assert torch.allclose(got[alive], want[alive], atol=1e-5, rtol=1e-5)
    assert torch.allclose(at[alive], want[alive], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[12, 8, 5], [9, 9, 7, 5]])
@pytest.mark.parametrize("known_end", [False, True])
def test_every_sentence_returned_lies_in_the_span_and_complete_means_the_batch(lengths,
                                                                                known_end):
    truth = _shared(5, lengths)
    model, family, spans, bag = _setting(truth)
    assert pairs(family, bag.candidates, spans["attn0"].rank) is None   # not separated
    got = relaxed.search(family, bag.candidates, spans["mlp"], end=SEP if known_end else None,
                         total=spans["mlp"].rank, deadline=time.perf_counter() + 60,
                         first=spans["attn0"] if known_end else None)
    assert all(p.grad is None for p in model.parameters())
    for sent in got.sentences:
        n = len(sent)
        with torch.no_grad():
            h = mlp_inputs(family, torch.tensor([sent]), torch.tensor([n]))
        assert float(spans["mlp"].score(h[0])[1].max()) < ACCEPT
    assert len({tuple(s) for s in got.sentences}) == len(got.sentences)
    if got.stopped == "complete":
        assert sum(map(len, got.sentences)) == spans["mlp"].rank
        assert sorted(got.sentences) == sorted(truth)


def test_the_search_ends_at_its_deadline():
    truth = _shared(5, [12, 8, 5])
    _, family, spans, bag = _setting(truth)
    t0 = time.perf_counter()
    got = relaxed.search(family, bag.candidates, spans["mlp"], end=SEP,
                         total=spans["mlp"].rank, deadline=t0)
    assert got.stopped in {"budget", "complete"}
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("lengths", [[12, 8, 5], [10, 9, 7, 6]])
def test_unseparated_positions_are_certified_only_when_exact(lengths):
    truth = _shared(2, lengths)
    model = tt.tiny_bert()
    labels = [i % 2 for i in range(len(truth))]
    rec = invert_text(model, tt.classification_gradients(model, truth, labels))
    assert rec.bag == sorted({t for s in truth for t in s})
    if rec.certified:
        assert sorted(rec.token_ids) == sorted(truth)
        assert sorted(zip(rec.token_ids, rec.labels, strict=True)) == \
            sorted(zip(truth, labels, strict=True))
    else:
        assert rec.limit == "positions" or rec.stopped != "complete", rec.reason
        assert all(s in truth for s in rec.token_ids)


def test_the_ending_token_is_the_configs_separator_where_it_was_seen():
    model = tt.tiny_bert()
    family = family_of(model)
    last = torch.tensor([7, SEP, 11])
    assert relaxed.ending(family, torch.tensor([SEP])) == SEP            # the only token there
    assert relaxed.ending(family, last) is None                          # not set: unknown
    model.config.sep_token_id = SEP
    assert relaxed.ending(family, last) == SEP
    assert relaxed.ending(family, torch.tensor([7, 11])) is None         # set, but not seen there


def _pool(size: int):
    """A table of a tiny encoder's candidates and ``size`` runs of length 5 over it."""
    _, family, _, bag = _setting(_shared(5, [12, 8, 5]))
    table = build(family, bag.candidates)
    g = torch.Generator().manual_seed(0)
    return table, relaxed._Pool.new(table, size, [4], 5, SEP, g), g


def test_a_trimmed_pool_grows_again_for_a_longer_restart():
    table, pool, g = _pool(4)
    pool.trim()
    assert pool.logits.shape[1] == 5
    pool.restart([1], [12], table, SEP, g)
    assert pool.logits.shape[1] == 12 and pool.mean.shape == pool.logits.shape
    assert bool(torch.isinf(pool.logits[0, 5:]).all())           # other runs: nothing there
    assert int(pool.alive()[1].sum()) == 12


def test_the_vote_of_a_lengths_better_runs_and_the_lean_toward_it():
    table, pool, _ = _pool(6)
    pool.lengths[:] = 5
    k = table.ids.shape[1]
    picks = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                          [0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 0]])
    pool.logits = torch.nn.functional.one_hot(picks, k).float()
    pool.logits[~table.valid[:5].expand(6, -1, -1)] = float("-inf")
    cost = torch.tensor([0.1, 0.2, 0.3, 0.9, 0.8, 0.7])           # the first three vote
    valid = table.valid[:5].sum(1) > 1
    vote, share, best = relaxed._vote(table, pool, cost, 5)
    assert best == 0
    assert torch.equal(vote, torch.zeros(5, dtype=torch.long))    # most of the three hold 0
    assert torch.allclose(share[valid], torch.tensor([1, 2 / 3, 2 / 3, 1, 1])[valid])
    before = pool.logits.clone()
    pool.lean([3], {5: (vote, share)})
    lifted = torch.nonzero(pool.logits[3] != before[3])
    agreed = torch.nonzero(share >= relaxed.AGREED).flatten()
    assert sorted(lifted[:, 0].tolist()) == agreed.tolist()
    assert (lifted[:, 1] == vote[lifted[:, 0]]).all()
    assert torch.equal(pool.logits[4], before[4])                  # not restarted: untouched


def test_the_ends_are_ranked_by_block_0_and_the_lengths_follow_the_rank():
    truth = _shared(5, [9, 9, 7, 5])
    _, family, spans, bag = _setting(truth)
    table = build(family, bag.candidates)
    scores = relaxed._scores(family, spans["attn0"], table)
    assert relaxed._scores(family, None, table) is None
    plain = relaxed._ends(table, bag.candidates, SEP, None)
    ranked = relaxed._ends(table, bag.candidates, SEP, scores)
    assert plain == sorted(plain, reverse=True) and sorted(ranked) == sorted(plain)
    # each candidate's score is its own, through the model, one at a time
    with torch.no_grad():
        score = [float(spans["attn0"].score(family.attn_input(
            0, family.embeddings(torch.tensor([SEP]), p)))[1][0]) for p in ranked]
        table_score = [float(scores[p][table.ids[p] == SEP][0]) for p in ranked]
    assert table_score == sorted(table_score) and score == sorted(score)
    assert torch.allclose(torch.tensor(score), torch.tensor(table_score), rtol=1e-4)
    # shares 1, 1/2, 1/3 of 11 lengths: 6, 3 and 2 (the ends 9, 4, 7 are lengths 10, 5, 8)
    got = relaxed._lengths([9, 4, 7], 11, left=100)
    assert [got.count(n) for n in (10, 5, 8)] == [6, 3, 2]
    assert relaxed._lengths([9, 4, 7], 6, left=5) == [5] * 6      # only one fits


def test_the_starts_lean_toward_each_positions_best_candidate():
    truth = _shared(5, [9, 9, 7, 5])
    _, family, spans, bag = _setting(truth)
    table = build(family, bag.candidates)
    tilt = relaxed._prior(relaxed._scores(family, spans["attn0"], table))
    assert relaxed._prior(None) is None
    assert (tilt <= 0).all() and (tilt[~table.valid] == 0).all()
    multi = table.valid.sum(1) > 1
    best = tilt.masked_fill(~table.valid, -float("inf")).max(1).values
    assert (best[multi] == 0).all() and (tilt[multi].min(1).values < 0).all()
