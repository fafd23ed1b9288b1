"""``LeakGuard``: a Flower client mod that checks the client's own update before it leaves.

After the client's training (``call_next``), the guard forms the update the server would attack
from the arrays the client received and the arrays it is about to send: the same layer choice
and the same readings (one gradient step, then a sum of local steps) as the auditing server,
and runs the same exact attack (SPEAR++) in the client's process under its own time budget. The
job code is the server's own (:mod:`fl_attack_flwr.jobs`: ``build.attack_job``,
``run.run_job``); the guard adds only the reading of its reply and the policy. The attack's
certificate (λ = 1 with all B directions and no noise) *proves* from the update alone that the
batch is readable exactly; the guard acts on that proof only:

``report`` (default)
    the reply goes out unchanged, with the guard's finding in its MetricRecord
    (``wire.GUARD_KEYS``; the status as a code of ``wire.GUARD_CODES``);
``refuse``
    an update proven readable (certified, or samples verified one by one through the next
    layer) is withheld: the reply carries the arrays the client received, i.e. no update, with
    a weight FedAvg's average ignores (``refused_weight``, positive so that a round in which
    every client refuses still aggregates), and says so in its metrics;
``escalate``
    a proven-readable update gets the configured local-DP step (Flower's ``LocalDpMod``:
    clipping and Gaussian noise) and is checked again; it is sent when the check no longer
    proves it readable, else withheld as under ``refuse``.

What it proves, and what not. A refusal is a proof: the guard read the batch exactly from the
update alone. An update it passes may still be readable: by a stronger attacker or a larger
budget than the guard's, approximately (FedAvg sums, noise), or through other layers. Noise
makes certification impossible, so after ``escalate`` the re-check passes any noised update;
what protects it then is the DP guarantee of the noise (ε, δ), not the check.

Where it sits. Flower applies mods outermost first: the guard must be the *first* entry of
``mods`` (``@app.train(mods=[LeakGuard(...), LocalDpMod(...)])``) to see what really leaves the
client, after clipping or local-DP mods. It cannot see the order itself; what it does see is
whether the update it checked carries noise (the attack's own noise test).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord

from fl_attack_flwr import verdicts, wire
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.settings import AttackSettings

log = logging.getLogger("flwr")

POLICIES = ("report", "refuse", "escalate")
_CODE_OF = {word: code for code, word in wire.GUARD_CODES.items()}
_LOCAL_DP_KEYS = ("clipping_norm", "sensitivity", "epsilon", "delta")


@dataclass(frozen=True)
class GuardFinding:
    """What the guard's check of one update found."""

    status: str
    """The plugin's status word (a value of ``wire.GUARD_CODES``)."""
    readable_samples: int = 0
    """Samples the check *proves* readable: B when certified, else those verified one by one."""
    sparsity_match: float | None = None
    seconds: float = 0.0
    reason: str | None = None

    @property
    def certified(self) -> bool:
        """Whether the whole batch is proven readable."""
        return self.status == verdicts.CERTIFIED

    @property
    def unknown(self) -> bool:
        """Whether the check gave no answer (its budget ran out, or it failed)."""
        return self.status in ("timeout", verdicts.OUT_OF_MEMORY, verdicts.ATTACK_ERROR)

    def metrics(self, refused: bool, escalated: bool) -> dict[str, float]:
        """The reply's ``leak-guard-*`` metrics (numbers only, ``-1`` for a missing λ)."""
        values = (_CODE_OF[self.status], int(refused), int(escalated), int(self.certified),
                  self.readable_samples,
                  -1.0 if self.sparsity_match is None else float(self.sparsity_match),
                  float(self.seconds))
        return dict(zip(wire.GUARD_KEYS, values, strict=True))


