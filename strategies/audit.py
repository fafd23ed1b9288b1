"""``AuditingStrategy``: an honest-but-curious server that inverts every client update it receives.

It wraps any ``flwr.serverapp.strategy.Strategy`` the way Flower's own DP wrappers do
(``DifferentialPrivacyServerSideFixedClipping``): sampling, aggregation and evaluation are the
wrapped strategy's; the wrapper only *reads* each training reply before it is aggregated:

1. derive the first linear layer's update pair ``(W0 - W_E, b0 - b_E)`` from the arrays the
   server sent that node this round and the arrays it sent back (``fl_attack.updates``);
2. run the exact gradient-inversion attack (``fl_attack.invert``, SPEAR++ by default, CUDA when
   available) under a time budget, optionally in a worker process with a hard timeout;
3. score it against the client's true samples when the simulation runs in audit mode;
4. store the reconstruction and its metrics (:class:`fl_attack_flwr.store.AuditStore`);
5. hand the replies to the wrapped strategy, which aggregates them unchanged, and merge the
   round's audit metrics into the MetricRecord it returns.

Failure policy (a privacy audit must never take the federation down):

* a client that raised (error reply) is recorded as ``client-error`` and passed on to the wrapped
  strategy untouched (FedAvg skips error replies itself; the DP wrappers skip the round);
* a *corrupt* reply (not exactly one ArrayRecord, arrays missing/extra, wrong shape, non-numeric,
  NaN/inf, or no valid ``num-examples``) is recorded as ``corrupt`` and **withheld from
  aggregation** with a logged warning: FedAvg would crash on wrong shapes and silently turn the
  global model into NaN on NaN weights;
* an attack that raises or runs out of time is recorded (``attack-error`` / ``timeout``, with the
  error in ``metrics.jsonl``) and the round goes on; the reply is still aggregated.

The attack runs inside ``aggregate_train``, after all replies arrived: Flower's round timeout
(``Strategy.start(timeout=...)``, default 3600 s) only bounds the wait for replies in
``grid.send_and_receive``, so a long attack cannot make Flower drop the round. Its cost is bounded
per client by ``max_seconds`` (soft budget inside the attack) and ``timeout`` (hard, kills the
worker process).

Round metrics merged into the wrapped strategy's MetricRecord: ``audit-replies``,
``audit-reconstructions``, ``audit-certified-exact`` (λ = 1), ``audit-lambda-mean``,
``audit-psnr-mean`` (audit mode only), ``audit-failures`` (attack error / timeout / no update),
``audit-corrupt``, ``audit-client-errors``, ``audit-attack-seconds`` (sum over the clients'
attacks) and ``audit-seconds`` (the whole audit: attacks, scoring, storage).

Audit-only side channel: in audit mode clients add ``sample-indices`` to the ``client-info``
ConfigRecord of their reply; the wrapper strips it before the wrapped strategy sees the reply.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fl_attack_flwr.store import AuditStore, ClientAudit

__all__ = [
    "CLIENT_INFO_KEY",
    "PARTITION_ID_KEY",
    "SAMPLE_INDICES_KEY",
    "AttackSettings",
    "AttackTimeout",
    "AttackWorker",
    "AuditingStrategy",
    "GroundTruth",
    "run_inversion",
]

#: Name of the ConfigRecord in a client's reply that carries its partition id (and, in audit
#: mode, the indices of the samples it trained on).
CLIENT_INFO_KEY = "client-info"
PARTITION_ID_KEY = "partition-id"
SAMPLE_INDICES_KEY = "sample-indices"


# --------------------------------------------------------------------------- attack execution


class AttackTimeout(TimeoutError):
    """The attack did not finish within its hard timeout (its worker process was killed)."""


@dataclass
class AttackSettings:
    """How the server attacks each update.

    Attributes:
        method: ``"spear++"`` or ``"spear"`` (``fl_attack.invert``'s ``method``).
        max_seconds: soft per-attack budget passed to ``invert`` (it returns its best selection
            when the budget runs out). ``None``: unlimited.
        timeout: hard per-attack limit in seconds. When set, attacks run in a persistent worker
            process (spawned once, warm) that is killed and restarted on timeout; when ``None``
            they run inline in the server process.
        device: ``None`` / ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ...
        seed: the attack's random seed.
        options: further ``fl_attack.AttackConfig`` fields (e.g. ``{"steps": 200}``).
        weight_key / bias_key: the attacked layer; default the first linear layer.
        startup_timeout: seconds allowed for the worker process to start (import torch).
        next_layer: also pass the next linear layer's update (the one this layer's ReLU feeds)
            as ``next_weight_grad``, so verified samples are peeled off and the rest is searched
            as a smaller batch (``fl_attack.peel``). Skipped for ``update="fedavg"``, for
            ``sparse`` other than ``"output"`` and when the model has no such layer.
    """

    method: str = "spear++"
    max_seconds: float | None = 120.0
    timeout: float | None = None
    device: str | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    weight_key: str | None = None
    bias_key: str | None = None
    startup_timeout: float = 300.0
    next_layer: bool = True

    def uses_next_layer(self) -> bool:
        """Whether the options allow peeling with the next layer's update."""
        return (self.next_layer and self.options.get("update", "gradient") != "fedavg"
                and self.options.get("sparse", "output") == "output")

    def invert_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`run_inversion` (besides the arrays)."""
        options = dict(self.options)
        if self.max_seconds is not None and self.max_seconds > 0:
            options.setdefault("max_seconds", float(self.max_seconds))
        device = None if self.device in (None, "", "auto") else self.device
        return {"method": self.method, "seed": int(self.seed), "device": device,
                "options": options}


def run_inversion(
    weight_grad: np.ndarray,
    bias_grad: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    next_weight_grad: np.ndarray | None = None,
    *,
    method: str,
    seed: int,
    device: str | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """Run ``fl_attack.invert`` and return plain data (picklable, for the worker process).

    Returns ``inputs`` ((B, n) float64 array) plus the scalar fields of the Reconstruction and
    its ``as_dict()`` summary under ``summary``.
    """
    from fl_attack import invert

    rec = invert(
        torch.as_tensor(weight_grad), torch.as_tensor(bias_grad),
        weight=torch.as_tensor(weight), bias=torch.as_tensor(bias),
        next_weight_grad=None if next_weight_grad is None else torch.as_tensor(next_weight_grad),
        method=method, seed=seed, device=device, **dict(options),
    )
    lam = rec.sparsity_match
    return {
        "inputs": rec.inputs.detach().cpu().double().numpy(),
        "batch_size": int(rec.batch_size),
        "sparsity_match": None if lam is None else float(lam),
        "exact": bool(rec.exact),
        "n_directions": int(rec.n_directions),
        "seconds": float(rec.seconds),
        "summary": rec.as_dict(),
    }


def _worker_loop(conn: Any) -> None:
    """Body of the attack worker process: import once, then serve inversion jobs until EOF."""
    try:
        import fl_attack  # noqa: F401  (warm the imports before announcing readiness)

        conn.send(("ready", None))
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):
                return
            if job is None:
                return
            try:
                out = run_inversion(*job["arrays"], **job["kwargs"])
                conn.send(("ok", out))
            except Exception as exc:  # noqa: BLE001 - reported to the server, never fatal
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except KeyboardInterrupt:
        return


class AttackWorker:
    """One persistent ``spawn`` process that runs inversions, so a stuck attack can be killed.

    Spawn (not fork) keeps CUDA and Ray safe. The process is started lazily (or early with
    :meth:`start`, to import torch while clients train), reused across attacks, killed on a
    timeout and restarted on the next call. It exits when the server process closes the pipe.
    """

    def __init__(self, startup_timeout: float = 300.0) -> None:
        self.startup_timeout = startup_timeout
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        """Spawn the worker if it is not running (returns at once; readiness is awaited later)."""
        if self.alive:
            return
        self.close()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_loop, args=(child,), daemon=True,
                           name="fl-attack-worker")
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def ensure_ready(self) -> None:
        """Start the worker if needed and wait (``startup_timeout``) until it has imported."""
        self.start()
        self._await_ready()

    def _await_ready(self) -> None:
        if self._ready:
            return
        if not self._conn.poll(self.startup_timeout):
            self.kill()
            raise RuntimeError(f"attack worker did not start within {self.startup_timeout:.0f}s")
        try:
            status, _ = self._conn.recv()
        except (EOFError, OSError) as exc:
            self.kill()
            raise RuntimeError("attack worker died while starting") from exc
        if status != "ready":
            self.kill()
            raise RuntimeError(f"attack worker sent {status!r} instead of 'ready'")
        self._ready = True

    def run(self, arrays: tuple[np.ndarray, ...], kwargs: Mapping[str, Any],
            timeout: float) -> dict[str, Any]:
        """Run one inversion; ``AttackTimeout`` (worker killed) after ``timeout`` seconds."""
        self.start()
        self._await_ready()
        self._conn.send({"arrays": arrays, "kwargs": dict(kwargs)})
        if not self._conn.poll(timeout):
            self.kill()
            raise AttackTimeout(f"attack exceeded its hard timeout of {timeout:g}s "
                                "(worker process killed)")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._proc.exitcode if self._proc is not None else None
            self.kill()
            raise RuntimeError(f"attack worker died (exit code {code})") from exc
        if status == "error":
            raise RuntimeError(payload)
        return payload

    def kill(self) -> None:
        """Terminate the worker now (it is restarted on the next :meth:`run`)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._close_conn()
        self._proc, self._ready = None, False

    def close(self) -> None:
        """Ask the worker to exit, then make sure it has."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(None)
                self._proc.join(timeout=5)
            except (OSError, ValueError):
                pass
        self.kill()

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = None


# --------------------------------------------------------------------------- ground truth


class GroundTruth:
    """The audit's ground truth: the same dataset the clients load, indexed by sample id.

    Only used in audit mode, where clients report which samples they trained on. Loading is
    lazy and cached (photo pools take a while to generate).
    """

    def __init__(self, dataset: str, size: int | None = None, *, seed: int = 0,
                 root: str | None = None) -> None:
        self.dataset, self.size, self.seed, self.root = dataset, size, seed, root
        self._images: torch.Tensor | None = None

    def images(self, indices: Iterable[int]) -> torch.Tensor:
        """``(B, C, H, W)`` float images in ``[0, 1]`` for the given dataset indices."""
        if self._images is None:
            from fl_attack.data import load_images

            self._images, _ = load_images(self.dataset, self.size, seed=self.seed,
                                          root=self.root)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if idx.numel() == 0:
            raise ValueError("no sample indices")
        if int(idx.min()) < 0 or int(idx.max()) >= self._images.shape[0]:
            raise ValueError(f"sample index out of range [0, {self._images.shape[0]})")
        return self._images[idx]


# --------------------------------------------------------------------------- reply checks


def _next_layer_update(global_state: dict[str, np.ndarray], new_state: dict[str, np.ndarray],
                       weight_key: str | None, outputs: int) -> np.ndarray | None:
    """``W0 - W_E`` of the linear layer after the attacked one, if it takes its ``outputs``."""
    from fl_attack.updates import layer_keys, weight_update_pair

    keys = [w for w, _ in layer_keys(global_state)]
    at = keys.index(weight_key) if weight_key in keys else 0 if weight_key is None else -1
    if at < 0 or at + 1 >= len(keys):
        return None
    try:
        dw2, *_ = weight_update_pair(global_state, new_state, weight_key=keys[at + 1])
    except ValueError:
        return None
    return dw2.numpy() if dw2.shape[1] == outputs else None


def _weight_of(metrics: MetricRecord, key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def corrupt_reason(reply: Message, global_arrays: ArrayRecord | None,
                   weighted_by_key: str = "num-examples") -> str | None:
    """Why a (non-error) training reply cannot be aggregated, or ``None`` when it can.

    Checks what FedAvg relies on: exactly one ArrayRecord with the same array names and shapes as
    the global model, numeric and finite, and exactly one MetricRecord with a positive finite
    ``weighted_by_key``.
    """
    content = reply.content
    if len(content.array_records) != 1:
        return f"expected exactly one ArrayRecord, got {len(content.array_records)}"
    record = next(iter(content.array_records.values()))
    if global_arrays is not None:
        missing = sorted(set(global_arrays.keys()) - set(record.keys()))
        extra = sorted(set(record.keys()) - set(global_arrays.keys()))
        if missing:
            return f"missing arrays {missing}"
        if extra:
            return f"unexpected arrays {extra}"
    for key, arr in record.items():
        try:
            value = arr.numpy()
        except Exception as exc:  # noqa: BLE001 - undecodable payload
            return f"array {key!r} cannot be decoded: {exc}"
        if global_arrays is not None:
            want = tuple(global_arrays[key].shape)
            if tuple(value.shape) != want:
                return f"array {key!r} has shape {tuple(value.shape)}, expected {want}"
        if not (np.issubdtype(value.dtype, np.number) and not np.iscomplexobj(value)):
            return f"array {key!r} is not real numeric (dtype {value.dtype})"
        if not np.isfinite(value).all():
            return f"array {key!r} contains NaN or inf"
    if len(content.metric_records) != 1:
        return f"expected exactly one MetricRecord, got {len(content.metric_records)}"
    metrics = next(iter(content.metric_records.values()))
    if _weight_of(metrics, weighted_by_key) is None:
        return f"MetricRecord lacks a positive finite {weighted_by_key!r}"
    return None


def _client_info(reply: Message) -> ConfigRecord | None:
    if reply.has_content() and CLIENT_INFO_KEY in reply.content.config_records:
        return reply.content.config_records[CLIENT_INFO_KEY]
    return None


def _partition_id(reply: Message) -> int | None:
    info = _client_info(reply)
    for source in ([info] if info is not None else []) + (
        list(reply.content.metric_records.values()) if reply.has_content() else []
    ):
        value = source.get(PARTITION_ID_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def _metric(reply: Message, key: str) -> float | None:
    if not reply.has_content():
        return None
    for record in reply.content.metric_records.values():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


# --------------------------------------------------------------------------- the strategy


class AuditingStrategy(Strategy):
    """Wrap ``strategy`` (FedAvg by default) with a gradient-inversion privacy audit.

    Args:
        strategy: the strategy that samples, aggregates and evaluates (unchanged).
        store: where reconstructions and metrics go; ``None`` keeps records in memory only
            (:attr:`records`).
        attack: how to attack (:class:`AttackSettings`).
        ground_truth: audit mode: the dataset the clients' ``sample-indices`` refer to.
        dataset: name of the image dataset the model's inputs come from (``fl_attack.data``),
            used to turn reconstructed inputs back into images; ``None``: no images.
        protocol: the clients' training protocol, recorded with each result.
        enabled: ``False`` makes the wrapper a pure pass-through (benchmark baseline).
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        *,
        store: AuditStore | None = None,
        attack: AttackSettings | None = None,
        ground_truth: GroundTruth | None = None,
        dataset: str | None = None,
        protocol: str | None = None,
        enabled: bool = True,
    ) -> None:
        super().__init__()
        self.strategy = strategy if strategy is not None else FedAvg()
        self.store = store
        self.attack = attack or AttackSettings()
        self.ground_truth = ground_truth
        self.dataset = dataset
        self.protocol = protocol
        self.enabled = enabled
        self.records: list[ClientAudit] = []
        self.round_stats: dict[int, dict[str, float]] = {}
        self._round_started: dict[int, float] = {}
        self._current_arrays: ArrayRecord | None = None
        self._sent: dict[int, ArrayRecord] = {}
        self._worker = (AttackWorker(self.attack.startup_timeout)
                        if self.attack.timeout is not None else None)

    def __repr__(self) -> str:
        return f"AuditingStrategy({self.strategy!r})"

    # ------------------------------------------------------------------ delegation

    @property
    def weighted_by_key(self) -> str:
        """The weight key of the wrapped strategy (``num-examples`` for FedAvg and friends)."""
        return str(getattr(self.strategy, "weighted_by_key", "num-examples"))

    def summary(self) -> None:
        """Log the audit settings, then the wrapped strategy's summary."""
        a = self.attack
        log(INFO, "\t├──> Privacy audit (%s):", "on" if self.enabled else "off")
        log(INFO, "\t│\t├── Attack: %s, budget %s s, hard timeout %s, device %s",
            a.method, a.max_seconds, a.timeout, a.device or "auto")
        log(INFO, "\t│\t├── Ground truth: %s",
            "yes (audit mode)" if self.ground_truth is not None else "no")
        log(INFO, "\t│\t└── Output: %s", self.store.run_dir if self.store else "(memory)")
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate, remembering which arrays each node is sent (the attack's ``W0``)."""
        self._round_started[server_round] = time.perf_counter()
        self._current_arrays = arrays
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._sent = {}
        for msg in messages:
            records = msg.content.array_records
            if len(records) == 1:
                self._sent[msg.metadata.dst_node_id] = next(iter(records.values()))
        if self.enabled and self._worker is not None:
            self._worker.start()  # import torch in the worker while the clients train
        return messages

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate unchanged."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate unchanged."""
        return self.strategy.aggregate_evaluate(server_round, replies)

    def close(self) -> None:
        """Stop the attack worker (if any)."""
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ the audit

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None,
                                                             MetricRecord | None]:
        """Attack every reply, withhold corrupt ones, then let the wrapped strategy aggregate."""
        replies = list(replies)
        if not self.enabled:
            arrays, metrics = self.strategy.aggregate_train(server_round, replies)
            self._finish_round(server_round, {}, 0.0, metrics)
            return arrays, metrics
        t_audit = time.perf_counter()
        keep: list[Message] = []
        round_records: list[ClientAudit] = []
        for i, reply in enumerate(replies, start=1):
            record = self._audit_reply(server_round, reply, i, len(replies))
            round_records.append(record)
            if record.status != "corrupt":
                keep.append(reply)
            else:
                log(WARNING, "[audit] round %d, %s: corrupt reply withheld from aggregation: %s",
                    server_round, record.client_label, record.error)
            self._strip_audit_info(reply)
            self.records.append(record)
            if self.store is not None:
                try:
                    self.store.add(record)
                except OSError as exc:  # storage trouble must not stop training
                    log(WARNING, "[audit] could not store %s: %s", record.client_label, exc)
        audit_seconds = time.perf_counter() - t_audit

        arrays, metrics = self.strategy.aggregate_train(server_round, keep)
        stats = self._round_metrics(round_records, audit_seconds)
        merged = MetricRecord(dict(metrics) if metrics is not None else {})
        for key, value in stats.items():
            merged[key] = value
        self._finish_round(server_round, stats, audit_seconds, merged)
        log(INFO, "[audit] round %d: %d/%d reconstructed, %d certified exact%s, "
            "attack %.1fs, audit %.1fs", server_round, int(stats["audit-reconstructions"]),
            len(replies), int(stats["audit-certified-exact"]),
            (f", mean PSNR {stats['audit-psnr-mean']:.1f} dB"
             if "audit-psnr-mean" in stats else ""), stats["audit-attack-seconds"],
            audit_seconds)
        return arrays, merged

    def _finish_round(self, server_round: int, stats: dict[str, float], audit_seconds: float,
                      metrics: MetricRecord | None) -> None:
        """Record the round's timings (training phase wall time: configure -> aggregated)."""
        started = self._round_started.pop(server_round, None)
        info: dict[str, Any] = dict(stats)
        info["audit-seconds"] = audit_seconds
        if started is not None:
            info["train-round-seconds"] = time.perf_counter() - started
        self.round_stats[server_round] = info
        if self.store is not None:
            self.store.add_round(server_round, {**info, "aggregated": dict(metrics or {})})

    @staticmethod
    def _strip_audit_info(reply: Message) -> None:
        """Remove the audit-only ground truth before the wrapped strategy sees the reply."""
        info = _client_info(reply)
        if info is not None and SAMPLE_INDICES_KEY in info:
            del info[SAMPLE_INDICES_KEY]

    @staticmethod
    def _round_metrics(records: list[ClientAudit], seconds: float) -> dict[str, float]:
        ok = [r for r in records if r.status == "ok"]
        stats: dict[str, float] = {
            "audit-replies": len(records),
            "audit-reconstructions": len(ok),
            "audit-certified-exact": sum(1 for r in ok if r.exact),
            "audit-failures": sum(1 for r in records
                                  if r.status in ("attack-error", "timeout", "no-update")),
            "audit-corrupt": sum(1 for r in records if r.status == "corrupt"),
            "audit-client-errors": sum(1 for r in records if r.status == "client-error"),
            "audit-attack-seconds": float(sum(r.attack_seconds or 0.0 for r in records)),
            "audit-seconds": float(seconds),
        }
        lams = [r.sparsity_match for r in ok if r.sparsity_match is not None]
        if lams:
            stats["audit-lambda-mean"] = float(np.mean(lams))
        psnrs = [r.psnr_mean for r in ok if r.psnr_mean is not None and math.isfinite(r.psnr_mean)]
        if psnrs:
            stats["audit-psnr-mean"] = float(np.mean(psnrs))
        return stats

    def _audit_reply(self, server_round: int, reply: Message, i: int, n: int) -> ClientAudit:
        """Everything about one reply, as a :class:`ClientAudit` (never raises)."""
        node_id = int(reply.metadata.src_node_id)
        if reply.has_error():
            log(WARNING, "[audit] round %d, node %d: client error: %s", server_round, node_id,
                reply.error.reason)
            return ClientAudit(server_round, node_id, status="client-error",
                               error=str(reply.error.reason), protocol=self.protocol)
        record = ClientAudit(server_round, node_id, partition_id=_partition_id(reply),
                             protocol=self.protocol)
        who = f"round {server_round}, {record.client_label} ({i}/{n})"
        try:
            global_arrays = self._sent.get(node_id, self._current_arrays)
            reason = corrupt_reason(reply, global_arrays, self.weighted_by_key)
            if reason is not None:
                record.status, record.error = "corrupt", reason
                return record
            num = _metric(reply, self.weighted_by_key)
            record.num_examples = None if num is None else int(num)
            record.epsilon = _metric(reply, "epsilon")
            record.epsilon_cumulative = _metric(reply, "epsilon-cumulative")
            record.delta = _metric(reply, "delta")
            record.noise_std = _metric(reply, "noise-std")
            if global_arrays is None:
                record.status, record.error = "attack-error", "no global arrays for this node"
                return record
            self._attack(record, global_arrays, reply, who)
        except Exception as exc:  # noqa: BLE001 - the audit must never stop the round
            record.status, record.error = "attack-error", f"{type(exc).__name__}: {exc}"
            log(WARNING, "[audit] %s: attack failed: %s", who, record.error)
        return record

    def _attack(self, record: ClientAudit, global_arrays: ArrayRecord, reply: Message,
                who: str) -> None:
        from fl_attack.updates import weight_update_pair

        new_arrays = next(iter(reply.content.array_records.values()))
        g_state = {k: v.numpy() for k, v in global_arrays.items()}
        n_state = {k: v.numpy() for k, v in new_arrays.items()}
        try:
            dw, db, w0, b0 = weight_update_pair(g_state, n_state, weight_key=self.attack.weight_key,
                                                bias_key=self.attack.bias_key)
        except ValueError as exc:
            zero = "identically zero" in str(exc)
            record.status = "no-update" if zero else "attack-error"
            record.error = str(exc)
            log(WARNING, "[audit] %s: nothing to attack: %s", who, exc)
            return
        # float64 as weight_update_pair returns it (the difference of the float32 weights is
        # exact in float64); the attack estimates the weights' rounding noise itself.
        arrays = tuple(t.numpy() for t in (dw, db, w0, b0))
        if self.attack.uses_next_layer():
            dw2 = _next_layer_update(g_state, n_state, self.attack.weight_key, dw.shape[0])
            if dw2 is not None:
                arrays = (*arrays, dw2)
        kwargs = self.attack.invert_kwargs()
        log(INFO, "[audit] %s: attacking %s layer update %s with %s ...", who,
            self.attack.weight_key or "first", tuple(dw.shape), self.attack.method)
        if self._worker is not None:
            self._worker.ensure_ready()  # startup (importing torch) is not attack time
        t0 = time.perf_counter()
        try:
            if self._worker is not None:
                out = self._worker.run(arrays, kwargs, float(self.attack.timeout or 0))
            else:
                out = run_inversion(*arrays, **kwargs)
        except AttackTimeout as exc:
            record.status, record.error = "timeout", str(exc)
            record.attack_seconds = time.perf_counter() - t0
            log(WARNING, "[audit] %s: %s", who, exc)
            return
        except Exception as exc:  # noqa: BLE001
            record.status, record.error = "attack-error", f"{type(exc).__name__}: {exc}"
            record.attack_seconds = time.perf_counter() - t0
            log(WARNING, "[audit] %s: attack failed: %s", who, record.error)
            return
        record.attack_seconds = time.perf_counter() - t0
        record.attack = out["summary"]
        record.batch_size = out["batch_size"]
        record.sparsity_match = out["sparsity_match"]
        record.exact = out["exact"]
        record.n_directions = out["n_directions"]
        record.inputs = out["inputs"]
        self._to_images(record, reply)
        lam = "-" if record.sparsity_match is None else f"{record.sparsity_match:.4f}"
        log(INFO, "[audit] %s: B=%d, λ=%s%s%s, %.1fs", who, record.batch_size, lam,
            " (certified exact)" if record.exact else "",
            "" if record.psnr_mean is None else f", PSNR {record.psnr_mean:.1f} dB",
            record.attack_seconds)

    def _to_images(self, record: ClientAudit, reply: Message) -> None:
        """Denormalise the reconstruction into images; score it in audit mode."""
        if self.dataset is None or record.inputs is None:
            return
        from fl_attack.data import denormalize, image_shape

        shape = image_shape(self.dataset)
        inputs = torch.from_numpy(np.asarray(record.inputs, dtype=np.float64))
        if inputs.ndim != 2 or inputs.shape[1] != int(np.prod(shape)):
            return
        recon = denormalize(inputs.reshape(-1, *shape), self.dataset)
        record.recon_images = recon.numpy()
        info = _client_info(reply)
        indices = None if info is None else info.get(SAMPLE_INDICES_KEY)
        if self.ground_truth is None or not indices:
            return
        from fl_attack.metrics import score_batch

        try:
            originals = self.ground_truth.images([int(v) for v in indices]).double()
            record.sample_indices = [int(v) for v in indices]
            record.true_batch_size = int(originals.shape[0])
            if not bool(torch.isfinite(recon).all()):
                raise ValueError("reconstruction contains NaN or inf")
            score = score_batch(recon, originals, data_range=1.0)
        except ValueError as exc:
            record.error = f"scoring failed: {exc}"
            return
        record.psnr = [float(v) for v in score.psnr]
        record.psnr_mean = float(score.mean_psnr)
        record.matching = score.perm.numpy()
        matched = np.full(tuple(originals.shape), 0.5)
        hit = score.perm >= 0
        matched[hit.numpy()] = recon[score.perm[hit]].numpy()
        record.recon_images = matched
        record.original_images = originals.numpy()
