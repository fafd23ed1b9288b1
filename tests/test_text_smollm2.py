"""The text attack on a real pretrained language model: SmolLM2-135M (LLaMA architecture).

One FedSGD step of next-token fine-tuning on a few sentences, as a client computes it with
``transformers``; the server reads the sentences back, last tokens included, and certifies.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fl_attack.testbed import text as tt  # noqa: E402
from fl_attack.text import invert_text  # noqa: E402

SENTENCES = [
    "The ferry to the island leaves at seven, weather permitting.",
    "My sister keeps her bicycle in the hallway.",
    "Please send the invoice before Friday.",
    "A quiet street, two cats and an old piano.",
    "We moved the meeting to room twelve.",
    "He forgot his umbrella again!",
]


@pytest.fixture(scope="module")
def smollm2():
    return tt.smollm2()


def test_smollm2_sentences_are_read_exactly_and_certified(smollm2):
    model, tok = smollm2
    ids = [tok(s).input_ids for s in SENTENCES]
    rec = invert_text(model, tt.fedsgd_gradients(model, ids), max_seconds=120)
    assert rec.certified, rec.reason
    assert sorted(tok.decode(t) for t in rec.token_ids) == sorted(SENTENCES)
    assert rec.family == "rotary"
    assert rec.ranks["attn0"] == len({t for s in ids for t in s[:-1]})
