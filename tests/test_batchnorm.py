"""BatchNorm in a user's model: what the attack covers, what it does not, and the pictures.

A third-party MLP (its own layer names and loop) with ``BatchNorm1d`` right after its first
linear layer (Linear -> BatchNorm -> ReLU, in train mode) or after its second. After the first,
the layer is ``not-covered`` (the batch statistics couple the samples and cancel the bias
gradient) and the audit reads the next linear layer's input features instead, with or without
the model; after the second, the first layer is attacked as usual. With the model given, the
pictures go through the BatchNorm with the batch's statistics recovered from the running
statistics the client returned. Integer buffers are never attacked nor make a reply corrupt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from fl_attack.model.split import feature_extractor
from fl_attack.model.updates import layer_keys
from fl_attack.testbed.data import load_images, normalize
from fl_attack_flwr import AttackSettings, AuditingStrategy, LeakGuard, verdicts
from fl_attack_flwr.intake.reply import corrupt_reason
from fl_attack_flwr.jobs.layers import scan_layers
from fl_attack_flwr.jobs.model_plan import ModelPlan, pixel_task
from fl_attack_flwr.jobs.pixels import load_model, set_batch_statistics
from tests.flower_fakes import FakeGrid, content, fedavg, reply

pytestmark = pytest.mark.usefixtures("one_thread")

B = 16


class NormedMLP(nn.Module):
    """enc -> (norm) -> ReLU -> mid -> (norm) -> ReLU -> out, on flattened photos; the
    BatchNorm after ``enc`` (``place="first"``) or after ``mid`` (``"second"``)."""

    def __init__(self, place: str = "first", momentum: float | None = 0.1) -> None:
        super().__init__()
        self.place = place
        self.enc = nn.Linear(3 * 32 * 32, 128)
        self.norm = nn.BatchNorm1d(128 if place == "first" else 64, momentum=momentum)
        self.mid = nn.Linear(128, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.place == "first":
            return self.out(torch.relu(self.mid(torch.relu(self.norm(self.enc(x))))))
        return self.out(torch.relu(self.norm(self.mid(torch.relu(self.enc(x))))))


class LateNorm(NormedMLP):
    """The same block, with the BatchNorm registered last: its keys do not follow ``enc``'s."""

    def __init__(self) -> None:
        super().__init__("first")
        norm = self.norm
        del self.norm
        self.norm = norm


class NormedCNN(nn.Module):
    """conv -> BatchNorm2d -> ReLU -> pool -> fc1 -> ReLU -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 5)
        self.bn = nn.BatchNorm2d(6)
        self.fc1 = nn.Linear(6 * 14 * 14, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _photos(node: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_images("photos32", 2 * B, seed=7)
    part = slice((node - 11) * B, (node - 10) * B)
    return normalize(images[part], "photos32"), labels[part]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          frozen: bool = False) -> dict[str, torch.Tensor]:
    """The user's loop: one SGD step in train mode (``frozen``: its norms in eval mode)."""
    local = load_model(model, _numpy(model))  # a copy holding the same weights
    local.train()
    if frozen:
        for module in local.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    nn.functional.cross_entropy(local(x), y).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in local.state_dict().items()}


def _true_features(model: nn.Module, key: str, x: torch.Tensor) -> np.ndarray:
    """The inputs the layer ``key`` saw in the client's train-mode forward pass."""
    local = load_model(model, _numpy(model)).train()
    with torch.no_grad():
        return feature_extractor(local, key)(x).double().numpy()


def _audit(task_identity: None, model: nn.Module, given: bool) -> list:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = ({"model": model, "input_shape": (3, 32, 32), "pixel_seconds": 3.0}
              if given else {})
    audited = AuditingStrategy(fedavg(), protocol="fedsgd",
                               attack=AttackSettings(executor="inline", max_seconds=30.0),
                               **kwargs)
    list(audited.configure_train(1, ArrayRecord(before), ConfigRecord(), FakeGrid([11, 12])))
    audited.aggregate_train(1, [reply(node, content(_step(model, *_photos(node)), node - 11,
                                                    num=B)) for node in (11, 12)])
    audited.close()
    return sorted(audited.records, key=lambda r: r.node_id)


@pytest.mark.parametrize("given", [False, True])
def test_batchnorm_after_the_first_layer_is_not_covered_and_the_next_is_read(
        task_identity: None, given: bool) -> None:
    torch.manual_seed(0)
    model = NormedMLP("first")
    for node, record in zip((11, 12), _audit(task_identity, model, given), strict=True):
        assert record.status in verdicts.RECONSTRUCTED, (record.status, record.error)
        (passed,) = record.passed_over
        assert passed["layer"] == "enc.weight" and passed["status"] == verdicts.NOT_COVERED
        assert "BatchNorm" in passed["reason"] and "bias gradient" in passed["reason"]
        assert "train mode" in passed["reason"]
        assert record.layer == "mid.weight" and record.reads == "features"
        assert "Not covered: enc" in record.inputs_are
        assert record.batch_size == B or "separates" in record.reason
        if record.status == verdicts.CERTIFIED:  # the certificate's promise, checked
            truth = _true_features(model, "mid.weight", _photos(node)[0])
            err = max(np.abs(truth - row).max(axis=1).min() for row in record.inputs)
            assert err < 1e-4 * np.abs(truth).max(), err
        if given and record.pixels and not record.pixels["error"]:
            assert "recovered exactly" in record.pixels["batch_statistics"]


