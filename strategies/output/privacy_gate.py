"""A privacy gate for regression tests and CI pipelines: fail a run whose clients leak.

``fail_on`` names what must not happen in an audited run:

``"certified"``
    some client's batch was reconstructed with the attack's certificate (exact, proven from
    the update alone);
``"readable"``
    a certified reconstruction of the model's own inputs, or any reconstruction holding a
    sample recognisable against the ground truth (PSNR above ``summary.READABLE_DB``, however
    low the batch's mean: ``summary.recognisable``; audit mode
    only: pictures estimated from features count by their score; without ground truth an
    uncertified reconstruction cannot be judged and does not trip the gate);
``"reconstructed"``
    any reconstruction at all, certified or not, complete or partial.

:func:`gate_failure` reads a run's summary (``AuditStore.finalize``) and says why the gate
trips, or ``None``; the bundled ServerApp raises :class:`PrivacyGateError` with that reason
after the report is written, so ``flwr run`` records the run as failed and a script exits
non-zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fl_attack_flwr.output.summary import READABLE_DB

FAIL_ON: tuple[str, ...] = ("", "certified", "readable", "reconstructed")


class PrivacyGateError(RuntimeError):
    """The audited run leaked what ``fail_on`` forbids; the message says what and where."""


def check_fail_on(fail_on: str) -> str:
    """``fail_on`` when it is one of :data:`FAIL_ON`, else ``ValueError`` naming it."""
    if fail_on not in FAIL_ON:
        raise ValueError(f"fail-on must be one of {[f for f in FAIL_ON if f]} or empty, got "
                         f"{fail_on!r}")
    return fail_on


def gate_failure(summary: Mapping[str, Any], fail_on: str) -> str | None:
    """Why the run fails the gate ``fail_on`` (plain words), or ``None`` when it passes."""
    check_fail_on(fail_on)
    if not fail_on:
        return None
    attacked = int(summary.get("attacked") or 0)
    count = {
        "certified": int(summary.get("certified") or 0),
        "readable": int(summary.get("certified_or_readable") or 0),
        "reconstructed": int(summary.get("reconstructions") or 0),
    }[fail_on]
    if count == 0:
        return None
    what = {"certified": "reconstructed exactly (certified)",
            "readable": f"readable (certified, or recognisable at PSNR > {READABLE_DB:.0f} dB)",
            "reconstructed": "reconstructed (certified or not)"}[fail_on]
    return (f"privacy gate fail-on={fail_on!r}: {count} of {attacked} attacked client "
            f"update(s) {what}; see {summary.get('report')}")
