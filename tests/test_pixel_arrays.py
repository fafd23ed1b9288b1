"""Pictures estimated from features are kept as arrays (``pixels.npz``) beside the features.

One image per recovered feature row, in [0, 1] (how they were scaled is in the record) and in
the model's input space; owner-only and atomic like every file of a run; never written in
metrics-only mode; deleted with the round's other reconstructions under retention.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fl_attack.testbed import cnn
from fl_attack.testbed.data import load_images
from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, GroundTruth, verdicts
from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.jobs.pixels import PixelOutcome
from fl_attack_flwr.output.private_files import records_from_jsonl
from fl_attack_flwr.results.pictures import InputView, pictures_of
from fl_attack_flwr.results.records import build_record
from tests.flower_fakes import FakeGrid, content, fedavg, reply

pytestmark = pytest.mark.usefixtures("one_thread")

POOL = 64
VIEW = InputView(input_shape=(3, 32, 32), transform=((0.5,) * 3, (0.5,) * 3))


def _features_record(rnd: int, indices: list[int] | None) -> object:
    """A record of 4 recovered feature rows with pictures estimated from them (model space
    [-1, 1]), scored against photos when ``indices`` are given."""
    rng = np.random.default_rng(rnd)
    px = PixelOutcome(images=rng.uniform(-1.0, 1.0, (4, 3, 32, 32)), feature_residual=[0.1] * 4)
    outcome = AttackOutcome(verdicts.CERTIFIED, reading="gradient", inputs=rng.random((4, 400)),
                            reconstruction={"batch_size": 4, "n_directions": 4, "exact": True},
                            pixels=px)
    facts = ReplyFacts(rnd, 11, partition_id=0, num_examples=4, sample_indices=indices,
                       layer="fc1.weight", reads="features")
    truth = GroundTruth("photos32", POOL, seed=7) if indices else None
    return build_record(facts, outcome, pictures_of(outcome, facts, VIEW, truth)), px


def test_pictures_are_kept_in_the_order_of_the_features_with_their_scale() -> None:
    """Scoring reorders the shown pictures to the originals; the kept arrays stay row for row
    with the features, in [0, 1] by the model's normalisation, and in its input space."""
    record, px = _features_record(1, [5, 9, 2, 30])
    assert record.psnr_mean is not None and record.matching is not None
    assert np.allclose(record.pixel_images, np.clip(px.images * 0.5 + 0.5, 0.0, 1.0))
    assert np.array_equal(record.pixel_inputs, px.images)
    arrays = record.pixels["arrays"]
    assert arrays["file"] == "pixels.npz" and "in [0, 1]" in arrays["images"]
    assert "input_transform" in arrays["images"] and "row i" in arrays["rows"]


def test_pixels_npz_is_private_listed_and_follows_the_storage_policy(tmp_path: Path) -> None:
    store = AuditStore(tmp_path, "keep", retain_rounds=1)
    first, px = _features_record(1, None)
    cdir = store.add(first)
    path = cdir / "pixels.npz"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    (line,) = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert "pixels.npz" in line["files"] and line["pixels"]["arrays"]["file"] == "pixels.npz"
    with np.load(path) as kept:
        assert kept["images"].shape == (4, 3, 32, 32) == kept["model_inputs"].shape
        assert 0.0 <= kept["images"].min() and kept["images"].max() <= 1.0
        assert np.allclose(kept["model_inputs"], px.images, atol=1e-6)
    store.add(_features_record(2, None)[0])  # retain_rounds=1: round 1's pictures go
    assert not path.exists() and (cdir / "metrics.json").exists()
    quiet = AuditStore(tmp_path, "metrics-only", reconstructions=False)
    assert not (quiet.add(first) / "pixels.npz").exists()


def test_the_quickstart_cnns_pictures_are_stored_where_they_were_estimated(
        tmp_path: Path, task_identity: None) -> None:
    """Flower's quickstart CNN, one SGD step on 8 photos, the model given: every record whose
    features became pictures has them in ``pixels.npz``, one per feature row, and only
    those."""
    images, labels = load_images("photos32", POOL, seed=7)
    model = cnn.build("quickstart", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    store = AuditStore(tmp_path, "cnn")
    audited = AuditingStrategy(fedavg(), store=store, protocol="fedsgd",
                               attack=AttackSettings(executor="inline", max_seconds=30.0),
                               model=cnn.QuickstartNet, input_shape=(3, 32, 32),
                               input_transform=((0.5,) * 3, (0.5,) * 3), pixel_seconds=3.0,
                               ground_truth=GroundTruth("photos32", POOL, seed=7))
    list(audited.configure_train(1, ArrayRecord(before), ConfigRecord(), FakeGrid([11, 12])))
    replies = []
    for node in (11, 12):
        idx = np.arange((node - 11) * 8, (node - 10) * 8)
        after = cnn.quickstart_train(model, cnn.quickstart_normalize(images[idx]),
                                     labels[idx], batch_size=32)
        replies.append(reply(node, content(after, node - 11, num=8, indices=idx)))
    audited.aggregate_train(1, replies)
    audited.close()
    lines = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert len(lines) == 2
    for ln in lines:
        pictured = bool(ln["pixels"]) and not ln["pixels"]["error"]
        assert ("pixels.npz" in ln["files"]) == pictured, ln
        if pictured:
            with np.load(store.run_dir / ln["dir"] / "pixels.npz") as kept, \
                    np.load(store.run_dir / ln["dir"] / "inputs.npz") as feats:
                assert kept["images"].shape == (feats["inputs"].shape[0], 3, 32, 32)
                assert float(np.abs(kept["model_inputs"]).max()) <= 1.0 + 1e-6  # the box
                assert torch.isfinite(torch.as_tensor(kept["images"])).all()
