"""The audit of saved weights: what the server sent and what clients returned, as files.

:func:`audit_update` is ``AuditingStrategy`` without a federation: the same rooms in the same
order, for one round of checkpoints. Each RETURNED file is read and checked against SENT
(``intake.files``), becomes a reply's facts and work through the reply's own intake
(``intake.update``), its job runs on the strategy's executors (``jobs.run``), and its record
(``results.records.record_of``), the run directory (``output.store``: ``metrics.jsonl``, the
reconstructions, ``summary.json``, ``report.html``) and the privacy gate
(``output.privacy_gate``) are the plugin's. ``fl-attack audit`` (``app.cli``) is its command.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_attack_flwr.executors.base import outcome_of
from fl_attack_flwr.executors.processes import make_executor
from fl_attack_flwr.intake.files import (
    Weights,
    WeightsFileError,
    check_layer,
    check_update,
    file_intake,
    labels_of,
    load_weights,
    natural_order,
    returned_paths,
)
from fl_attack_flwr.intake.update import as_arrays
from fl_attack_flwr.jobs.model_plan import ModelPlan
from fl_attack_flwr.jobs.outcome import AttackOutcome
from fl_attack_flwr.jobs.pixels import build_model
from fl_attack_flwr.jobs.text import text_layer
from fl_attack_flwr.output.privacy_gate import check_fail_on, gate_failure
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.results.pictures import InputView
from fl_attack_flwr.results.records import ClientAudit, log_record, record_of, round_metrics
from fl_attack_flwr.settings import AttackSettings

Source = str | os.PathLike[str] | Mapping[str, Any]
"""A weights file, or a state dict in memory (tensors or arrays by name)."""


@dataclass(frozen=True)
class SavedAudit:
    """What :func:`audit_update` found and where it wrote it."""

    run_dir: Path
    summary: dict[str, Any]
    """``summary.json``: the totals and the ``verdict`` sentence."""
    records: list[ClientAudit]
    """One record per RETURNED, in the order given."""
    failure: str | None
    """Why the privacy gate ``fail_on`` trips, or ``None`` when it passes."""

    @property
    def verdict(self) -> str:
        """The verdict in plain words."""
        return str(self.summary["verdict"])

    @property
    def report(self) -> Path:
        """The run's ``report.html``."""
        return self.run_dir / "report.html"


