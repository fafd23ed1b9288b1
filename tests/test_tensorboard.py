"""TensorBoard scalars of the audit: each round's numbers written by the store when the
round's audit is done (through the strategy's own rounds), read back with TensorBoard's
``EventAccumulator``; the optional extra missing fails at once naming it; the run-config key."""

from __future__ import annotations

import os
import stat
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore
from fl_attack_flwr.app.run_config import (
    DEFAULT_RUN_CONFIG,
    RunConfigError,
    check_run_config,
    resolve_run_config,
)
from fl_attack_flwr.results.records import ClientAudit, round_metrics
from tests.flower_fakes import DATASET, configure, fedavg, good_replies

ROOT = Path(__file__).resolve().parents[1]


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _record(rnd: int, pid: int, status: str, **kw: object) -> ClientAudit:
    return ClientAudit(server_round=rnd, node_id=pid, partition_id=pid, status=status,
                       num_examples=4, batch_size=4, attack_seconds=0.5, **kw)


def test_each_rounds_audit_numbers_are_scalars_per_round(tmp_path: Path) -> None:
    store = AuditStore(tmp_path, "tb", tensorboard=True)
    rounds = {
        1: [_record(1, 0, "certified", sparsity_match=1.0),
            _record(1, 1, "certified", sparsity_match=1.0)],
        2: [_record(2, 0, "certified", sparsity_match=1.0, epsilon=8.0, delta=1e-5),
            _record(2, 1, "not-certified", sparsity_match=0.5, epsilon=float("inf"), delta=1e-5)],
        3: [_record(3, 0, "protected", protected_by="no-signal", epsilon_cumulative=2.5,
                       delta=1e-5),
            _record(3, 1, "timeout")],
    }
    for rnd, records in rounds.items():
        for record in records:
            store.add(record)
        store.add_round(rnd, {"evaluate": {"eval-acc": 0.5}})  # no audit numbers: no scalars
        store.add_round(rnd, round_metrics(records, 2.0))
    store.finalize()
    got = _scalars(store.run_dir)
    assert got["audit/certified"] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert got["audit/clients_read"] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert got["audit/samples_readable"] == [(1, 8.0), (2, 4.0), (3, 0.0)]
    assert got["audit/updates_attacked"] == [(1, 2.0), (2, 2.0), (3, 1.0)]
    assert got["audit/no_answer"] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert got["audit/attack_seconds"] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert got["audit/lambda_mean"] == [(1, 1.0), (2, 0.75)]  # only where reconstructed
    assert got["audit/epsilon"] == [(2, 8.0), (3, 2.5)]  # finite ε only, where reported
    for path in (store.run_dir / "tensorboard").rglob("*"):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path


def test_the_strategy_writes_a_rounds_scalars_when_its_audit_is_done(
        world: dict, task_identity: None, tmp_path: Path) -> None:
    """Two audited rounds of real FedSGD updates through ``AuditingStrategy`` (the path of
    ``make demo --set tensorboard=true``): one step per round, read back from the events."""
    store = AuditStore(tmp_path, "strategy", tensorboard=True)
    strategy = AuditingStrategy(fedavg(), store=store, dataset=DATASET, protocol="fedsgd",
                                attack=AttackSettings(executor="inline", max_seconds=20.0))
    for rnd in (1, 2):
        configure(strategy, world, [11])
        _, metrics = strategy.aggregate_train(rnd, good_replies(world, (11,)))
    strategy.close()
    store.finalize()
    got = _scalars(store.run_dir)
    assert [step for step, _ in got["audit/updates_attacked"]] == [1, 2]
    assert [value for _, value in got["audit/certified"]] == [
        float(sum(r.status == "certified" for r in strategy.records if r.server_round == rnd))
        for rnd in (1, 2)]
    seconds = [value for _, value in got["audit/attack_seconds"]]
    assert all(s > 0 for s in seconds) and np.isclose(seconds[-1],
                                                       metrics["audit-attack-seconds"])


def test_without_the_package_turning_it_on_fails_naming_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ImportError, match=r"fl-attack\[tensorboard\]"):
        AuditStore(tmp_path, "none", tensorboard=True)
    assert not (tmp_path / "none").exists()
    with pytest.raises(RunConfigError, match=r"tensorboard = true: .*fl-attack\[tensorboard\]"):
        check_run_config(resolve_run_config({"tensorboard": True, "output-dir": str(tmp_path)}))
    AuditStore(tmp_path, "off")  # off: the package is never needed


def test_the_run_config_key_is_declared_in_pyproject_and_checked(tmp_path: Path) -> None:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        declared = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert declared == DEFAULT_RUN_CONFIG and declared["tensorboard"] is False
    with pytest.raises(RunConfigError, match="tensorboard must be bool"):
        check_run_config(resolve_run_config({"tensorboard": "yes"}))
