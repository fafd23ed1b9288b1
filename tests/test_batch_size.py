"""The batch size the reply states (``num-examples``), on every path that reads a rank.

An update of N samples has numerical rank at most N. The audit attacks an update whose
spectrum reads more at the N its reply states; no ``protected`` reason claims more samples
than the reply reports; an update that separates fewer samples than the reply counts (a
repeated sample) says so and certifies only what it separates. Each situation is built from
real photos and real training steps, then changed where the case needs it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

import fl_attack
from fl_attack.errors import NotIdentifiable
from fl_attack.steps import peel
from fl_attack.steps.decompose import decompose
from fl_attack.testbed import cnn
from fl_attack.testbed.data import load_images, normalize
from fl_attack.testbed.models import relu_mlp
from fl_attack.testbed.simulate import local_update
from fl_attack_flwr import AttackSettings, AuditingStrategy, LeakGuard, verdicts
from tests.flower_fakes import FakeGrid, content, fedavg, reply

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"executor": "inline", "max_seconds": 20.0}


def _numbers_of_samples(text: str) -> list[int]:
    """Every "<N> samples" a sentence claims."""
    return [int(n) for n in re.findall(r"(\d+) samples", text)]


def _audit(task_identity: None, before: dict, after: dict, num: int, **kwargs: object):
    """One round of the audit on one reply of ``num`` examples; its record."""
    audited = AuditingStrategy(fedavg(), attack=AttackSettings(**FAST), protocol="fedsgd",
                               **kwargs)
    list(audited.configure_train(1, ArrayRecord(before), ConfigRecord(), FakeGrid([11])))
    audited.aggregate_train(1, [reply(11, content(after, 0, num=num))])
    audited.close()
    (record,) = audited.records
    return record


def test_a_full_rank_next_layer_is_no_verdict_on_the_attacked_one() -> None:
    """The next layer's gradient only helps peel samples off: when its spectrum is full (float
    rounding filling it, or a layer that mixes more than it separates), the attack goes on
    without it, never raising the next layer's rank as the update's."""
    gen = torch.Generator().manual_seed(0)
    full = torch.zeros(84, 120, dtype=torch.float64)
    full[:57] = torch.randn(57, 120, generator=gen, dtype=torch.float64)
    with pytest.raises(NotIdentifiable):  # the situation: this spectrum reads full rank
        decompose(full, floor_rtol=1e-6)
    assert peel.next_layer_rows(full, 8, 1e-6, gen) is None


@pytest.mark.parametrize("photos", [8, 32])
def test_quickstart_cnn_with_a_full_rank_next_layer_is_read_at_the_replys_size(
        task_identity: None, photos: int) -> None:
    """Flower's quickstart CNN, one SGD step on 8 or 32 photos: where fc2's update fills its
    spectrum (as float32 rounding does on some CPUs), the record says what the reply says."""
    images, labels = load_images("photos32", photos, seed=7)
    model = cnn.build("quickstart", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = cnn.quickstart_train(model, cnn.quickstart_normalize(images), labels, batch_size=32)
    gen = torch.Generator().manual_seed(1)
    after["fc2.weight"] = after["fc2.weight"] + 1e-2 * torch.randn(84, 120, generator=gen)
    record = _audit(task_identity, before, after, photos)
    assert record.status in verdicts.RECONSTRUCTED, (record.status, record.reason, record.error)
    assert record.batch_size == photos and record.layer == "fc1.weight"
    said = " ".join(filter(None, (record.reason, record.error)))
    assert all(n <= photos for n in _numbers_of_samples(said)), said
    assert "min(m, n)" not in said


def test_a_repeated_sample_is_said_and_never_certified_as_the_replys_count(
        task_identity: None) -> None:
    """A batch of 8 photos with one of them twice: the reply counts 9 samples, the update
    separates 8, and the record says so in words; a certificate covers the 8."""
    images, labels = load_images("photos32", 8, seed=3)
    x = normalize(torch.cat([images, images[:1]]), "photos32")
    y = torch.cat([labels, labels[:1]])
    model = relu_mlp(3072, 200, 2, 10, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = local_update(model, x, y, protocol="fedsgd", lr=0.01).state_dict
    record = _audit(task_identity, before, after, 9)
    assert record.status in verdicts.RECONSTRUCTED
    assert record.batch_size == 8 and record.num_examples == 9
    assert "separates 8 of the 9 samples the reply reports" in record.reason
    assert "repeat a sample" in record.reason
    guard = LeakGuard("report", max_seconds=20.0, update="gradient")
    sent = {k: v.numpy() for k, v in before.items()}
    finding = guard.check(sent, reply(11, content(after, 0, num=9)))
    assert finding.readable_samples <= 8 and "separates 8 of the 9" in finding.reason


def test_a_protected_reason_names_the_replys_count_and_never_more() -> None:
    words = verdicts.protected_reason("full-rank", 24, 24, 40)
    assert words.startswith("the reply reports 40 samples") and "min(m, n) = 24" in words
    assert "reply" not in verdicts.protected_reason("full-rank", 24, 24)


def test_a_full_rank_from_another_matrix_is_a_fault_not_protected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full rank raised where the reply's smaller count was already the batch size cannot
    be the attacked layer's: it is recorded as an error, never as ``protected``."""
    from fl_attack_flwr.jobs import run
    from fl_attack_flwr.jobs.build import AttackJob

    def fake(job_: AttackJob, reading: str, kwargs: dict) -> None:
        raise NotIdentifiable("full", reason="full-rank", rank=57, limit=57)

    monkeypatch.setattr(run, "_invert", fake)
    job = AttackJob(1, 11, "c", np.ones((4, 4)), np.ones(4), np.ones((4, 4)), np.ones(4), None,
                    ("gradient",), {"max_seconds": 1.0}, num_examples=32)
    out = run.run_job(job)
    assert out.status == verdicts.ATTACK_ERROR and "reply reports 32 samples" in out.error
    told = run.run_job(AttackJob(**{**job.__dict__, "num_examples": 64}))
    assert told.status == verdicts.PROTECTED and "reply reports 64" in told.reason


def test_the_input_side_keeps_why_a_batch_is_not_identifiable() -> None:
    """``sparse="input"`` decomposes Gᵀ: a full rank there is the same verdict as on the
    output side (``NotIdentifiable``, which the audit retries at the reply's size), not a
    bare ValueError that would be recorded as a crash."""
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(20, 30, generator=gen, dtype=torch.float64)
    g = torch.randn(20, generator=gen, dtype=torch.float64)
    for side in ("input", "auto", "output"):
        with pytest.raises(NotIdentifiable) as err:
            fl_attack.invert(G, g, sparse=side, max_seconds=5)
        assert err.value.reason == "full-rank" and err.value.limit == 20