def audit_update(sent: Source, returned: Source | Sequence[Source], *,
                 num_examples: int | None = None, layer: str | None = None,
                 update: str | None = None, max_seconds: float | None = None,
                 model: Any = None, input_shape: tuple[int, int, int] | None = None,
                 input_transform: Callable[..., Any] | tuple[Any, Any] | None = None,
                 pixel_seconds: float = 60.0, out: str | os.PathLike[str] = "runs",
                 run_name: str | None = None, fail_on: str = "", tensorboard: bool = False,
                 reconstructions: bool = True, tokenizer: Any = None,
                 settings: AttackSettings | None = None) -> SavedAudit:
    """Audit the updates ``sent -> returned`` of one round from saved weights, as the auditing
    strategy audits replies, and write the same run directory.

    Every input is checked before anything is attacked or written: a missing or unreadable
    file, an unknown format, a pickle that is not a plain state dict, an array missing from a
    RETURNED or of another shape, a layer the model lacks and a bad setting raise
    ``ValueError`` (:class:`~fl_attack_flwr.intake.files.WeightsFileError` for a file) naming
    the file and the array, or the setting.

    Parameters
    ----------
    sent : path or mapping
        The global model the server sent: a PyTorch state dict (``.pt``, ``.pth``, ``.bin``,
        loaded with ``weights_only=True``), a NumPy ``.npz``, a ``.safetensors`` file, or a
        state dict in memory.
    returned : path, mapping, or a sequence of them
        The model each client sent back after training from ``sent``; a folder stands for the
        weight files in it. Each is one client's record, labelled by its file name.
    num_examples : int, optional
        The samples each client trained on, when known (a Flower reply's ``num-examples``).
    layer : str, optional
        The attacked layer (``"fc1"`` or ``"fc1.weight"``); default the first linear layer
        with a bias that the attack covers, as the strategy chooses it.
    update, max_seconds : optional
        How to read the update (``"auto"``, ``"gradient"``, ``"fedavg"``) and the soft time
        budget of one attack; default those of ``settings``.
    model, tokenizer, input_shape, input_transform, pixel_seconds
        The clients' model (an instance, or a class or factory without arguments), its input
        shape and normalisation, and the pictures' budget, as ``AuditingStrategy`` takes them.
        The model also orders a ``.safetensors`` SENT's arrays. A language model's may be a
        checkpoint folder (default SENT's); ``tokenizer`` (or its path) too.
    out, run_name : optional
        The run directory ``<out>/<run_name>/`` (default a fresh name), created owner-only.
    fail_on : {"", "certified", "readable", "reconstructed"}
        The privacy gate: what :attr:`SavedAudit.failure` reports.
    tensorboard, reconstructions : bool
        The store's options: TensorBoard scalars (``fl-attack[tensorboard]``); ``False``:
        metrics only, no reconstruction written.
    settings : AttackSettings, optional
        Further attack settings (seed, device, executor, options); ``layer``, ``update`` and
        ``max_seconds`` given here replace its own. Default: attacks run in this process.

    Returns
    -------
    SavedAudit
        The run directory, its summary (with the verdict), the records and the gate's finding.

    Examples
    --------
    >>> from fl_attack_flwr import audit_update
    >>> result = audit_update("sent.pt", ["client-1.pt", "client-2.npz"], num_examples=16)
    >>> result.verdict  # doctest: +SKIP
    'The server reconstructed 2 of 2 client batches exactly (certified): ...'
    >>> [r.status for r in result.records], result.report  # doctest: +SKIP
    (['certified', 'certified'], PosixPath('runs/.../report.html'))
    """
    base, backs, settings, note = _inputs(sent, returned, num_examples, fail_on, model,
                                          _Given(settings, layer, update, max_seconds))
    text = text_layer(base.arrays) is not None
    if text:
        model, tokenizer = _text_model(base.path, model), _text_tokenizer(base.path, tokenizer)
    view = InputView(None, input_shape, input_transform)
    plan = None if model is None else ModelPlan(model, input_shape=view.model_shape(),
                                                 bounds=view.bounds(), max_seconds=pixel_seconds)
    store = AuditStore(out, run_name, config=_config(base, backs, num_examples, settings,
                                                     fail_on, model, text),
                       reconstructions=reconstructions, tensorboard=tensorboard)
    store.notes += [note] if note else []
    records = _attack_all(store, settings, plan, view, base, backs, num_examples, tokenizer)
    summary = store.finalize({"status": "completed"})
    return SavedAudit(store.run_dir, summary, records, gate_failure(summary, fail_on))


def _config(base: Weights, backs: list[Weights], num_examples: int | None,
            settings: AttackSettings, fail_on: str, model: Any, text: bool) -> dict[str, Any]:
    """The run's configuration as ``config.json`` and the report show it."""
    return {"sent": str(base.path), "returned": [str(b.path) for b in backs],
            "num-examples": num_examples, **({} if text else {"layer": settings.weight_key or ""}),
            "update": settings.update, "max-seconds": settings.max_seconds,
            "fail-on": fail_on, "model": "" if model is None else _name(model)}


@dataclass(frozen=True)
class _Given:
    """The attack settings as given: a whole ``AttackSettings`` and the options beside it."""

    settings: AttackSettings | None
    layer: str | None
    update: str | None
    max_seconds: float | None


def _inputs(sent: Source, returned: Source | Sequence[Source], num_examples: int | None,
            fail_on: str, model: Any,
            given: _Given) -> tuple[Weights, list[Weights], AttackSettings, str | None]:
    """SENT and the RETURNED read and checked, the settings, a note on the arrays' order;
    ``ValueError`` naming the first bad input or setting."""
    check_fail_on(fail_on)
    if num_examples is not None and not (isinstance(num_examples, int) and num_examples >= 1):
        raise ValueError(f"num_examples must be a positive int or None, got {num_examples!r}")
    base = _weights(sent, "SENT")
    items = list(returned) if _is_sequence(returned) else [returned]
    backs = [_weights(r, f"RETURNED-{i}") for i, r in enumerate(_expand(items), 1)]
    text = text_layer(base.arrays) is not None
    base, note = (base, None) if text else _ordered(base, model)
    for back in backs:
        check_update(base, back)
    settings = _settings(given.settings, base, given.layer, given.update, given.max_seconds)
    if not text:
        check_layer(base, settings)
    return base, backs, settings, note


