"""The attack job is one piece of code for the server and the client: it imports no Flower,
and the server's intake and the client's ``LeakGuard`` build the same job from the same update.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from fl_attack_flwr import AttackSettings, verdicts
from fl_attack_flwr.jobs.build import AttackJob, attack_job
from fl_attack_flwr.jobs.outcome import AttackOutcome


def test_the_job_code_imports_no_flower() -> None:
    """Attack workers and the guard's check import the job code only: no ``flwr`` module."""
    code = (
        "import sys\n"
        "import fl_attack_flwr.jobs.build, fl_attack_flwr.jobs.run, fl_attack_flwr.jobs.layers\n"
        "import fl_attack_flwr.jobs.outcome, fl_attack_flwr.jobs.pixels\n"
        "import fl_attack_flwr.jobs.model_plan, fl_attack_flwr.executors.base\n"
        "flower = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.'))\n"
        "assert not flower, flower\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _states(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    sent = {"0.weight": rng.standard_normal((6, 4)), "0.bias": rng.standard_normal(6),
            "1.weight": rng.standard_normal((3, 6)), "1.bias": rng.standard_normal(3)}
    returned = {k: v - 0.01 * rng.standard_normal(v.shape) for k, v in sent.items()}
    return sent, returned


def test_an_unchanged_model_is_no_update_by_its_type_not_its_words() -> None:
    """``fl_attack.errors.ZeroUpdate`` becomes ``no-update``; any other update is a job."""
    sent, returned = _states()
    settings = AttackSettings(executor="inline")
    target, work = attack_job(sent, {k: v.copy() for k, v in sent.items()}, settings,
                              label="same")
    assert isinstance(work, AttackOutcome) and work.status == verdicts.NO_UPDATE
    assert target.covered and target.layer.weight_key == "0.weight"
    target, work = attack_job(sent, returned, settings, label="moved", num_examples=2)
    assert isinstance(work, AttackJob) and work.num_examples == 2
    assert work.next_weight_grad is not None and work.readings == ("gradient", "fedavg")
    assert work.next_weight is not None  # its weights' rounding floor
    assert np.array_equal(work.next_weight, sent["1.weight"])


def test_the_gradient_reading_passes_the_next_layer_and_its_weight(monkeypatch) -> None:
    """Under the ``gradient`` reading ``fl_attack.invert`` gets the next layer's update and its
    sent weight (its rounding floor); under ``fedavg``, a sum of steps, neither."""
    import fl_attack
    from fl_attack_flwr.jobs import run

    sent, returned = _states()
    _, work = attack_job(sent, returned, AttackSettings(executor="inline"), label="c",
                         num_examples=2)
    assert isinstance(work, AttackJob)
    seen: dict[str, dict] = {}
    monkeypatch.setattr(fl_attack, "invert",
                        lambda *a, **kw: seen.setdefault(kw["update"], kw))
    for reading in ("gradient", "fedavg"):
        run._invert(work, reading, {})
    assert np.array_equal(seen["gradient"]["next_weight"].numpy(), sent["1.weight"])
    assert np.array_equal(seen["gradient"]["next_weight_grad"].numpy(), work.next_weight_grad)
    assert "next_weight" not in seen["fedavg"] and "next_weight_grad" not in seen["fedavg"]
