"""The text attack (``fl_attack.text``, DAGER) on tiny random transformers built from configs.

Contracts, whatever the model's random weights: the token filter returns the batch's tokens,
sentences come back in order with their last tokens, a certified batch is exact, and what
cannot be proven (noise, the width reached, a missing output layer) is never certified.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from fl_attack.errors import NotIdentifiable  # noqa: E402
from fl_attack.testbed import text as tt  # noqa: E402
from fl_attack.text import UnsupportedModel, invert_text  # noqa: E402
from fl_attack.text.attack import _spans, _validated  # noqa: E402
from fl_attack.text.families import family_of  # noqa: E402
from fl_attack.text.span import read_span  # noqa: E402
from fl_attack.text.tokens import filter_tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MODELS = {"llama": tt.tiny_llama, "gpt2": tt.tiny_gpt2}


def _batch(seed: int, count: int = 5, low: int = 4, high: int = 12, vocab: int = 490
           ) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _exact(rec, truth) -> bool:
    return sorted(map(list, rec.token_ids)) == sorted(map(list, truth))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sentences_come_back_exactly_and_certified(family):
    model = MODELS[family]()
    truth = _batch(1)
    truth[1] = truth[0][:3] + truth[1]          # two sentences share a prefix
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert _exact(rec, truth), rec.reason
    assert rec.certified and rec.stopped == "complete", rec.reason
    assert all(s.last_token == s.token_ids[-1] for s in rec.sequences)
    assert rec.family == ("rotary" if family == "llama" else "learned")


@pytest.mark.parametrize("family", sorted(MODELS))
def test_token_filter_returns_the_tokens_at_loss_positions(family):
    model = MODELS[family]()
    truth = _batch(2)
    grads = tt.fedsgd_gradients(model, truth)
    fam = family_of(model)
    span = _spans(fam, _validated(fam, grads))[0]["attn0"]
    found = filter_tokens(fam, span, deadline=None)
    if fam.positional_inputs:
        for p, ids in enumerate(found.candidates):
            assert set(ids.tolist()) == {s[p] for s in truth if p < len(s) - 1}
    else:
        assert set(found.candidates[0].tolist()) == {t for s in truth for t in s[:-1]}


def test_left_padding_is_read_with_rotary_positions():
    # Rotary attention depends on relative positions only, so the sentences read as they do
    # right-padded. transformers' loss also labels each sentence's first token from the pad
    # position before it, a term the recomputed update does not model: never certified.
    model = tt.tiny_llama()
    truth = _batch(3)
    rec = invert_text(model, tt.fedsgd_gradients(model, truth, padding_side="left"))
    assert _exact(rec, truth), rec.reason
    assert not rec.certified


def test_repeated_sentences_are_counted():
    model = tt.tiny_llama()
    truth = _batch(4, count=3)
    truth.append(list(truth[0]))
    rec = invert_text(model, tt.fedsgd_gradients(model, truth), batch_size=4)
    assert _exact(rec, truth), rec.reason
    assert [s.count for s in rec.sequences if s.token_ids == truth[0]] == [2]
    assert rec.certified


def test_untied_output_layer():
    model = tt.tiny_llama(tied=False)
    truth = _batch(5)
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert _exact(rec, truth) and rec.certified, rec.reason


def test_without_the_output_layer_the_last_tokens_are_named_not_read():
    model = tt.tiny_gpt2()
    truth = _batch(6)
    grads = tt.fedsgd_gradients(model, truth)
    del grads["transformer.wte.weight"]
    rec = invert_text(model, grads)
    assert not rec.certified
    assert sorted(s.token_ids for s in rec.sequences) == sorted(t[:-1] for t in truth)
    assert all(s.last_token is None for s in rec.sequences)
    assert any("transformer.wte.weight" in n for n in rec.not_carried)


def test_as_many_positions_as_the_width_is_not_identifiable():
    model = tt.tiny_llama(width=32)
    truth = _batch(7, count=8, low=10, high=14)          # > 32 loss positions at width 32
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert rec.stopped == "not-identifiable" and not rec.certified
    assert "width 32" in rec.reason


@pytest.mark.parametrize("family", sorted(MODELS))
def test_noise_is_never_certified(family):
    model = MODELS[family]()
    truth = _batch(8)
    grads = tt.fedsgd_gradients(model, truth)
    g = torch.Generator().manual_seed(0)
    noisy = {n: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g)
             for n, v in grads.items()}
    rec = invert_text(model, noisy, max_seconds=30)
    assert not rec.certified


def test_a_sentence_of_repeated_tokens_is_not_certified():
    model = tt.tiny_llama()
    truth = _batch(9, count=3)
    truth[0] = [truth[0][0]] * 3 + truth[0]             # "t t t t ...": rotary cannot tell
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert not rec.certified


def test_the_first_block_computed_from_cached_keys_matches_the_model():
    from fl_attack.text.sequences import Prefixes, _attend

    model = tt.tiny_llama()
    fam = family_of(model)
    ids = torch.tensor(_batch(10, count=1, low=6, high=7))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1][0]
        keys, values = [], []
        for p, t in enumerate(ids[0].tolist()):
            e = fam.embeddings(torch.tensor([t]), p)
            q, k, v = fam.qkv(fam.attn_input(0, e), p)
            live = Prefixes(ids[:, :p], torch.stack([*keys, k[0]])[None, :p],
                            torch.stack([*values, v[0]])[None, :p], torch.zeros(1, p, 2))
            h = fam.after_mlp(_attend(fam, live, q, k, v, e)[0])
            torch.testing.assert_close(h[0], hidden[p], rtol=1e-4, atol=1e-5)
            keys.append(k[0])
            values.append(v[0])


def test_read_span_reads_the_rank_and_refuses_full_rank():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 7, generator=g, dtype=torch.float64) @ torch.randn(
        7, 30, generator=g, dtype=torch.float64)
    span = read_span(rows, what="layer")
    assert span.rank == 7
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) @ rows[:7]
    assert float(span.distance(x).max()) < 1e-10
    with pytest.raises(NotIdentifiable, match="layer") as err:
        read_span(torch.randn(40, 30, generator=g), what="layer")
    assert err.value.reason == "full-rank"
    with pytest.raises(NotIdentifiable) as err:
        read_span(torch.zeros(4, 30), what="layer")
    assert err.value.reason == "no-signal"


def test_bad_input_is_named():
    model = tt.tiny_llama()
    grads = tt.fedsgd_gradients(model, _batch(11, count=2))
    with pytest.raises(ValueError, match="q_proj"):
        invert_text(model, {k: v for k, v in grads.items() if "layers.0.self_attn" not in k})
    only_attn0 = {k: v for k, v in grads.items() if "layers.0.self_attn" in k}
    with pytest.raises(ValueError, match="orders the tokens"):
        invert_text(model, only_attn0)
    bad = dict(grads)
    bad["model.layers.0.self_attn.k_proj.weight"] = grads[
        "model.layers.0.self_attn.k_proj.weight"][:, :10]
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        invert_text(model, bad)
    bad = dict(grads)
    bad["model.layers.1.self_attn.v_proj.weight"] = torch.full_like(
        grads["model.layers.1.self_attn.v_proj.weight"], float("nan"))
    with pytest.raises(ValueError, match="v_proj.weight holds NaN"):
        invert_text(model, bad)
    with pytest.raises(ValueError, match="not a float"):
        invert_text(model, {**grads, "model.layers.0.self_attn.q_proj.weight": torch.zeros(
            grads["model.layers.0.self_attn.q_proj.weight"].shape, dtype=torch.long)})
    with pytest.raises(ValueError, match="map parameter names"):
        invert_text(model, [1, 2])


def test_a_model_family_not_covered_is_named():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    model = DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64))
    with pytest.raises(UnsupportedModel, match="'distilbert'"):
        invert_text(model, {})


def test_the_library_imports_without_transformers():
    code = ("import sys, fl_attack.text; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _lora(model, rank: int):
    pytest.importorskip("peft")
    return tt.with_lora(model, rank)


def test_lora_below_its_rank_reads_the_prefixes_without_certifying():
    truth = _batch(12, count=2, low=4, high=6)
    lora = _lora(tt.tiny_llama(), rank=32)
    rec = invert_text(lora, tt.fedsgd_gradients(lora, truth))
    assert sorted(s.token_ids for s in rec.sequences) == sorted(t[:-1] for t in truth)
    assert not rec.certified                      # the frozen output layer has no gradient
    assert rec.not_carried


def test_lora_at_its_rank_is_not_applicable():
    truth = _batch(13, count=4, low=8, high=10)   # > 8 positions for an adapter of rank 8
    lora = _lora(tt.tiny_llama(), rank=8)
    rec = invert_text(lora, tt.fedsgd_gradients(lora, truth))
    assert rec.stopped == "not-applicable" and not rec.certified
    assert "rank 8" in rec.reason


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_sentence_that_ends_inside_another_is_read(family):
    model = MODELS[family]()
    truth = _batch(14, count=3)
    truth.append(truth[0][:3])                   # ends where another sentence goes on
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert _exact(rec, truth), rec.reason
    assert rec.certified



@pytest.mark.parametrize("family", sorted(MODELS))
def test_bos_eos_and_repeated_tokens_inside_sentences(family):
    # Every sentence starts with the same BOS and ends with EOS, as chat-style fine-tuning
    # data does; tokens recur inside and across sentences.
    model = MODELS[family]()
    bos, eos = 1, 2
    body = _batch(16, count=4)
    truth = [[bos, *b[:2], *b[:2], *b[2:], eos] for b in body]
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert _exact(rec, truth), rec.reason
    assert rec.certified


def test_tokens_with_identical_embeddings_are_never_certified():
    model = tt.tiny_llama()
    truth = _batch(17, count=3)
    with torch.no_grad():                          # a twin of a batch token, as untrained
        model.model.embed_tokens.weight[499] = model.model.embed_tokens.weight[truth[0][1]]
    rec = invert_text(model, tt.fedsgd_gradients(model, truth))
    assert not rec.certified
    assert "identical embeddings" in rec.reason


@pytest.mark.parametrize("family", sorted(MODELS))
def test_weights_after_one_step_are_read_and_certified(family):
    """FedSGD as Flower clients send it: the float32 weights after one SGD step."""
    model, truth = MODELS[family](), _batch(11)
    update = tt.fedavg_update(model, truth, steps=1, lr=0.05)
    rec = invert_text(model, update, weights_dtype="float32")
    assert rec.certified, rec.reason
    assert _exact(rec, truth)


def test_a_weight_difference_with_one_wrong_token_is_not_certified():
    """The storage rounding is allowed in the certificate's residual, a wrong token is not."""
    from fl_attack.text import certify
    from fl_attack.text.attack import _storage

    model, truth = tt.tiny_llama(), _batch(12)
    update = tt.fedavg_update(model, truth, steps=1, lr=0.05)
    family = family_of(model)
    grads = _validated(family, update)
    storage = _storage(family, grads, "float32")
    right = certify.recompute(model, truth, grads, storage)
    assert not right.unexplained
    wrong = [list(s) for s in truth]
    wrong[0][1] = wrong[0][1] + 1
    assert certify.recompute(model, wrong, grads, storage).unexplained