def _text_model(sent: Path, model: Any) -> Any:
    """A language model's architecture: ``model`` (a checkpoint folder read as its config),
    else the ``config.json`` beside SENT; ``ValueError`` when there is none."""
    folder = Path(model) if isinstance(model, (str, os.PathLike)) else (
        sent if model is None and sent.is_dir() else None)
    if folder is None:
        if model is None:
            raise ValueError(f"{sent}: a language model's weights: give its architecture "
                             "(--model: a checkpoint folder with config.json, or MODULE:CLASS)")
        return model
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json, the language model's architecture")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _text_tokenizer(sent: Path, tokenizer: Any) -> Any:
    """``tokenizer``, else the tokenizer saved beside SENT (a path, loaded by the job)."""
    if tokenizer is not None or not sent.is_dir():
        return tokenizer
    saved = any((sent / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return str(sent) if saved else None


def _attack_all(store: AuditStore, settings: AttackSettings, plan: ModelPlan | None,
                view: InputView, base: Weights, backs: list[Weights],
                num_examples: int | None, tokenizer: Any = None) -> list[ClientAudit]:
    """Each RETURNED's intake, attack, record and storage, then the round's numbers."""
    t0 = time.perf_counter()
    executor = make_executor(settings)
    pending: list[tuple[Any, AttackOutcome | Future[AttackOutcome]]] = []
    records = []
    try:
        labels = labels_of([b.path for b in backs])
        for i, (back, label) in enumerate(zip(backs, labels, strict=True), 1):
            facts, work = file_intake(settings, plan, base, back, label=label, node_id=i,
                                      num_examples=num_examples, tokenizer=tokenizer)
            pending.append((facts, work if isinstance(work, AttackOutcome)
                            else executor.submit(work)))
        for facts, work in pending:
            outcome = work if isinstance(work, AttackOutcome) else outcome_of(work)
            record = record_of(facts, outcome, view, None)
            store.add(record)
            log_record(record)
            records.append(record)
    finally:
        executor.close()
    store.add_round(1, round_metrics(records, time.perf_counter() - t0))
    return records


def _weights(source: Source, name: str) -> Weights:
    if isinstance(source, Mapping):
        try:
            arrays = as_arrays(source)
        except (TypeError, ValueError) as exc:
            raise WeightsFileError(f"{name}: not a state dict of arrays: {exc}") from None
        if not arrays:
            raise WeightsFileError(f"{name}: holds no arrays")
        return Weights(Path(name), arrays)
    return load_weights(source)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _expand(items: list[Source]) -> list[Source]:
    """Folders among ``items`` replaced by the weight files in them."""
    out: list[Source] = []
    for item in items:
        out += [item] if isinstance(item, Mapping) else returned_paths([item])
    return out


def _ordered(sent: Weights, model: Any) -> tuple[Weights, str | None]:
    """``sent`` with its arrays in the model's order, for a format that keeps none: the
    model's state-dict order when the model is given, else :func:`natural_order`, with a note
    that says so."""
    if sent.ordered:
        return sent, None
    keys = natural_order(list(sent.arrays))
    note = (f"{sent.path.name} keeps no order of its arrays (.safetensors): the layers were "
            "taken in the order of their names; name the layer (--layer) or give the model "
            "(--model) where that is not the model's order.")
    if model is not None:
        try:
            own = [k for k in build_model(model).state_dict() if k in sent.arrays]
        except Exception as exc:  # noqa: BLE001 - a model that does not build is the user's
            raise ValueError(f"model {_name(model)} cannot be built: {exc}") from None
        keys = own + [k for k in keys if k not in own]
        note = None
    return dataclasses.replace(sent, arrays={k: sent.arrays[k] for k in keys}), note


def _name(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    kind = model if isinstance(model, type) else type(model)
    return f"{kind.__module__}:{kind.__qualname__}"


def _settings(settings: AttackSettings | None, sent: Weights, layer: str | None,
              update: str | None, max_seconds: float | None) -> AttackSettings:
    """The attack settings: ``settings`` (default: attacks in this process) with the layer,
    the reading and the budget given; ``ValueError`` naming a bad one."""
    base = settings or AttackSettings(executor="inline")
    changes: dict[str, Any] = {}
    if layer:
        weight = layer if layer in sent.arrays or layer.endswith("weight") else f"{layer}.weight"
        changes.update(weight_key=weight, bias_key=None)
    if update is not None:
        changes["update"] = update
    if max_seconds is not None:
        changes["max_seconds"] = max_seconds
    return dataclasses.replace(base, **changes)  # validated again by __post_init__
