"""``AuditingStrategy``: an honest-but-curious server that inverts the client updates it receives.

It wraps any ``flwr.serverapp.strategy.Strategy`` the way Flower's own DP wrappers do: sampling,
aggregation and evaluation are the wrapped strategy's; the wrapper only *reads* each training
reply before it is aggregated (and stores each round's evaluation beside it:
``evaluations.EvaluationLog``). A reply goes one way through the plugin's rooms:

1. ``intake``: can the reply be aggregated (corrupt ones are recorded and withheld, so NaN
   weights never reach the model), what does it say, and its work: a picklable attack job built
   from the arrays the server sent that node and the arrays it sent back (``jobs.build``), or
   the outcome that says why there is none;
2. ``executors``: the job runs inline, on a worker process, a pool or Ray (``jobs.run``) and
   comes back as an ``AttackOutcome``;
3. ``results``: the reply's record, from what the intake read, the outcome and its pictures (in
   audit mode scored by PSNR against the client's true samples);
4. ``output``: the store writes it; at the end the summary, the report and the privacy gate.

In ``blocking`` mode the round waits for its attacks and their statistics join the round's
MetricRecord; in ``background`` mode the wrapped strategy's aggregate is returned at once and
results are stored as they land. The aggregate never depends on the audit, and an attack
failure is recorded, never raised: a privacy audit must not take the federation down.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from fl_attack_flwr import verdicts
from fl_attack_flwr.background import InFlight, RoundTimes
from fl_attack_flwr.evaluations import EvaluationLog
from fl_attack_flwr.executors.base import Executor, outcome_of
from fl_attack_flwr.executors.processes import make_executor
from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.intake.reply import (
    Intake,
    Work,
    aggregate_intake,
    reply_intake,
    sample_replies,
)
from fl_attack_flwr.jobs.model_plan import ModelPlan
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.output.summary import accountant_notes, strategy_notes
from fl_attack_flwr.results.pictures import GroundTruth, InputView
from fl_attack_flwr.results.records import (
    ClientAudit,
    log_record,
    log_round,
    record_of,
    round_metrics,
)
from fl_attack_flwr.results.text import TextTruth
from fl_attack_flwr.settings import UPDATE_OF_PROTOCOL, AttackSettings

Pending = list[tuple[ReplyFacts, Future[AttackOutcome]]]


class AuditingStrategy(EvaluationLog):
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
    ground_truth : GroundTruth or TextTruth, optional
        Audit mode: the dataset (images) or the sentences (text) the clients' reported
        ``sample-indices`` refer to.
    dataset : str, optional
        An ``fl_attack.testbed.data`` dataset the inputs come from (its shape and normalisation).
    input_shape : tuple of int, optional
        ``(C, H, W)`` of the model's input, to show reconstructions as pictures; inferred for
        square 1- or 3-channel inputs when not given (the report says so).
    input_transform : callable or (mean, std), optional
        Undoes the clients' normalisation (see ``results.pictures.InputView``).
    protocol : {"fedsgd", "fedavg", "dpsgd"}, optional
        The clients' training protocol, when known: it fixes how the update is read (otherwise
        ``attack.update`` decides, by default trying both readings).
    model : nn.Module or callable, optional
        The clients' model (an instance, or its class / a factory with no arguments). Where the
        attacked layer is not the first (a CNN's ``fc1``), the attack recovers that layer's
        input features exactly, and the model turns them into pictures: the server runs the
        layers before it with the weights it sent (``fl_attack.pixels``). It also lets the
        audit check what the attack assumes (a ReLU right after the attacked layer). A language
        model's (the text attack, DAGER): a ``transformers`` config, a model, or a factory.
    tokenizer : tokenizer or str, optional
        A language model's tokenizer (or its path), to decode the sentences read.
    pixel_seconds : float
        Time budget of the pictures estimated from features, per update.
    enabled : bool
        ``False`` makes the wrapper a pure pass-through (benchmark baseline).
    """

    def __init__(self, strategy: Strategy | None = None, *, store: AuditStore | None = None,
                 attack: AttackSettings | None = None,
                 ground_truth: GroundTruth | TextTruth | None = None,
                 dataset: str | None = None, input_shape: tuple[int, int, int] | None = None,
                 input_transform: Callable[..., Any] | tuple[Any, Any] | None = None,
                 protocol: str | None = None, model: Any = None, tokenizer: Any = None,
                 pixel_seconds: float = 60.0, enabled: bool = True) -> None:
        super().__init__(strategy if strategy is not None else FedAvg(), store)
        attack = attack or AttackSettings()
        if protocol is not None:
            if protocol not in UPDATE_OF_PROTOCOL:
                raise ValueError(f"unknown protocol {protocol!r}; choose one of "
                                 f"{list(UPDATE_OF_PROTOCOL)}")
            if attack.update == "auto":
                attack = dataclasses.replace(attack, update=UPDATE_OF_PROTOCOL[protocol])
        self.attack, self.store, self.protocol, self.enabled = attack, store, protocol, enabled
        self.ground_truth, self.tokenizer = ground_truth, tokenizer
        self.view = InputView(dataset, input_shape, input_transform)
        self.model = None if model is None else ModelPlan(
            model, input_shape=self.view.model_shape(), bounds=self.view.bounds(),
            max_seconds=pixel_seconds)
        if store is not None:
            store.notes += strategy_notes(self.strategy)
        self.records: list[ClientAudit] = []
        self.round_stats: dict[int, dict[str, Any]] = {}
        self._sent: dict[int, ArrayRecord] = {}
        self._current: ArrayRecord | None = None
        self._times = RoundTimes()
        self._labels: dict[int, str] = {}
        self._sampler = random.Random(attack.sample_seed)
        self._lock = threading.RLock()
        self._inflight = InFlight()
        self._executor: Executor | None = None
        self._done: dict[ReplyFacts, ClientAudit] = {}

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
        _log_settings(self.attack, self.enabled, self.ground_truth is not None,
                      str(self.store.run_dir) if self.store else "(memory)")
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate, remembering which arrays each node is sent (the attack's ``W0``)."""
        self._times.start(server_round)
        self._current = arrays
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._sent = {m.metadata.dst_node_id: next(iter(m.content.array_records.values()))
                      for m in messages if len(m.content.array_records) == 1}
        if self.enabled and self._audits_round(server_round):
            self.executor.start()  # spawn workers / import torch while the clients train
        return messages

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
        for facts in self._inflight.drain(self.attack.drain_timeout):
            self._finish(facts, error_outcome(
                verdicts.UNFINISHED, "the run ended before the attack (drain timeout "
                f"{self.attack.drain_timeout:g}s)"))
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        if self.store is not None:
            self.store.notes += accountant_notes(self.strategy)

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
        chosen = sample_replies(self.attack, self._sampler, server_round, replies)
        aggregate = self.attack.target == "aggregate" and self._audits_round(server_round)
        if aggregate:  # under secure aggregation no single update is visible
            chosen = {i: "secure aggregation: the server sees only the round's aggregate"
                      for i in chosen}
        ctx = Intake(server_round, self.attack, self.weighted_by_key, self.protocol,
                     self._current, dict(self._sent), self.model, self.tokenizer)
        keep, replied, futures = [], [], []
        for i, reply in enumerate(replies):
            node = int(reply.metadata.src_node_id)
            facts, work = reply_intake(ctx, reply, self._label(node), chosen.get(i))
            if not (isinstance(work, AttackOutcome) and work.status == verdicts.CORRUPT):
                keep.append(reply)
            replied.append((facts, work))
            self._submit(facts, work, futures)
        facts_of_round = [facts for facts, _ in replied]
        arrays, metrics = self.strategy.aggregate_train(server_round, keep)
        if aggregate and arrays is not None:
            clients = [f for f, w in replied
                       if isinstance(w, AttackOutcome) and w.status == verdicts.SKIPPED]
            facts, work = aggregate_intake(ctx, clients, arrays)
            facts_of_round.append(facts)
            self._submit(facts, work, futures)
        merged = MetricRecord(dict(metrics) if metrics is not None else {})
        if self.attack.mode == "blocking":
            for facts, fut in futures:
                self._finish(facts, outcome_of(fut))
            stats = self._round_done(server_round, facts_of_round, time.perf_counter() - t0,
                                     merged)
            for key, value in stats.items():
                merged[key] = value
        else:
            self._times.aggregate_left(server_round)
            self._background(server_round, facts_of_round, futures, t0)
            merged["audit-replies"] = len(facts_of_round)
            merged["audit-submitted"] = len(futures)
        return arrays, merged

    def _submit(self, facts: ReplyFacts, work: Work, futures: Pending) -> None:
        """Hand an attack job to the executor, or finish the reply's record at once when there
        is no job or the background queue is full (``max_queue``: the reply is ``skipped``,
        saying why)."""
        limit = self.attack.max_queue if self.attack.mode == "background" else None
        waiting = self._inflight.queued() + len(futures)
        if not isinstance(work, AttackOutcome) and limit is not None and waiting >= limit:
            work = AttackOutcome(verdicts.SKIPPED,
                                 reason=f"the audit queue is full ({limit} attacks waiting)")
        if isinstance(work, AttackOutcome):
            self._finish(facts, work)
        else:
            futures.append((facts, self.executor.submit(work)))

    def _audits_round(self, server_round: int) -> bool:
        return server_round in self.attack.round_filter

    def _label(self, node_id: int) -> str:
        """A short, stable label for a node that does not report a partition id."""
        return self._labels.setdefault(node_id, f"node-{len(self._labels) + 1}")

    def _finish(self, facts: ReplyFacts, outcome: AttackOutcome) -> None:
        """Build the reply's record (pictures and scores for a reconstruction), store it, log
        one line; once per reply: a background result and the end of the run may race."""
        with self._lock:
            if facts in self._done:
                return
        record = record_of(facts, outcome, self.view, self.ground_truth)
        with self._lock:
            if facts in self._done:
                return
            self._done[facts] = record
            self.records.append(record)
            if self.store is not None:
                try:
                    self.store.add(record)
                except OSError as exc:  # storage trouble must not stop training
                    log(WARNING, "[audit] could not store %s: %s", record.client_label, exc)
        log_record(record)

    def _background(self, server_round: int, facts_of_round: list[ReplyFacts],
                    futures: Pending, t0: float) -> None:
        """Finish each record when its attack lands; the round's metrics when all have."""
        self._inflight.track(
            server_round, futures, lambda facts, fut: self._finish(facts, outcome_of(fut)),
            lambda: self._round_done(server_round, facts_of_round, time.perf_counter() - t0,
                                     None))

    def _round_done(self, server_round: int, facts_of_round: list[ReplyFacts], seconds: float,
                    metrics: MetricRecord | None) -> dict[str, float]:
        """The round's audit statistics, kept and stored; returned for the MetricRecord."""
        with self._lock:
            records = [self._done[f] for f in facts_of_round if f in self._done]
        stats = round_metrics(records, seconds) if self.enabled else {}
        info: dict[str, Any] = dict(stats)
        wall, done = self._times.finish(server_round)
        if wall is not None:
            info["train-round-seconds"] = wall  # configure_train until the aggregate
            info["audit-done-seconds"] = done  # ... until the round's attacks were done
        with self._lock:
            self.round_stats[server_round] = info
            if self.store is not None:
                self.store.add_round(server_round, {**info,
                                                    "aggregated": dict(metrics or {})})
        if self.enabled and records:
            log_round(server_round, stats, self._inflight.queued())
        return stats


def _log_settings(a: AttackSettings, enabled: bool, ground_truth: bool, output: str) -> None:
    """The audit's part of the strategy summary Flower logs at the start."""
    info = logging.getLogger("flwr").info
    info("\t├──> Privacy audit (%s):", "on" if enabled else "off")
    info("\t│\t├── Attack: %s, update read as %s, budget %s s, device %s", a.method, a.update,
         a.max_seconds, a.device or "auto")
    info("\t│\t├── Runs on: %s executor, %s mode, hard timeout %s s", a.executor, a.mode,
         a.timeout)
    info("\t│\t├── Ground truth: %s", "yes (audit mode)" if ground_truth else "no")
    info("\t│\t└── Output: %s", output)