class LeakGuard:
    """A client mod that runs the exact attack on the client's own update before it is sent.

    Parameters
    ----------
    policy : {"report", "refuse", "escalate"}
        What to do with an update the check proves readable (see the module docstring).
    max_seconds : float
        The check's time budget, shared by the readings it tries (soft: each reading's final
        selection may take a quarter more). Smaller than a server's by design: the client's
        round waits for it.
    on_unknown : {"send", "refuse"}
        What to do when the check gives no answer (its budget ran out, or it failed).
    weight_key, bias_key : str, optional
        The layer the server attacks, as the server would choose it (default: the first linear
        layer with a bias).
    update : {"auto", "gradient", "fedavg"}
        How the update is read (the server's default: a gradient step, then a sum of steps).
    next_layer : bool
        Let the check peel samples off with the next layer's update, as the server does.
    local_dp : mapping, optional
        ``escalate`` only: the keyword arguments of Flower's ``LocalDpMod``
        (``clipping_norm``, ``sensitivity``, ``epsilon``, ``delta``).
    weighted_by_key : str
        The aggregation weight of the reply (Flower's FedAvg: ``num-examples``).
    refused_weight : float
        The weight a withheld reply carries: positive, so that FedAvg still aggregates when
        every client refuses, and small enough that its (unchanged) arrays do not move the
        average of the others.
    seed : int
        The check's random seed.

    Examples
    --------
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp()
    >>> @app.train(mods=[LeakGuard(policy="refuse", max_seconds=20)])
    ... def train(msg, context):
    ...     ...
    """

    def __init__(self, policy: str = "report", *, max_seconds: float = 30.0,
                 on_unknown: str = "send", weight_key: str | None = None,
                 bias_key: str | None = None, update: str = "auto", next_layer: bool = True,
                 local_dp: Mapping[str, float] | None = None,
                 weighted_by_key: str = wire.NUM_EXAMPLES_KEY, refused_weight: float = 1e-9,
                 seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown LeakGuard policy {policy!r}; choose one of {POLICIES}")
        if on_unknown not in ("send", "refuse"):
            raise ValueError(f"on_unknown must be 'send' or 'refuse', got {on_unknown!r}")
        if policy == "escalate" and (local_dp is None or set(local_dp) != set(_LOCAL_DP_KEYS)):
            raise ValueError(f"policy 'escalate' needs local_dp with exactly the keys "
                             f"{list(_LOCAL_DP_KEYS)} (Flower's LocalDpMod), got {local_dp!r}")
        if not (isinstance(refused_weight, (int, float)) and 0 < refused_weight < 1):
            raise ValueError(f"refused_weight must lie in (0, 1), got {refused_weight!r}")
        self.policy, self.on_unknown = policy, on_unknown
        self.local_dp = dict(local_dp) if local_dp is not None else None
        self.weighted_by_key, self.refused_weight = weighted_by_key, float(refused_weight)
        readings = AttackSettings(update=update).readings()
        self.settings = AttackSettings(  # the readings share the budget: it bounds the check
            weight_key=weight_key, bias_key=bias_key, update=update, next_layer=next_layer,
            max_seconds=max_seconds / len(readings), seed=seed, executor="inline", device="cpu")

    def __call__(self, msg: Message, ctxt: Context,
                 call_next: Callable[[Message, Context], Message]) -> Message:
        """Run the client's handler, check its update, apply the policy (train messages)."""
        if not _is_train(msg) or len(msg.content.array_records) != 1:
            return call_next(msg, ctxt)
        sent = {k: np.array(v.numpy(), copy=True)
                for k, v in next(iter(msg.content.array_records.values())).items()}
        reply = call_next(msg, ctxt)
        if reply.has_error() or not reply.has_content():
            return reply
        finding = self.check(sent, reply)
        refused = escalated = False
        if self._refuses(finding) and self.policy != "report":
            if self.policy == "escalate":
                noised = self._local_dp(msg, ctxt, reply)
                again = self.check(sent, noised)
                if not self._refuses(again):
                    reply, finding, escalated = noised, again, True
            refused = not escalated
            if refused:
                self._withhold(reply, sent)
        _add_metrics(reply, finding.metrics(refused, escalated))
        log.info("[leak-guard] %s%s (%.1f s)%s", finding.status,
                 f", {finding.readable_samples} sample(s) provably readable"
                 if finding.readable_samples else "", finding.seconds,
                 ": update withheld" if refused else
                 ": local DP applied, sent" if escalated else ": sent")
        return reply

    def check(self, sent: Mapping[str, np.ndarray], reply: Message) -> GuardFinding:
        """The exact attack on the update ``sent -> reply``; never raises."""
        t0 = time.perf_counter()
        try:
            outcome = _attack(sent, reply, self.settings)
        except Exception as exc:  # noqa: BLE001 - the guard never crashes the client
            return GuardFinding(verdicts.ATTACK_ERROR, seconds=time.perf_counter() - t0,
                                reason=f"{type(exc).__name__}: {exc}")
        return _finding(outcome, time.perf_counter() - t0)

    def _refuses(self, finding: GuardFinding) -> bool:
        return finding.readable_samples > 0 or (finding.unknown and self.on_unknown == "refuse")

    def _local_dp(self, msg: Message, ctxt: Context, reply: Message) -> Message:
        """``reply`` after Flower's own ``LocalDpMod`` with the configured parameters (it
        replaces the reply's ArrayRecord by the clipped, noised one)."""
        from flwr.clientapp.mod import LocalDpMod

        assert self.local_dp is not None  # checked in __init__
        return LocalDpMod(**self.local_dp)(msg, ctxt, lambda _m, _c: reply)

    def _withhold(self, reply: Message, sent: Mapping[str, np.ndarray]) -> None:
        """Replace the reply's arrays by those received, at the refused weight."""
        key = next(iter(reply.content.array_records))
        reply.content[key] = ArrayRecord({k: Array(np.asarray(v)) for k, v in sent.items()})
        for record in reply.content.metric_records.values():
            if self.weighted_by_key in record:
                record[self.weighted_by_key] = self.refused_weight


def _is_train(msg: Message) -> bool:
    """A train message: ``train``, or a named train action ``train.<action>``."""
    return msg.metadata.message_type.split(".", 1)[0] == "train"


def _attack(sent: Mapping[str, np.ndarray], reply: Message,
            settings: AttackSettings) -> AttackOutcome:
    """The server's attack on ``sent -> reply``, run in this process, on the layer the server
    would attack (the first the attack covers), at the batch size the reply reports."""
    from fl_attack_flwr.jobs.build import attack_job
    from fl_attack_flwr.jobs.run import run_job

    if len(reply.content.array_records) != 1:
        raise ValueError(f"the reply holds {len(reply.content.array_records)} ArrayRecords, "
                         "not one")
    back = {k: v.numpy() for k, v in next(iter(reply.content.array_records.values())).items()}
    _, work = attack_job(dict(sent), back, settings, label="leak-guard",
                         num_examples=wire.num_examples(reply) or None)
    return work if isinstance(work, AttackOutcome) else run_job(work)


def _finding(outcome: AttackOutcome, seconds: float) -> GuardFinding:
    """The guard's finding from the attack's outcome."""
    status = outcome.status
    exhausted = bool(outcome.reconstruction_field("budget_exhausted"))
    if status in verdicts.RECONSTRUCTED and status != verdicts.CERTIFIED and exhausted:
        status = "timeout"
    if status not in _CODE_OF:
        status = verdicts.ATTACK_ERROR
    batch = int(outcome.reconstruction_field("batch_size") or 0)
    verified = len(outcome.reconstruction_field("verified") or ())  # peeled or kept
    readable = batch if outcome.status == verdicts.CERTIFIED else verified
    lam = outcome.reconstruction_field("sparsity_match")
    return GuardFinding(status, readable, None if lam is None else float(lam), seconds,
                        outcome.reason or outcome.error)


def _add_metrics(reply: Message, values: Mapping[str, float]) -> None:
    """Put the guard's metrics in the reply's (first) MetricRecord, or a new one."""
    records = reply.content.metric_records
    if records:
        record = next(iter(records.values()))
    else:
        record = MetricRecord()
        reply.content["metrics"] = record
    for key, value in values.items():
        record[key] = value

