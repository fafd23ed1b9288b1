"""The defences the matrix compares, and the privacy (ε) each one claims.

A :class:`Defence` is one row of the matrix: run-config overrides for the clients' local training
(protocol, batch sizes, DP-SGD noise), plus what Flower adds around it: a central-DP strategy
wrapper (noise on the aggregate, clipping on the server or on the client), a ``LocalDpMod`` on the
clients' train handler, secure aggregation as the audit's ``aggregate`` target, or a real SecAgg+
run (Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``). The client-side guard row runs the
plugin's ``LeakGuard`` in the clients with ``policy="refuse"`` (run config ``leak-guard``), with
the same budget as the server's attack (``leak-guard-seconds`` = the size's ``max_seconds``): a
client withholds an update its own check proves readable. :func:`matrix` builds the rows for a
:class:`Size`.

ε is what the defence claims, computed the way its own library would:

* DP-SGD: the clients report it (Opacus' RDP accountant, composed over their rounds);
* central DP: client-level ε of the Gaussian mechanism on the aggregate (noise multiplier z,
  every client in every round, R rounds), from Flower's own accountant
  (``flwr.serverapp.RdpAccountant``, backed by Google's ``dp-accounting``, the accountant the
  wrappers take as ``accountant=``), with no sampling amplification, as the fixed-clipping
  wrappers require;
* ``LocalDpMod``: the ε it is configured with, per round (its noise is
  ``sensitivity · sqrt(2 ln(1.25/δ)) / ε``, the classical Gaussian mechanism), and R · ε over R
  rounds (basic composition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Defence", "Size", "SIZES", "claimed_epsilon", "ldp_noise_std", "matrix"]

#: δ of every ε in the matrix (the run config's default for DP-SGD).
DELTA = 1e-5


@dataclass(frozen=True)
class Size:
    """The federation every defence runs: data, model, clients, rounds, attack budget."""

    clients: int
    batch_size: int
    width: int
    dataset_size: int
    rounds: int
    eval_size: int
    max_seconds: float
    ldp_epsilons: tuple[float, ...]
    dpsgd_noise: tuple[float, ...]
    #: FedAvg rows: (batch size, mini-batch size, local epochs).
    fedavg: tuple[tuple[int, int, int], ...]


SIZES: dict[str, Size] = {
    # End to end in a couple of minutes on 2 cores: every family once, tiny model and batches.
    "small": Size(clients=3, batch_size=4, width=64, dataset_size=150, rounds=2, eval_size=50,
                  max_seconds=20.0, ldp_epsilons=(1.0,), dpsgd_noise=(1.0,),
                  fedavg=((8, 4, 2),)),
    # The demo's federation (``make demo``): 3 clients, B = 16 photos, MLP 3 x 200, 2 rounds.
    "demo": Size(clients=3, batch_size=16, width=200, dataset_size=1000, rounds=2,
                 eval_size=333, max_seconds=30.0, ldp_epsilons=(1e6, 1e4, 1.0),
                 dpsgd_noise=(1e-4, 1e-3, 1.0), fedavg=((64, 16, 1), (16, 8, 5))),
}


@dataclass(frozen=True)
class Defence:
    """One row of the matrix.

    Parameters
    ----------
    key : str
        A Python identifier: the ClientApp's train action and the run's directory name.
    family : str
        ``none``, ``fedavg``, ``central-dp-server``, ``central-dp-client``, ``local-dp``,
        ``dp-sgd``, ``leak-guard`` (the clients' own ``LeakGuard``, from the run config),
        ``secagg`` (the audit attacks the round's aggregate) or ``secagg+``.
    label : str
        How the report names it.
    config : dict
        Run-config overrides (``fl_attack_flwr.app.run_config``) for this row.
    central : (noise multiplier, clipping norm), optional
        Flower's central-DP wrapper (``family`` says on which side clipping happens).
    local_dp : (clipping norm, sensitivity, ε, δ), optional
        ``flwr.clientapp.mod.LocalDpMod`` on the clients' train handler.
    secaggplus : dict, optional
        ``SecAggPlusWorkflow`` keyword arguments (real SecAgg+ run).
    """

    key: str
    family: str
    label: str
    config: dict[str, Any] = field(default_factory=dict)
    central: tuple[float, float] | None = None
    local_dp: tuple[float, float, float, float] | None = None
    secaggplus: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.key.isidentifier():
            raise ValueError(f"defence key {self.key!r} must be a Python identifier")

    @property
    def target(self) -> str:
        """What the audit attacks: each reply, or only the round's aggregate (secure
        aggregation: the server never sees a single client's update)."""
        return "aggregate" if self.family in ("secagg", "secagg+") else "each"


def ldp_noise_std(sensitivity: float, epsilon: float, delta: float) -> float:
    """Per-coordinate noise std ``LocalDpMod`` adds (its own formula)."""
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def _tag(x: float) -> str:
    """A number as part of an identifier: 1e-4 -> ``1em4``, 0.5 -> ``0p5``."""
    text = f"{x:g}".replace("-", "m").replace("+", "").replace(".", "p")
    return text


def matrix(size: Size, *, central_noise: float = 1.0, clip: float | None = None,
           secaggplus: bool = True) -> list[Defence]:
    """The matrix's rows for ``size``.

    ``clip`` is the update clipping norm of central DP and ``LocalDpMod``; default: half the
    norm of a typical FedSGD update of this size (``default_clip``), so that clipping binds.
    """
    c = clip if clip is not None else default_clip(size)
    rows = [Defence("none", "none", "no defence (FedSGD)")]
    for b, mini, epochs in size.fedavg:
        steps = epochs * math.ceil(b / mini)
        rows.append(Defence(
            f"fedavg_b{b}_m{mini}_e{epochs}", "fedavg",
            f"FedAvg: B = {b}, mini-batches of {mini}, {epochs} epoch(s) ({steps} local steps)",
            {"protocol": "fedavg", "batch-size": b, "mini-batch-size": mini,
             "local-epochs": epochs}))
    for side in ("server", "client"):
        rows.append(Defence(
            f"central_dp_{side}", f"central-dp-{side}",
            f"central DP, {side}-side clipping (z = {central_noise:g}, C = {c:.2g})",
            central=(central_noise, c)))
    for eps in size.ldp_epsilons:
        sigma = ldp_noise_std(c, eps, DELTA)
        rows.append(Defence(f"local_dp_{_tag(eps)}", "local-dp",
                            f"LocalDpMod ε = {eps:g} (σ = {sigma:.2g}, C = {c:.2g})",
                            local_dp=(c, c, eps, DELTA)))
    for z in size.dpsgd_noise:
        rows.append(Defence(f"dpsgd_{_tag(z)}", "dp-sgd",
                            f"Opacus DP-SGD, noise multiplier {z:g} (C = 1)",
                            {"protocol": "dpsgd", "noise-multiplier": z, "clip": 1.0,
                             "delta": DELTA}))
    rows.append(Defence(
        "leak_guard_refuse", "leak-guard", "client-side guard (refuse)",
        {"leak-guard": "refuse", "leak-guard-seconds": size.max_seconds}))
    rows.append(Defence("secagg", "secagg",
                        f"secure aggregation of {size.clients} clients (audit of the aggregate)"))
    if secaggplus:
        shares = {"num_shares": size.clients, "reconstruction_threshold": 2}
        rows.append(Defence("secaggplus", "secagg+",
                            f"Flower SecAgg+ of {size.clients} clients, its default quantization "
                            "(max_weight 1000, clipping range 8, 2^22 levels)",
                            secaggplus=shares))
        rows.append(Defence("secaggplus_fine", "secagg+",
                            f"Flower SecAgg+ of {size.clients} clients, fine quantization "
                            f"(max_weight {size.batch_size}, clipping range 1, 2^28 levels)",
                            secaggplus={**shares, "max_weight": float(size.batch_size),
                                        "clipping_range": 1.0, "quantization_range": 2**28}))
    return rows


def default_clip(size: Size) -> float:
    """Half the norm of one FedSGD update (lr 0.01) of this size's model and batch.

    Measured once on a real batch: the clipping norm must bind for clipping to mean anything,
    and the update's norm depends on the model's width and the batch.
    """
    from fl_attack.testbed.data import load_images, normalize
    from fl_attack.testbed.models import relu_mlp
    from fl_attack.testbed.simulate import local_update

    images, labels = load_images("photos32", size.dataset_size, seed=0)
    model = relu_mlp(3 * 32 * 32, size.width, 3, 10, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = size.batch_size
    after = local_update(model, normalize(images[:n], "photos32"), labels[:n],
                         protocol="fedsgd", lr=0.01).state_dict
    norm = math.sqrt(sum(float(((before[k] - after[k]) ** 2).sum()) for k in before))
    return float(f"{norm / 2:.2g}")


def claimed_epsilon(defence: Defence, rounds: int, reported: float | None) -> str:
    """The privacy ``defence`` claims after ``rounds`` rounds, in words for the table."""
    if defence.family == "dp-sgd":
        if reported is None or not math.isfinite(reported):
            return "∞"
        return f"{reported:.3g} (Opacus RDP, reported by the clients)"
    if defence.local_dp is not None:
        eps = defence.local_dp[2]
        return (f"{eps:g} per round ({rounds * eps:g} over {rounds}, basic composition; "
                "LocalDpMod's configured ε)")
    if defence.central is not None:
        eps = central_epsilon(defence.central[0], rounds)
        return f"{eps:.3g} (client level; Flower's RdpAccountant)"
    return "–"


def central_epsilon(noise_multiplier: float, rounds: int, clients: int = 1,
                    delta: float = DELTA) -> float:
    """Client-level ε of ``rounds`` Gaussian releases on the aggregate of ``clients`` clients,
    every client in every round, as Flower's own accountant computes it (without sampling
    amplification the population size does not change ε)."""
    if noise_multiplier <= 0:
        return math.inf
    from flwr.serverapp import GaussianPrivacyEvent, PrivacyConfig, RdpAccountant
    from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

    config = PrivacyConfig(target_delta=delta, population_size=clients,
                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                           sampling_method=SamplingMethod.NO_AMPLIFICATION)
    accountant = RdpAccountant(config)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=float(noise_multiplier),
                                            sample_size=clients, population_size=clients),
                       count=int(rounds))
    return float(accountant.get_privacy_spent().epsilon)
