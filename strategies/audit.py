"""``AuditingStrategy``: an honest-but-curious server that inverts the client updates it receives.

It wraps any ``flwr.serverapp.strategy.Strategy`` the way Flower's own DP wrappers do: sampling,
aggregation and evaluation are the wrapped strategy's; the wrapper only *reads* each training
reply before it is aggregated. Per reply it

1. checks that the reply can be aggregated (``replies.corrupt_reason``; corrupt ones are
   recorded and withheld, so NaN weights never reach the model);
2. picks the attacked layer and builds a picklable job from the arrays the server sent that
   node and the arrays it sent back (``replies.build_job``);
3. hands the job to an executor (``executors``: inline, one worker process, a pool, Ray);
4. turns the outcome into a record with a verdict, pictures and, in audit mode, PSNR against
   the client's true samples (``scoring``), and stores it (``store.AuditStore``).

In ``blocking`` mode the round waits for its attacks and their statistics join the round's
MetricRecord; in ``background`` mode the wrapped strategy's aggregate is returned at once and
results are stored as they land. The aggregate never depends on the audit, and an attack
failure is recorded, never raised: a privacy audit must not take the federation down.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from fl_attack_flwr import verdicts
from fl_attack_flwr.executors import Executor, make_executor
from fl_attack_flwr.protocol import UPDATE_OF_PROTOCOL
from fl_attack_flwr.replies import (
    build_job,
    choose_layer,
    corrupt_reason,
    metric,
    partition_id,
    sample_indices,
    strip_ground_truth,
)
from fl_attack_flwr.running import error_outcome
from fl_attack_flwr.scoring import GroundTruth, InputView, score_images
from fl_attack_flwr.settings import AttackSettings
from fl_attack_flwr.store import AuditStore, ClientAudit

__all__ = ["AuditingStrategy"]

Outcome = dict[str, Any]


class AuditingStrategy(Strategy):
    """Wrap ``strategy`` (FedAvg by default) with a gradient-inversion privacy audit.

    Parameters
    ----------
    strategy : Strategy, optional
        The strategy that samples, aggregates and evaluates (unchanged by the audit).
    store : AuditStore, optional
        Where records, pictures and the report go; ``None`` keeps records in memory
        (:attr:`records`).
    attack : AttackSettings, optional
        How, where and when to attack (defaults: first linear layer, update read as a gradient
        and then as a FedAvg sum, one worker process, blocking).
    ground_truth : GroundTruth, optional
        Audit mode: the dataset the clients' reported ``sample-indices`` refer to.
    dataset : str, optional
        An ``fl_attack.data`` dataset the inputs come from (its shape and normalisation).
    input_shape : tuple of int, optional
        ``(C, H, W)`` of the model's input, to show reconstructions as pictures; inferred for
        square 1- or 3-channel inputs when not given (the report says so).
    input_transform : callable or (mean, std), optional
        Undoes the clients' normalisation (see ``scoring.InputView``).
    protocol : {"fedsgd", "fedavg", "dpsgd"}, optional
        The clients' training protocol, when known: it fixes how the update is read (otherwise
        ``attack.update`` decides, by default trying both readings).
    enabled : bool
        ``False`` makes the wrapper a pure pass-through (benchmark baseline).
    """

    def __init__(self, strategy: Strategy | None = None, *, store: AuditStore | None = None,
                 attack: AttackSettings | None = None, ground_truth: GroundTruth | None = None,
                 dataset: str | None = None, input_shape: tuple[int, int, int] | None = None,
                 input_transform: Callable[..., Any] | tuple[Any, Any] | None = None,
                 protocol: str | None = None, enabled: bool = True) -> None:
        super().__init__()
        self.strategy = strategy if strategy is not None else FedAvg()
        attack = attack or AttackSettings()
        if protocol is not None:
            if protocol not in UPDATE_OF_PROTOCOL:
                raise ValueError(f"unknown protocol {protocol!r}; choose one of "
                                 f"{list(UPDATE_OF_PROTOCOL)}")
            if attack.update == "auto":
                attack = dataclasses.replace(attack, update=UPDATE_OF_PROTOCOL[protocol])
        self.attack, self.store, self.protocol, self.enabled = attack, store, protocol, enabled
        self.ground_truth = ground_truth
        self.view = InputView(dataset, input_shape, input_transform)
        if store is not None and type(self.strategy).__name__.startswith("DifferentialPrivacy"):
            store.notes.append(
                f"Central DP ({type(self.strategy).__name__}) clips and noises the aggregate "
                "only: the server still receives every client's update, and this audit "
                "attacked those. Only noise added on the client (LocalDpMod, DP-SGD) reaches "
                "what the server sees.")
        self.records: list[ClientAudit] = []
        self.round_stats: dict[int, dict[str, Any]] = {}
        self._sent: dict[int, ArrayRecord] = {}
        self._current: ArrayRecord | None = None
        self._round_started: dict[int, float] = {}
        self._labels: dict[int, str] = {}
        self._sampler = random.Random(attack.sample_seed)
        self._lock = threading.RLock()
        self._inflight: dict[int, list[tuple[ClientAudit, Future[Outcome]]]] = {}
        self._executor: Executor | None = None
        self._finished: set[int] = set()

    def __repr__(self) -> str:
        return f"AuditingStrategy({self.strategy!r})"

    @property
    def weighted_by_key(self) -> str:
        """The weight key of the wrapped strategy (``num-examples`` for FedAvg and friends)."""
        return str(getattr(self.strategy, "weighted_by_key", "num-examples"))

    @property
    def executor(self) -> Executor:
        """The executor the attacks run on (created on first use)."""
        if self._executor is None:
            self._executor = make_executor(self.attack)
        return self._executor

    # ------------------------------------------------------------------ delegation

    def summary(self) -> None:
        """Log the audit settings, then the wrapped strategy's summary."""
        a = self.attack
        log(INFO, "\t├──> Privacy audit (%s):", "on" if self.enabled else "off")
        log(INFO, "\t│\t├── Attack: %s, update read as %s, budget %s s, device %s",
            a.method, a.update, a.max_seconds, a.device or "auto")
        log(INFO, "\t│\t├── Runs on: %s executor, %s mode, hard timeout %s s", a.executor,
            a.mode, a.timeout)
        log(INFO, "\t│\t├── Ground truth: %s", "yes (audit mode)" if self.ground_truth else "no")
        log(INFO, "\t│\t└── Output: %s", self.store.run_dir if self.store else "(memory)")
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate, remembering which arrays each node is sent (the attack's ``W0``)."""
        self._round_started[server_round] = time.perf_counter()
        self._current = arrays
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._sent = {m.metadata.dst_node_id: next(iter(m.content.array_records.values()))
                      for m in messages if len(m.content.array_records) == 1}
        if self.enabled and self._audits_round(server_round):
            self.executor.start()  # spawn workers / import torch while the clients train
        return messages

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate unchanged."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate unchanged."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run the federation (Flower's loop), then finish the audit (:meth:`close`)."""
        try:
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                                 evaluate_config, evaluate_fn)
        finally:
            self.close()

    def close(self) -> None:
        """Wait up to ``drain_timeout`` for background attacks, mark the rest ``unfinished``,
        and stop the executor."""
        deadline = time.monotonic() + self.attack.drain_timeout
        for rnd in sorted(self._inflight):
            for _, fut in list(self._inflight.get(rnd, [])):
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a timeout: recorded below
                    pass
        with self._lock:
            leftovers = [(rnd, rec, fut) for rnd, items in self._inflight.items()
                         for rec, fut in items if not fut.done()]
        for _, record, _ in leftovers:
            self._finish(record, error_outcome(verdicts.UNFINISHED, "the run ended before "
                                               f"the attack (drain timeout "
                                               f"{self.attack.drain_timeout:g}s)"))
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    # ------------------------------------------------------------------ the audit

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Attack the (sampled) replies, withhold corrupt ones, let the wrapped strategy
        aggregate, and merge the audit's round metrics into its MetricRecord."""
        replies = list(replies)
        if not self.enabled:
            arrays, metrics = self.strategy.aggregate_train(server_round, replies)
            self._round_done(server_round, [], 0.0, metrics)
            return arrays, metrics
        t0 = time.perf_counter()
        chosen = self._sample(server_round, replies)
        aggregate = self.attack.target == "aggregate" and self._audits_round(server_round)
        if aggregate:  # under secure aggregation no single update is visible
            chosen = {i: "secure aggregation: the server sees only the round's aggregate"
                      for i in chosen}
        keep, records, futures = [], [], []
        for i, reply in enumerate(replies):
            record, job = self._inspect(server_round, reply, chosen.get(i))
            records.append(record)
            if record.status != verdicts.CORRUPT:
                keep.append(reply)
            strip_ground_truth(reply)
            if job is None:
                self._finish(record, None)
            else:
                futures.append((record, self.executor.submit(job)))
        arrays, metrics = self.strategy.aggregate_train(server_round, keep)
        if aggregate and arrays is not None:
            record, job = self._aggregate_job(server_round, records, arrays)
            records.append(record)
            if job is None:
                self._finish(record, None)
            else:
                futures.append((record, self.executor.submit(job)))
        merged = MetricRecord(dict(metrics) if metrics is not None else {})
        if self.attack.mode == "blocking":
            for record, fut in futures:
                self._finish(record, _outcome_of(fut))
            stats = self._round_done(server_round, records, time.perf_counter() - t0, merged)
            for key, value in stats.items():
                merged[key] = value
        else:
            self._background(server_round, records, futures, t0)
            merged["audit-replies"] = len(records)
            merged["audit-submitted"] = len(futures)
        return arrays, merged

    def _audits_round(self, server_round: int) -> bool:
        return server_round in self.attack.round_filter

    def _sample(self, server_round: int, replies: list[Message]) -> dict[int, str | None]:
        """Reply index -> ``None`` (attack it) or why it is skipped (sampling rules)."""
        a = self.attack
        if not self._audits_round(server_round):
            return {i: f"round {server_round} is not audited (rounds = {a.rounds!r})"
                    for i in range(len(replies))}
        ok = [i for i, r in enumerate(replies) if not r.has_error()]
        take = len(ok) if a.fraction >= 1 else math.ceil(a.fraction * len(ok))
        take = min(take, a.max_per_round or take)
        picked = set(sorted(self._sampler.sample(ok, take))) if take < len(ok) else set(ok)
        return {i: None if i in picked else
                f"not sampled (fraction {a.fraction:g}, at most {a.max_per_round} per round)"
                for i in range(len(replies))}

    def _label(self, node_id: int) -> str:
        """A short, stable label for a node that does not report a partition id."""
        return self._labels.setdefault(node_id, f"node-{len(self._labels) + 1}")

    def _inspect(self, server_round: int, reply: Message, skip: str | None
                 ) -> tuple[ClientAudit, Any]:
        """The reply's record and attack job (``None``: nothing to attack; never raises)."""
        node = int(reply.metadata.src_node_id)
        record = ClientAudit(server_round, node, label=self._label(node), protocol=self.protocol)
        if reply.has_error():
            record.status, record.error = verdicts.CLIENT_ERROR, str(reply.error.reason)
            return record, None
        record.partition_id = partition_id(reply)
        sent = self._sent.get(node, self._current)
        reason = corrupt_reason(reply, sent, self.weighted_by_key)
        if reason is not None:
            record.status, record.error = verdicts.CORRUPT, reason
            return record, None
        self._read_metrics(record, reply)
        if skip is not None:
            record.status, record.reason = verdicts.SKIPPED, skip
            return record, None
        try:
            return record, self._job(record, sent, reply)
        except ValueError as exc:
            zero = "identically zero" in str(exc)
            record.status = verdicts.NO_UPDATE if zero else verdicts.ATTACK_ERROR
            record.error = None if zero else str(exc)
            record.reason = str(exc) if zero else None
            return record, None

    def _aggregate_job(self, server_round: int, records: list[ClientAudit],
                       aggregated: ArrayRecord) -> tuple[ClientAudit, Any]:
        """The record and job of the round's aggregate, ``W0 - W_aggregate``: a batch of every
        aggregated client's samples (ground truth: the union of their sample indices)."""
        clients = [r for r in records if r.status == verdicts.SKIPPED]
        record = ClientAudit(server_round, 0, label=f"aggregate-of-{len(clients)}",
                             protocol=self.protocol)
        record.inputs_are = (f"The round's aggregate of {len(clients)} clients' updates (what "
                             "a server under secure aggregation sees), attacked as one batch.")
        indices = [i for r in clients for i in (r.sample_indices or [])]
        record.sample_indices = indices if all(r.sample_indices for r in clients) else None
        record.num_examples = sum(r.num_examples or 0 for r in clients)
        try:
            sent = self._current
            if sent is None or not all(_same(self._sent.get(r.node_id, sent), sent)
                                       for r in clients):
                raise ValueError("the clients were sent different models: their aggregate is "
                                 "no single update")
            return record, self._job(record, sent, aggregated)
        except ValueError as exc:
            zero = "identically zero" in str(exc)
            record.status = verdicts.NO_UPDATE if zero else verdicts.ATTACK_ERROR
            record.reason, record.error = (str(exc), None) if zero else (None, str(exc))
            return record, None

    def _read_metrics(self, record: ClientAudit, reply: Message) -> None:
        num = metric(reply, self.weighted_by_key)
        record.num_examples = None if num is None else int(num)
        record.epsilon = metric(reply, "epsilon")
        record.epsilon_cumulative = metric(reply, "epsilon-cumulative")
        record.delta = metric(reply, "delta")
        record.noise_std = metric(reply, "noise-std")
        record.sample_indices = sample_indices(reply)

    def _job(self, record: ClientAudit, sent: ArrayRecord | None,
             returned: Message | ArrayRecord) -> Any:
        if sent is None:
            raise ValueError("the server has no record of the arrays it sent this node")
        if isinstance(returned, Message):
            returned = next(iter(returned.content.array_records.values()))
        g_state = {k: v.numpy() for k, v in sent.items()}
        n_state = {k: v.numpy() for k, v in returned.items()}
        layer = choose_layer(g_state, self.attack.weight_key, self.attack.bias_key)
        record.layer, record.layer_shape = layer.weight_key, list(layer.shape)
        if not layer.first_is_linear:
            record.inputs_are = (f"The attacked layer {layer.weight_key} is not the model's "
                                 "first layer: the reconstructions are its input features, "
                                 "not the raw inputs.")
        job = build_job(record.server_round, record.node_id, record.client_label, g_state,
                        n_state, layer, self.attack)
        log(INFO, "[audit] round %d, %s: attacking %s %s (read as %s)", record.server_round,
            record.client_label, layer.weight_key, layer.shape, " then ".join(job.readings))
        return job

    # ------------------------------------------------------------------ results

    def _finish(self, record: ClientAudit, outcome: Outcome | None) -> None:
        """Apply an attack's outcome to its record, score it, store it, log one line (once
        per record: a background result and the end of the run may race)."""
        with self._lock:
            if id(record) in self._finished:
                return
            self._finished.add(id(record))
        if outcome is not None:
            self._apply(record, outcome)
            if record.reconstructed:
                self._pictures(record)
        with self._lock:
            self.records.append(record)
            if self.store is not None:
                try:
                    self.store.add(record)
                except OSError as exc:  # storage trouble must not stop training
                    log(WARNING, "[audit] could not store %s: %s", record.client_label, exc)
        self._log(record)

    @staticmethod
    def _apply(record: ClientAudit, outcome: Outcome) -> None:
        record.status, record.reason = outcome["status"], outcome.get("reason")
        record.error, record.reading = outcome.get("error"), outcome.get("reading")
        record.attack_seconds = float(outcome.get("seconds") or 0.0)
        summary = outcome.get("summary")
        if summary is not None:
            record.attack = summary
            record.batch_size = int(summary["batch_size"])
            record.sparsity_match = summary["sparsity_match"]
            record.exact = bool(summary["exact"])
            record.n_directions = int(summary["n_directions"])
        record.inputs = outcome.get("inputs")

    def _pictures(self, record: ClientAudit) -> None:
        """Pictures of the reconstruction; in audit mode, matched to the truth and scored."""
        try:
            images, inferred = self.view.images(record.inputs)
        except ValueError as exc:
            record.error = f"pictures: {exc}"
            return
        if images is None:
            record.inputs_are = record.inputs_are or ("The inputs are not images: the first "
                                                      "reconstructed rows are shown as numbers.")
            return
        record.recon_images = images
        if inferred and record.inputs_are is None:
            record.inputs_are = (f"Input shape {images.shape[1:]} inferred from the layer's "
                                 f"{images[0].size} inputs; pictures scaled per image.")
        if self.ground_truth is None or not record.sample_indices:
            return
        try:
            originals = self.ground_truth.images(record.sample_indices)
            score = score_images(images, originals)
        except ValueError as exc:
            record.error = f"scoring failed: {exc}"
            return
        record.true_batch_size = int(originals.shape[0])
        record.psnr, record.psnr_mean = score.psnr, score.psnr_mean
        record.matching, record.recon_images = score.matching, score.matched
        record.original_images = originals.numpy()

    def _log(self, record: ClientAudit) -> None:
        lam = "" if record.sparsity_match is None else f", λ={record.sparsity_match:.4f}"
        psnr = "" if record.psnr_mean is None else f", PSNR {record.psnr_mean:.1f} dB"
        secs = "" if record.attack_seconds is None else f", {record.attack_seconds:.1f}s"
        why = record.reason or record.error
        level = WARNING if record.status in verdicts.ERRORS + (verdicts.CORRUPT,) else INFO
        log(level, "[audit] round %d, %s: %s%s%s%s%s", record.server_round, record.client_label,
            record.status, lam, psnr, secs, f" ({why})" if why else "")

    def _background(self, server_round: int, records: list[ClientAudit],
                    futures: list[tuple[ClientAudit, Future[Outcome]]], t0: float) -> None:
        """Finish each record when its attack lands; the round's metrics when all have."""
        with self._lock:
            self._inflight[server_round] = futures
        left = [len(futures)]

        def done(record: ClientAudit, fut: Future[Outcome]) -> None:
            self._finish(record, _outcome_of(fut))
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
                if last:
                    self._inflight.pop(server_round, None)
            if last:
                self._round_done(server_round, records, time.perf_counter() - t0, None)

        if not futures:
            self._round_done(server_round, records, time.perf_counter() - t0, None)
        for record, fut in futures:
            fut.add_done_callback(lambda f, r=record: done(r, f))

    def _round_done(self, server_round: int, records: list[ClientAudit], seconds: float,
                    metrics: MetricRecord | None) -> dict[str, float]:
        """The round's audit statistics, kept and stored; returned for the MetricRecord."""
        stats = round_metrics(records, seconds) if self.enabled else {}
        started = self._round_started.pop(server_round, None)
        info: dict[str, Any] = dict(stats)
        if started is not None:
            info["train-round-seconds"] = time.perf_counter() - started
        with self._lock:
            self.round_stats[server_round] = info
            if self.store is not None:
                self.store.add_round(server_round, {**info,
                                                    "aggregated": dict(metrics or {})})
        if self.enabled and records:
            log(INFO, "[audit] round %d: %d replies, %d certified, %d reconstructed, "
                "%d protected, %d without answer, attacks %.1fs", server_round,
                int(stats["audit-replies"]), int(stats["audit-certified"]),
                int(stats["audit-reconstructions"]), int(stats["audit-protected"]),
                int(stats["audit-failures"]), stats["audit-attack-seconds"])
        return stats


def _same(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two ArrayRecords hold the same arrays."""
    return a is b or (a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy())
                                                  for k in a.keys()))


def _outcome_of(fut: Future[Outcome]) -> Outcome:
    """A finished future's outcome; a cancelled or failed one becomes an error outcome."""
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001 - CancelledError included
        status = verdicts.UNFINISHED if fut.cancelled() else verdicts.ATTACK_ERROR
        return error_outcome(status, f"{type(exc).__name__}: {exc}")


def round_metrics(records: list[ClientAudit], seconds: float) -> dict[str, float]:
    """The audit's numbers for a round's MetricRecord (numbers only, as Flower requires)."""
    done = [r for r in records if r.reconstructed]

    def n(*statuses: str) -> int:
        return sum(1 for r in records if r.status in statuses)

    stats: dict[str, float] = {
        "audit-replies": len(records),
        "audit-reconstructions": len(done),
        "audit-certified": n(verdicts.CERTIFIED),
        "audit-protected": n(verdicts.PROTECTED),
        "audit-skipped": n(verdicts.SKIPPED),
        "audit-failures": n(*verdicts.ERRORS),
        "audit-corrupt": n(verdicts.CORRUPT),
        "audit-client-errors": n(verdicts.CLIENT_ERROR),
        "audit-attack-seconds": float(sum(r.attack_seconds or 0.0 for r in records)),
        "audit-seconds": float(seconds),
    }
    lams = [r.sparsity_match for r in done if r.sparsity_match is not None]
    if lams:
        stats["audit-lambda-mean"] = float(np.mean(lams))
    psnrs = [r.psnr_mean for r in done if r.psnr_mean is not None and math.isfinite(r.psnr_mean)]
    if psnrs:
        stats["audit-psnr-mean"] = float(np.mean(psnrs))
    return stats
