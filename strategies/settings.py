"""``AttackSettings``: how the auditing server attacks each update, validated when built.

One configuration object, grouped like its run-config keys (``fl_attack_flwr.app.run_config``):
which layer and how to read the update, the attack itself, where attacks run, when the round
waits for them, and which replies are attacked. Every field has a documented default; a bad
value raises ``ValueError`` naming the field, when the settings are built, before any round.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

EXECUTORS = ("inline", "process", "pool", "ray")
MODES = ("blocking", "background")
UPDATES = ("auto", "gradient", "fedavg")
TARGETS = ("each", "aggregate")
#: The clients' training protocols, and how each one's update is read (an ``update`` above): one
#: gradient step (FedSGD; DP-SGD is attacked as a gradient even over several steps, because
#: under noise the FedAvg test stops telling candidates apart) or a sum over local steps
#: (FedAvg; ``lora``: a language model's PEFT adapters, trained as FedAvg trains).
UPDATE_OF_PROTOCOL = {"fedsgd": "gradient", "fedavg": "fedavg", "dpsgd": "gradient",
                      "lora": "fedavg"}
_EVERY = re.compile(r"^every:(\d+)$")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class RoundFilter:
    """Which rounds are audited: ``"all"``, a list ``"1,5,10"`` or ``"every:5"`` (1, 6, 11, ...)."""

    spec: str = "all"

    def __post_init__(self) -> None:
        spec = self.spec.strip()
        if spec == "all" or _EVERY.match(spec):
            if _EVERY.match(spec) and int(_EVERY.match(spec).group(1)) < 1:
                raise ValueError(f"rounds 'every:N' needs N >= 1, got {self.spec!r}")
            return
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if not items or not all(s.isdigit() and int(s) >= 1 for s in items):
            raise ValueError(f"rounds must be 'all', 'every:N' or a list like '1,5,10' of "
                             f"round numbers >= 1, got {self.spec!r}")

    def __contains__(self, server_round: int) -> bool:
        spec = self.spec.strip()
        if spec == "all":
            return True
        every = _EVERY.match(spec)
        if every:
            return (server_round - 1) % int(every.group(1)) == 0
        return server_round in {int(s) for s in spec.split(",") if s.strip()}


@dataclass
class AttackSettings:
    """How the server attacks each client update.

    Parameters
    ----------
    weight_key, bias_key : str, optional
        The attacked layer by its state-dict names (e.g. ``"fc1.weight"``); default the first
        linear layer with a bias. ``bias_key`` defaults to ``weight_key`` with ``weight``
        replaced by ``bias``.
    target : {"each", "aggregate"}
        What the server attacks: ``"each"`` client's update (what an ordinary Flower server
        sees), or only the round's ``"aggregate"`` (what a server under secure aggregation
        sees: the sum of the updates, a batch of every client's samples).
    update : {"auto", "gradient", "fedavg"}
        How to read the update. ``"gradient"``: one gradient step (FedSGD, DP-SGD);
        ``"fedavg"``: a sum over local steps from the sent weights; ``"auto"`` (default): try
        ``"gradient"`` and, when that is not certified, ``"fedavg"``, and keep the better
        certified result (the record says which reading won).
    next_layer : bool
        Also pass the next linear layer's update, so the samples read through it are peeled
        off and the rest is searched as a smaller batch (``fl_attack.steps.peel``). Used for
        gradient readings only.
    method : {"spear++", "spear"}
    max_seconds : float, optional
        Soft time budget of one attack (``fl_attack.AttackConfig.max_seconds``), per reading:
        with ``update="auto"`` an update the gradient reading does not certify is attacked
        again as a FedAvg sum, so it may take twice this; ``None``: the library's default.
    device : str, optional
        ``None`` or ``"auto"``: CUDA when available; ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
    seed : int
        The attack's random seed: the same update and seed give the same reconstruction under
        every executor.
    options : dict
        Further ``fl_attack.AttackConfig`` fields, e.g. ``{"steps": 200}``; checked here.
    executor : {"inline", "process", "pool", "ray"}
        Where attacks run: in the server process (no hard timeout), one spawned worker process
        (default), ``workers`` spawned processes, or ``workers`` Ray actors.
    workers : int, optional
        Worker processes of the ``pool`` executor, and attacks the ``ray`` executor runs at
        once on a simulation's Ray instance; default the usable cores.
    timeout : float, optional
        Hard limit of one attack in seconds: its worker is killed and replaced (not ``inline``).
    memory_limit_gb : float, optional
        Address space one attack may add to its worker (``process``, ``pool``, ``ray``); an
        attack over it is recorded ``out-of-memory`` and the server stays up.
    ray_address : str, optional
        The Ray cluster of the ``ray`` executor; default the instance this process already has
        (the simulation engine's), else a new local one.
    ray_num_cpus : float, optional
        CPUs one attack task asks of Ray. ``None``: 1, except on the Ray instance of a Flower
        simulation in this process, whose ClientApp actors hold every CPU it has: there 0, so
        attacks are never starved of a reservation.
    ray_num_gpus : float, optional
        GPUs one attack task asks of Ray. ``None``: 1 where CUDA is available (the attack then
        runs on that GPU), else 0.
    ray_resources : dict of str to float
        Custom Ray resources one attack asks for, e.g. ``{"fl-attack": 1}``: attacks then run
        only on the nodes started with that resource (``ray start --resources``), and at most
        as many at once as the cluster holds of it.
    startup_timeout : float
        Seconds a worker process may take to start (importing torch).
    niceness : int
        Unix niceness of the attack workers (``process``, ``pool``, ``ray``), 0 to 19: on cores
        shared with the federation the scheduler serves its server and clients first, so a
        ``background`` audit takes the cores they leave idle. The default, 19, is the lowest
        priority: below a Flower simulation's ClientApp actors too (Ray runs its workers at
        niceness 15). 0 keeps the normal priority.
    mode : {"blocking", "background"}
        ``blocking``: the round waits for its attacks and their results are in the round's
        metrics. ``background``: the aggregate is returned at once; each result is stored when
        it lands, round metrics when the round's attacks are done.
    drain_timeout : float
        Seconds the end of a run waits for unfinished background attacks (then ``unfinished``).
    max_queue : int, optional
        Background attacks waiting at most; when full, new replies are ``skipped`` (reason:
        queue full). Default: unbounded.
    fraction : float
        Share of each round's replies attacked (seeded by ``sample_seed``), in (0, 1].
    rounds : str
        Audited rounds: ``"all"``, ``"1,5,10"`` or ``"every:5"``.
    max_per_round : int, optional
        At most this many replies attacked per round.
    sample_seed : int
        Seed of the reply sampling (the same seed picks the same replies).
    """

    weight_key: str | None = None
    bias_key: str | None = None
    target: str = "each"
    update: str = "auto"
    next_layer: bool = True
    method: str = "spear++"
    max_seconds: float | None = 120.0
    device: str | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    executor: str = "process"
    workers: int | None = None
    timeout: float | None = 600.0
    memory_limit_gb: float | None = None
    ray_address: str | None = None
    ray_num_cpus: float | None = None
    ray_num_gpus: float | None = None
    ray_resources: dict[str, float] = field(default_factory=dict)
    startup_timeout: float = 300.0
    niceness: int = 19
    mode: str = "blocking"
    drain_timeout: float = 600.0
    max_queue: int | None = None
    fraction: float = 1.0
    rounds: str = "all"
    max_per_round: int | None = None
    sample_seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid setting."""
        _choice("update", self.update, UPDATES)
        _choice("target", self.target, TARGETS)
        _choice("executor", self.executor, EXECUTORS)
        _choice("mode", self.mode, MODES)
        _choice("method", self.method, ("spear++", "spear"))
        for name in ("max_seconds", "timeout", "memory_limit_gb"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        for name in ("startup_timeout", "drain_timeout"):
            if not (_number(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("workers", "max_queue", "max_per_round"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not (isinstance(self.niceness, int) and 0 <= self.niceness <= 19):
            raise ValueError(f"niceness must be an int in 0..19, got {self.niceness!r}")
        if not (_number(self.fraction) and 0 < self.fraction <= 1):
            raise ValueError(f"fraction must lie in (0, 1], got {self.fraction!r}")
        for name in ("ray_num_cpus", "ray_num_gpus"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0 or None, got {value!r}")
        if not all(isinstance(k, str) and _number(v) and v > 0
                   for k, v in self.ray_resources.items()):
            raise ValueError("ray_resources must map resource names to positive amounts, got "
                             f"{self.ray_resources!r}")
        if self.bias_key is not None and self.weight_key is None:
            raise ValueError("bias_key given without weight_key")
        RoundFilter(self.rounds)
        self.attack_config()  # the library checks its own options

    def attack_config(self) -> Any:
        """The ``fl_attack.AttackConfig`` of :attr:`options` (``ValueError`` naming a bad one)."""
        from fl_attack import AttackConfig

        options = dict(self.options)
        if self.max_seconds is not None:
            options.setdefault("max_seconds", float(self.max_seconds))
        try:
            return AttackConfig.from_options(method=self.method, **options)
        except TypeError as exc:  # unknown option names
            raise ValueError(f"attack options: {exc}") from exc

    @property
    def round_filter(self) -> RoundFilter:
        """:attr:`rounds` parsed."""
        return RoundFilter(self.rounds)

    def invert_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``fl_attack.invert`` (besides the arrays and ``update``)."""
        options = dict(self.options)
        options.pop("update", None)
        if self.max_seconds is not None:
            options.setdefault("max_seconds", float(self.max_seconds))
        device = None if self.device in (None, "", "auto") else self.device
        return {"method": self.method, "seed": int(self.seed), "device": device, **options}

    def readings(self) -> tuple[str, ...]:
        """The update readings to try, in order (``options["update"]`` forces one)."""
        forced = self.options.get("update")
        if forced is not None:
            return (str(forced),)
        return ("gradient", "fedavg") if self.update == "auto" else (self.update,)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose one of {list(allowed)}")