def test_storage_rounding_is_the_spacing_of_the_stored_weights():
    from fl_attack.text.span import storage_rounding

    w0 = torch.tensor([1.0, 1.5, -3.0, 0.0])
    std = storage_rounding(w0, torch.zeros(4), torch.float32)
    ulp = torch.tensor([2.0 ** -23, 2.0 ** -23, 2.0 ** -22, 2.0 ** -149], dtype=torch.float64)
    assert torch.allclose(std, ulp / 12 ** 0.5)
    with pytest.raises(ValueError, match="weights_dtype"):
        invert_text(tt.tiny_llama(), tt.fedsgd_gradients(tt.tiny_llama(), _batch(1)),
                    weights_dtype="int8")


def test_the_first_last_token_reading_prefers_a_whole_count_outside_the_inputs():
    """Input tokens' rows carry the unknown last positions' input gradients (tied embeddings):
    a larger, fractional coefficient there does not beat a whole count elsewhere."""
    from fl_attack.text.last_token import _candidates, _first_candidate

    col = torch.zeros(10, dtype=torch.float64)
    col[3], col[7], col[5] = 1.83, 1.03, 0.6      # 3 is an input token of the batch
    top = _candidates(col)
    assert top == [3, 7, 5]
    assert _first_candidate(col, top, inputs={3, 4}) == [7]
    assert _first_candidate(col, [3, 5], inputs={3}) == []   # none clean: the caller's largest