def test_batchnorm_after_the_second_layer_leaves_the_first_attacked(
        task_identity: None) -> None:
    torch.manual_seed(0)
    for record in _audit(task_identity, NormedMLP("second"), given=False):
        assert record.status in verdicts.RECONSTRUCTED and record.passed_over is None
        assert record.layer == "enc.weight" and record.reads == "inputs"


@pytest.mark.parametrize("case", ["1d", "2d", "cumulative"])
def test_the_batch_statistics_come_back_from_the_running_statistics(case: str) -> None:
    """One train-mode step: the server's eval-mode forward pass with the recovered statistics
    gives the features the client's forward pass gave."""
    torch.manual_seed(1)
    model = {"1d": NormedMLP("first"), "2d": NormedCNN(),
             "cumulative": NormedMLP("first", momentum=None)}[case]
    key = "fc1.weight" if case == "2d" else "mid.weight"
    x, y = _photos(11)
    x = x.reshape(B, 3, 32, 32)
    after = _step(model, x, y)
    sent = {k: v.numpy() for k, v in model.state_dict().items()}
    task = pixel_task(model, sent, {k: v.numpy() for k, v in after.items()}, key, (3, 32, 32),
                      ((-3.0,) * 3, (3.0,) * 3), max_seconds=1.0, seed=0)
    server = load_model(model, sent)
    extractor = feature_extractor(server, key)
    with torch.no_grad():
        wrong = extractor(x).double().numpy()
    words = set_batch_statistics(server, extractor, task, B)
    with torch.no_grad():
        got = extractor(x).double().numpy()
    truth = _true_features(model, key, x)
    assert words is not None and "recovered exactly" in words
    assert np.abs(got - truth).max() < 1e-4 * np.abs(truth).max()
    assert np.abs(wrong - truth).max() > 1e-2 * np.abs(truth).max()  # the sent stats are not


def test_a_batchnorm_is_found_from_the_bias_alone_and_a_frozen_one_by_its_keys() -> None:
    torch.manual_seed(2)
    x, y = _photos(11)
    late = LateNorm()
    before = {k: v.numpy() for k, v in late.state_dict().items()}
    layer, passed = scan_layers(before, {k: v.numpy() for k, v in _step(late, x, y).items()},
                                AttackSettings())
    assert layer.weight_key == "mid.weight" and "bias did not move" in passed[0].reason
    frozen = NormedMLP("first")
    before = {k: v.numpy() for k, v in frozen.state_dict().items()}
    after = {k: v.numpy() for k, v in _step(frozen, x, y, frozen=True).items()}
    layer, passed = scan_layers(before, after, AttackSettings())
    assert layer.weight_key == "mid.weight" and "frozen statistics" in passed[0].reason
    named, passed = scan_layers(before, after, AttackSettings(weight_key="enc.weight"))
    assert named is None and len(passed) == 1  # a layer the user names is the only one tried


def test_without_a_covered_layer_the_reply_is_not_covered_never_an_error() -> None:
    """Linear -> BatchNorm -> ReLU -> Linear (the logits): with the model given, neither layer
    is covered; the guard says so too, and the server's record names both reasons."""

    class Short(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.norm, self.out = nn.Linear(3072, 64), nn.BatchNorm1d(64), \
                nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.norm(self.enc(x.flatten(1)))))

    torch.manual_seed(3)
    model = Short()
    before = {k: v.numpy() for k, v in model.state_dict().items()}
    after = {k: v.numpy() for k, v in _step(model, *_photos(11)).items()}
    plan = ModelPlan(model, input_shape=(3, 32, 32), bounds=None)
    layer, passed = scan_layers(before, after, AttackSettings(),
                                lambda key: plan.layer(key, before))
    assert layer is None and [p.layer for p in passed] == ["enc.weight", "out.weight"]
    assert "BatchNorm" in passed[0].reason and "not a ReLU" in passed[1].reason


def test_the_leak_guard_checks_the_layer_the_server_reads() -> None:
    """The client's own check takes the same layer as the server: no crash on the layer
    before the BatchNorm, an attack on the next one (its reconstruction, or the budget's end
    on a loaded machine: both attacked the covered layer)."""
    torch.manual_seed(0)
    model = NormedMLP("first")
    sent = {k: v.numpy() for k, v in model.state_dict().items()}
    guard = LeakGuard("report", max_seconds=20.0, update="gradient")
    finding = guard.check(sent, reply(11, content(_step(model, *_photos(11)), 0, num=B)))
    assert finding.status in (*verdicts.RECONSTRUCTED, verdicts.TIMEOUT), finding
    assert finding.sparsity_match is not None, finding


def test_integer_and_boolean_buffers_are_never_attacked_nor_corrupt(world: dict) -> None:
    """A quantised layer's integer codes are no gradient; integer and boolean buffers are
    aggregatable (FedAvg's weighted sum takes them); text is not, and is withheld."""
    state = {k: v.numpy() for k, v in world["global"].items()}
    quantised = {"q.weight": np.ones((4, 3), np.int64), "q.bias": np.zeros(4, np.int64),
                 **state, "steps": np.array(7, np.int64), "mask": np.ones(5, np.bool_)}
    assert [w for w, _ in layer_keys(quantised)] == [w for w, _ in layer_keys(state)]
    sent = ArrayRecord({k: Array(v) for k, v in quantised.items()})
    ok = reply(11, RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in quantised.items()}),
                               "metrics": MetricRecord({"num-examples": 8})}))
    assert corrupt_reason(ok, sent) is None
    text = {**quantised, "mask": np.array(["a"] * 5)}
    bad = reply(11, RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in text.items()}),
                                "metrics": MetricRecord({"num-examples": 8})}))
    assert "'mask' is not real numeric" in corrupt_reason(bad, None)
