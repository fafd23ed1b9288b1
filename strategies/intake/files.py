"""A reply read from files: the weights a server sent and the weights a client returned, as
users save them, checked and turned into the facts and work of a reply.

Auditors often hold checkpoints rather than a running federation. This module reads them
(:func:`load_weights`: a PyTorch state dict ``.pt`` / ``.pth`` / ``.bin``, a NumPy ``.npz``, a
``.safetensors`` file, a ``transformers`` checkpoint folder, sharded or not), refuses at once
what cannot be an update of the sent model (:func:`check_update`: a missing or extra array,
another shape, no real numbers, NaN; a layer the model lacks), and hands the pair to the
reply's own intake (:func:`fl_attack_flwr.intake.update.update_work`), so that a reply from
files is attacked, recorded and stored exactly as one from Flower.

A PyTorch file is loaded with ``torch.load(weights_only=True)``: only tensors and plain
containers are unpickled, never arbitrary objects. A whole pickled ``nn.Module`` or a dict
holding a custom object is refused (:class:`WeightsFileError`), never executed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.intake.update import Work, array_problem, as_arrays, keys_problem, update_work
from fl_attack_flwr.jobs.layers import choose_layer
from fl_attack_flwr.jobs.model_plan import ModelPlan
from fl_attack_flwr.settings import AttackSettings

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SUFFIXES = (*TORCH_SUFFIXES, ".npz", ".safetensors")
"""The weight files read, by suffix."""
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model")
"""Where a training checkpoint (a dict of the model's state dict, the epoch, ...) keeps the
model's weights; a file that holds only tensors is the state dict itself."""

PathLike = str | os.PathLike[str]


class WeightsFileError(ValueError):
    """A weights file that cannot be audited; the message names the file and, where there is
    one, the array."""


@dataclass(frozen=True)
class Weights:
    """One file's arrays, by name; ``ordered`` is False where the format keeps no order of its
    arrays (``.safetensors`` stores them sorted by name)."""

    path: Path
    arrays: dict[str, np.ndarray]
    ordered: bool = True


def load_weights(path: PathLike) -> Weights:
    """The arrays of a weights file, by name (``WeightsFileError`` naming the file otherwise).

    Examples
    --------
    >>> import torch
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), "/tmp/w.pt")
    >>> sorted(load_weights("/tmp/w.pt").arrays)
    ['bias', 'weight']
    """
    path = Path(path)
    file = checkpoint_dir(path) or path
    if not file.is_file():
        raise WeightsFileError(f"{path}: no such file" if not path.exists()
                               else f"{path}: not a file (a folder stands for one checkpoint "
                                    f"when it holds {' or '.join(CHECKPOINT_FILES)})")
    suffix = file.suffix.lower()
    if file.name.endswith(".safetensors.index.json"):
        arrays, ordered = _sharded(file), False
    elif suffix in TORCH_SUFFIXES:
        arrays, ordered = _torch_file(file), True
    elif suffix == ".npz":
        arrays, ordered = _npz_file(file), True
    elif suffix == ".safetensors":
        arrays, ordered = _safetensors_file(file), False
    else:
        raise WeightsFileError(f"{path}: unknown weights format {path.suffix!r}; expected one "
                               f"of {list(SUFFIXES)}")
    if not arrays:
        raise WeightsFileError(f"{path}: holds no arrays")
    return Weights(path, arrays, ordered)


#: The files of a ``transformers`` checkpoint folder (``save_pretrained``), in the order tried:
#: the index of a sharded checkpoint, then a single file.
CHECKPOINT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")


def checkpoint_dir(path: Path) -> Path | None:
    """The weights file of a ``transformers`` checkpoint folder (its shards' index, or its one
    file), or ``None`` when ``path`` is not such a folder."""
    if not path.is_dir():
        return None
    return next((path / f for f in CHECKPOINT_FILES if (path / f).is_file()), None)


def _sharded(index: Path) -> dict[str, np.ndarray]:
    """The arrays of a sharded ``.safetensors`` checkpoint, from its index's ``weight_map``."""
    import json

    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightsFileError(f"{index}: not a sharded checkpoint's index (a JSON object "
                               f"with a weight_map): {exc}") from None
    arrays: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        part = _safetensors_file(index.parent / shard)
        arrays.update({k: v for k, v in part.items() if weight_map.get(k) == shard})
    missing = sorted(set(weight_map) - set(arrays))
    if missing:
        raise WeightsFileError(f"{index}: the shards lack {missing[:3]} named in its "
                               "weight_map")
    return arrays


def _torch_file(path: Path) -> dict[str, np.ndarray]:
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = next((ln.strip() for ln in str(exc).splitlines()
                        if "Unsupported global" in ln), str(exc).splitlines()[0])
        raise WeightsFileError(
            f"{path}: not a plain state dict, refused unread: torch.load(weights_only=True) "
            f"unpickles only tensors and plain containers ({refused}). Save the weights "
            "with torch.save(model.state_dict(), path)") from None
    except Exception as exc:  # noqa: BLE001 - whatever torch says of a file it cannot read
        raise WeightsFileError(f"{path}: not a PyTorch weights file: {type(exc).__name__}: "
                               f"{exc}") from None
    if isinstance(obj, Mapping) and not _all_tensors(obj):
        inner = [k for k in CHECKPOINT_KEYS if isinstance(obj.get(k), Mapping)]
        obj = obj[inner[0]] if inner else obj
    if not isinstance(obj, Mapping):
        raise WeightsFileError(f"{path}: holds a {type(obj).__name__}, not a state dict (a "
                               "mapping of names to tensors)")
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise WeightsFileError(f"{path}: {key!r} is a {type(value).__name__}, not a "
                                   "tensor: expected a state dict (names to tensors)")
    return as_arrays(obj)


def _all_tensors(obj: Mapping[Any, Any]) -> bool:
    import torch

    return all(isinstance(v, torch.Tensor) for v in obj.values())


def _npz_file(path: Path) -> dict[str, np.ndarray]:
    try:
        npz = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - not a zip of .npy files
        raise WeightsFileError(f"{path}: not a NumPy .npz file: {type(exc).__name__}: "
                               f"{exc}") from None
    if not hasattr(npz, "files"):
        raise WeightsFileError(f"{path}: holds one array, not named arrays (np.savez)")
    out = {}
    with npz:
        for key in npz.files:
            try:
                out[key] = np.asarray(npz[key])
            except ValueError as exc:  # object arrays need pickle: refused
                raise WeightsFileError(f"{path}: array {key!r} cannot be read without "
                                       f"unpickling ({exc})") from None
    return out


def _safetensors_file(path: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise WeightsFileError(f"{path}: reading .safetensors needs the safetensors package: "
                               "pip install 'fl-attack[safetensors]'") from None
    try:
        return as_arrays(load_file(str(path), device="cpu"))
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types
        raise WeightsFileError(f"{path}: not a .safetensors file: {type(exc).__name__}: "
                               f"{exc}") from None


def returned_paths(paths: Sequence[PathLike]) -> list[Path]:
    """The RETURNED files: each path given, a folder standing for the weight files in it
    (sorted by name). ``WeightsFileError`` for a folder with none, or no path at all."""
    out: list[Path] = []
    for item in map(Path, paths):
        if checkpoint_dir(item) is not None:
            out.append(item)
        elif item.is_dir():
            found = sorted(p for p in item.iterdir()
                           if p.is_file() and p.suffix.lower() in SUFFIXES)
            if not found:
                raise WeightsFileError(f"{item}: a folder without weight files "
                                       f"({', '.join(SUFFIXES)})")
            out += found
        else:
            out.append(item)
    if not out:
        raise WeightsFileError("no RETURNED weights given")
    return out


def natural_order(keys: Sequence[str]) -> list[str]:
    """``keys`` in the order a state dict usually has them, for a format that keeps none:
    by module name with numbers counted as numbers (``layers.2`` before ``layers.10``), and
    within a module ``weight``, ``bias``, then running statistics, then the rest."""
    last = {"weight": 0, "bias": 1, "running_mean": 2, "running_var": 3,
            "num_batches_tracked": 4}

    def rank(key: str) -> tuple[Any, ...]:
        module, _, name = key.rpartition(".")
        parts = [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in module.split(".")]
        return (*parts, (2, last.get(name, 5), name))

    return sorted(keys, key=rank)


def check_update(sent: Weights, returned: Weights) -> None:
    """``WeightsFileError`` naming the file and the array where ``returned`` cannot be an
    update of ``sent`` (the checks a Flower reply gets: other names, another shape, not real
    numbers, NaN or inf)."""
    reason = keys_problem(sent.arrays, returned.arrays)
    for key, value in returned.arrays.items() if reason is None else ():
        reason = array_problem(key, value, tuple(np.shape(sent.arrays[key])))
        if reason is not None:
            break
    if reason is not None:
        raise WeightsFileError(f"{returned.path}: {reason} (against SENT {sent.path})")
    for key, value in sent.arrays.items():
        reason = array_problem(key, value, None)
        if reason is not None:
            raise WeightsFileError(f"{sent.path}: {reason}")


def check_layer(sent: Weights, settings: AttackSettings) -> None:
    """``WeightsFileError`` when the named layer (``settings.weight_key``) is not a linear
    layer with a bias of ``sent``, or the model has none."""
    try:
        choose_layer(sent.arrays, settings.weight_key, settings.bias_key)
    except ValueError as exc:
        raise WeightsFileError(f"{sent.path}: {exc}") from None


def labels_of(paths: Sequence[Path]) -> list[str]:
    """One label per RETURNED file, from its name (the record's directory): letters, digits,
    ``.``, ``_``, ``-``; made unique with ``-2``, ``-3``, ... where two names are alike."""
    labels: list[str] = []
    for path in paths:
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.") or "client"
        label, k = base, 1
        while label in labels:
            k += 1
            label = f"{base}-{k}"
        labels.append(label)
    return labels


def file_intake(settings: AttackSettings, model: ModelPlan | None, sent: Weights,
                returned: Weights, *, label: str, node_id: int, num_examples: int | None,
                server_round: int = 1, tokenizer: Any = None) -> tuple[ReplyFacts, Work]:
    """The facts and work of one RETURNED file against SENT, through the reply's own intake
    (:func:`~fl_attack_flwr.intake.update.update_work`). The files must have passed
    :func:`check_update`; ``returned`` is read in ``sent``'s order of arrays."""
    facts = ReplyFacts(server_round, node_id, label=label, num_examples=num_examples)
    back = {k: returned.arrays[k] for k in sent.arrays}
    return update_work(settings, model, facts, sent.arrays, back, tokenizer=tokenizer)
