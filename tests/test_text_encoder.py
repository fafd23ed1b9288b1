"""The text attack on encoders (BERT, MiniLM: bidirectional attention, sequence classification).

Contracts: the adapter computes block 0 as the model does; the bag of tokens is the batch's;
sentence lengths are read from where the end token was seen; a batch whose first block
separates the positions comes back in order with its labels, certified; a certified batch is
exact; one wrong token or label, or noise on the update, is never certified; the
gradient-matching baseline runs on a classifier with its labels and returns sentences of the
lengths given.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fl_attack.testbed import text as tt  # noqa: E402
from fl_attack.text import certify, invert_text  # noqa: E402
from fl_attack.text.encoder import Layout, Pairs, layouts, mlp_inputs  # noqa: E402
from fl_attack.text.families import family_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CLS, SEP = 1, 2


def _sentences(seed: int, lengths: list[int], vocab: int = 490) -> list[list[int]]:
    """Sentences ``[CLS] ... [SEP]`` of distinct random tokens (none repeats anywhere)."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.randperm(vocab - 3, generator=g)[: sum(n - 2 for n in lengths)] + 3
    out, at = [], 0
    for n in lengths:
        out.append([CLS, *inner[at: at + n - 2].tolist(), SEP])
        at += n - 2
    return out


def test_block_0_computed_by_the_adapter_matches_the_model():
    model = tt.tiny_bert()
    fam = family_of(model)
    ids = _sentences(0, [9, 6])
    lengths = torch.tensor([9, 6])
    tokens = torch.zeros(2, 9, dtype=torch.long)
    for i, s in enumerate(ids):
        tokens[i, : len(s)] = torch.tensor(s)
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    with torch.no_grad():
        hidden = model.bert(input_ids=tokens, attention_mask=mask,
                            output_hidden_states=True).hidden_states[1]
        ours = fam.after_mlp(mlp_inputs(fam, tokens, lengths))
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(ours[i, :n], hidden[i, :n], rtol=1e-4, atol=1e-5)


def test_lengths_are_read_from_the_end_token():
    # [CLS] 5 7 [SEP] and [CLS] 6 [SEP]: the end token at positions 2 and 3
    cands = [torch.tensor(c) for c in ([CLS], [5, 6], [7, SEP], [SEP])]
    found = Pairs(cands, [torch.ones_like(c, dtype=torch.bool) for c in cands])
    assert layouts(found, 7, None) == [Layout([4, 3], SEP)]
    assert layouts(found, 7, 3) == []             # three sentences cannot hold 7 positions
    assert layouts(found, 8, None) == []          # nor two hold 8
    no_end = [torch.tensor(c) for c in ([CLS], [5, 6], [7, 8])]
    assert layouts(Pairs(no_end, [torch.ones_like(c, dtype=torch.bool) for c in no_end]),
                   6, None) == []                 # the sentences do not share an end token


def test_separated_positions_come_back_in_order_with_their_labels_certified():
    model = tt.tiny_bert()
    truth = _sentences(1, [10, 10])
    rec = invert_text(model, tt.classification_gradients(model, truth, [0, 1]))
    assert rec.family == "encoder"
    assert sorted(rec.token_ids) == sorted(truth), rec.reason
    assert rec.stopped == "complete"
    assert rec.certified, rec.reason
    assert [rec.labels[rec.token_ids.index(t)] for t in truth] == [0, 1]
    assert rec.bag == sorted({t for s in truth for t in s})
    assert all(len(s.span_distances) == len(s.token_ids) for s in rec.sequences)


def test_one_wrong_token_or_label_is_not_reproduced():
    model = tt.tiny_bert()
    truth = _sentences(4, [9, 7])
    grads = tt.classification_gradients(model, truth, [1, 0])
    names = [n for n in grads if "layer.0." in n or "classifier" in n]
    observed = {n: grads[n] for n in names}
    assert not certify.recompute(model, truth, observed, labels=[1, 0]).unexplained
    wrong = [list(truth[0]), truth[1]]
    wrong[0][3] = truth[0][4]
    assert certify.recompute(model, wrong, observed, labels=[1, 0]).unexplained
    assert certify.recompute(model, truth, observed, labels=[0, 0]).unexplained
    head = model.classifier
    read = certify.read_labels(model, head, truth, grads["classifier.weight"])
    assert read is not None and read.labels == [1, 0] and read.scale > 0


def test_noise_on_the_update_is_never_certified():
    model = tt.tiny_bert()
    truth = _sentences(5, [8, 8])
    grads = tt.classification_gradients(model, truth, [0, 1])
    g = torch.Generator().manual_seed(0)
    noisy = {n: v + 1e-3 * v.abs().max() * torch.randn(v.shape, generator=g)
             for n, v in grads.items()}
    rec = invert_text(model, noisy)
    assert not rec.certified


@pytest.mark.parametrize("lengths", [[12, 8, 5], [7, 7, 11]])
def test_the_bag_is_the_batch_and_a_certified_result_is_exact(lengths):
    model = tt.tiny_bert()
    truth = _sentences(2, lengths)
    truth[1][3] = truth[0][5]                     # one token shared at two positions
    rec = invert_text(model, tt.classification_gradients(model, truth, [1, 0, 1]))
    assert rec.bag == sorted({t for s in truth for t in s})
    if rec.certified:
        assert sorted(rec.token_ids) == sorted(truth)
    if rec.token_ids:
        assert rec.stopped in {"complete", "ambiguous", "budget"}
    else:
        assert rec.limit == "positions" or rec.stopped in {"ambiguous", "budget"}, rec.reason


def test_an_encoder_without_its_mlp_gradient_is_named():
    model = tt.tiny_bert()
    grads = tt.classification_gradients(model, _sentences(3, [6]), [0])
    drop = {k: v for k, v in grads.items() if "intermediate" not in k and "layer.1." not in k}
    with pytest.raises(ValueError, match="intermediate.dense"):
        invert_text(model, drop)


def test_minilm_reads_one_real_sentence():
    model, tok = tt.minilm()
    truth = [tok("The patient is respiring quietly in the ward").input_ids]
    rec = invert_text(model, tt.classification_gradients(model, truth, [1]))
    assert rec.token_ids == truth, rec.reason
    assert rec.certified and rec.labels == [1], rec.reason


def test_the_gradient_matching_baseline_takes_a_classifiers_labels():
    truth = _sentences(4, [7, 5])
    model = tt.tiny_bert()
    grads = tt.classification_gradients(model, truth, [0, 1])
    names = [n for n in grads if "layer.0.attention.self." in n and n.endswith("weight")]
    before = model.config._attn_implementation
    got = tt.gradient_matching(model, grads, [7, 5], names=names, max_seconds=0.5,
                               labels=[0, 1])
    assert [len(s) for s in got] == [7, 5]
    assert all(0 <= t < model.config.vocab_size for s in got for t in s)
    assert model.config._attn_implementation == before
    assert all(p.grad is None for p in model.parameters())
