"""The ``ClientApp``: an ordinary Flower client training a ReLU MLP on its share of real images
(``task = "text"``: fine-tuning a language model on its sentences, ``clients.text_task``).

Each round the client draws ``batch-size`` samples from its partition (without the ``eval-size``
samples it evaluates on, when ``eval-held-out`` is set) and trains on them with the
configured protocol (the same code the experiments use,
:func:`fl_attack.testbed.simulate.local_update`):

* ``fedsgd``: one SGD step on the whole batch;
* ``fedavg``: ``local-epochs`` epochs of mini-batch SGD (``mini-batch-size``, ``lr``);
* ``dpsgd``: per-sample clipping (``clip``) + Gaussian noise (``noise-multiplier``) with Opacus;
  the spent ε of the round and the cumulative ε over the rounds so far (RDP composition) are
  reported in the reply's metrics.

The reply is what an unmodified Flower client sends: an ArrayRecord with all weights and a
MetricRecord with ``num-examples`` (so any Flower strategy works), plus a ``client-info``
ConfigRecord carrying the ``partition-id`` (node ids are random) and, only when the run is in
audit mode, the indices of the samples trained on (the audit's ground truth).

Configuration: defaults < the run config (``[tool.flwr.app.config]``) < the ConfigRecord the
server sends with each message (the ServerApp forwards its resolved run config, so runs started
with ``run_simulation``, whose run config is empty, behave like ``flwr run``).

``leak-guard`` (``report``, ``refuse`` or ``escalate``) puts the client's own
:class:`~fl_attack_flwr.clients.leak_guard.LeakGuard` around its training, with a budget of
``leak-guard-seconds``; ``escalate`` applies Flower's ``LocalDpMod`` (clipping norm and
sensitivity ``clip``, ``leak-guard-epsilon``, ``delta``) to an update proven readable.

``inject-faults`` (e.g. ``"1:raise 2:nan"``) makes given partitions misbehave, to test that the
audit and the round survive them: ``raise`` (the client fails), ``nan`` (NaN weights), ``shape``
(a wrongly shaped weight), ``missing`` (an array left out), ``zero`` (the global model sent back
unchanged).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from fl_attack_flwr.clients.defaults import CLIENT_DEFAULTS, parse_faults
from fl_attack_flwr.clients.partition import client_batch, eval_split, partition
from fl_attack_flwr.wire import (
    CLIENT_INFO_KEY,
    DELTA_KEY,
    EPSILON_CUMULATIVE_KEY,
    EPSILON_KEY,
    NOISE_STD_KEY,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
)

NUM_CLASSES = 10

app = ClientApp()


def client_config(message: Message | None, context: Context) -> dict[str, Any]:
    """Defaults < ``context.run_config`` < the message's ConfigRecord (see module docstring)."""
    cfg = dict(CLIENT_DEFAULTS)
    cfg.update(dict(context.run_config))
    if message is not None:
        for record in message.content.config_records.values():
            cfg.update(dict(record))
    return cfg


def _partition_of(context: Context) -> tuple[int, int]:
    node = context.node_config
    if "partition-id" not in node or "num-partitions" not in node:
        raise ValueError("this SuperNode has no 'partition-id'/'num-partitions' in its node "
                         "config (start it with --node-config 'partition-id=0 num-partitions=2')")
    pid, nparts = int(node["partition-id"]), int(node["num-partitions"])
    if not 0 <= pid < nparts:
        raise ValueError(f"partition-id {pid} outside [0, {nparts})")
    return pid, nparts


@functools.lru_cache(maxsize=2)
def _dataset(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``size`` images of ``name`` in ``[0, 1]`` (cached per process: Ray actors persist)."""
    from fl_attack.testbed.data import load_images

    return load_images(name, size if size > 0 else None, seed=seed)


@functools.lru_cache(maxsize=4)
def _shards(name: str, size: int, seed: int, nparts: int, scheme: str,
            alpha: float) -> tuple[np.ndarray, ...]:
    _, labels = _dataset(name, size, seed)
    return tuple(partition(labels.numpy(), nparts, scheme=scheme, alpha=alpha, seed=seed))


def _model(cfg: Mapping[str, Any], arrays: ArrayRecord) -> torch.nn.Module:
    """The global model: a ReLU MLP of the configured shape with the received weights."""
    from fl_attack.testbed.data import image_shape
    from fl_attack.testbed.models import relu_mlp

    in_features = int(np.prod(image_shape(str(cfg["dataset"]))))
    model = relu_mlp(in_features, int(cfg["width"]), int(cfg["depth"]), NUM_CLASSES)
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    return model


def _local_data(cfg: Mapping[str, Any], context: Context, server_round: int,
                *, train: bool) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, int]:
    """This round's sample indices, normalised inputs and labels; plus the partition id."""
    from fl_attack.testbed.data import normalize

    pid, nparts = _partition_of(context)
    name, size, seed = str(cfg["dataset"]), int(cfg["dataset-size"]), int(cfg["data-seed"])
    images, labels = _dataset(name, size, seed)
    shard = _shards(name, size, seed, nparts, str(cfg["partitioning"]),
                    float(cfg["dirichlet-alpha"]))[pid]
    pool, evaluation = eval_split(shard, int(cfg["eval-size"]),
                                  held_out=bool(cfg["eval-held-out"]))
    if train:
        if int(cfg["batch-size"]) > len(pool):
            raise ValueError(f"batch-size {cfg['batch-size']} exceeds the {len(pool)} samples "
                             f"this client trains on (partition {pid})")
        idx = client_batch(pool, int(cfg["batch-size"]), seed=seed, server_round=server_round,
                           partition_id=pid)
    else:
        idx = evaluation
    t = torch.from_numpy(idx)
    return idx, normalize(images[t], name), labels[t], pid


def _cumulative_epsilon(context: Context, noise: float, rate: float, steps: int,
                        delta: float) -> float:
    """ε after all DP rounds this client took part in (RDP composition over the run).

    The per-round history ``(noise multiplier, sample rate, steps)`` lives in the node's
    ``context.state``, which Flower keeps across rounds.
    """
    from opacus.accountants import RDPAccountant

    from fl_attack.testbed.dpsgd import RDP_ALPHAS
    hist = context.state.config_records.get("dp-history")
    if hist is None:
        hist = ConfigRecord({"noise": [], "rate": [], "steps": []})
    noise_l = [*list(hist["noise"]), float(noise)]
    rate_l = [*list(hist["rate"]), float(rate)]
    steps_l = [*list(hist["steps"]), int(steps)]
    context.state["dp-history"] = ConfigRecord({"noise": noise_l, "rate": rate_l,
                                                "steps": steps_l})
    if min(noise_l) <= 0:
        return math.inf
    acc = RDPAccountant()
    acc.history = list(zip(noise_l, rate_l, steps_l, strict=True))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Optimal order is the.*alpha.*")
        return float(acc.get_epsilon(delta=delta, alphas=RDP_ALPHAS))


def _inject(mode: str, arrays: ArrayRecord, global_arrays: ArrayRecord) -> ArrayRecord:
    """Corrupt a reply's arrays the way ``mode`` says (robustness tests only)."""
    state = {k: v.numpy().copy() for k, v in arrays.items()}
    first = next(iter(state))
    if mode == "nan":
        state[first].reshape(-1)[0] = np.nan
    elif mode == "shape":
        state[first] = np.zeros((3, 3), dtype=state[first].dtype)
    elif mode == "missing":
        del state[first]
    elif mode == "zero":
        state = {k: v.numpy().copy() for k, v in global_arrays.items()}
    return ArrayRecord({k: Array(v) for k, v in state.items()})


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on this round's batch and reply with the new weights (see module docstring);
    with ``leak-guard`` set, the client's own LeakGuard checks the reply before it leaves."""
    cfg = client_config(msg, context)
    policy = str(cfg["leak-guard"])
    if not policy:
        return _train(msg, context)
    from fl_attack_flwr.clients.leak_guard import LeakGuard

    guard = LeakGuard(policy, max_seconds=float(cfg["leak-guard-seconds"]),
                      local_dp=_local_dp(cfg) if policy == "escalate" else None)
    return guard(msg, context, _train)


def _local_dp(cfg: Mapping[str, Any]) -> dict[str, float]:
    """``LocalDpMod`` parameters of the ``escalate`` policy, from the run config."""
    return {"clipping_norm": float(cfg["clip"]), "sensitivity": float(cfg["clip"]),
            "epsilon": float(cfg["leak-guard-epsilon"]), "delta": float(cfg["delta"])}


def _train(msg: Message, context: Context) -> Message:
    """The client's own training (the handler a LeakGuard wraps)."""
    from fl_attack.testbed.simulate import local_update

    cfg = client_config(msg, context)
    torch.set_num_threads(max(1, int(cfg["client-threads"])))
    server_round = int(cfg.get("server-round", 1))
    faults = parse_faults(str(cfg["inject-faults"]))
    pid, nparts = _partition_of(context)
    if cfg["task"] == "text":
        from fl_attack_flwr.clients.text_task import text_train

        return text_train(msg, cfg, pid, nparts)
    if faults.get(pid) == "raise":
        raise RuntimeError(f"injected fault: partition {pid} fails on purpose")

    global_arrays = next(iter(msg.content.array_records.values()))
    model = _model(cfg, global_arrays)
    idx, x, y, pid = _local_data(cfg, context, server_round, train=True)
    protocol = str(cfg["protocol"])
    mini = int(cfg["mini-batch-size"])
    kwargs: dict[str, Any] = {"protocol": protocol, "lr": float(cfg["lr"]),
                              "seed": int(cfg["data-seed"]) * 100_003 + server_round * 1009 + pid}
    if protocol != "fedsgd":
        kwargs["epochs"] = int(cfg["local-epochs"])
        kwargs["batch_size"] = mini if mini > 0 else None
    if protocol == "dpsgd":
        kwargs.update(max_grad_norm=float(cfg["clip"]),
                      noise_multiplier=float(cfg["noise-multiplier"]),
                      delta=float(cfg["delta"]))
    result = local_update(model, x, y, **kwargs)

    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    metrics: dict[str, Any] = {NUM_EXAMPLES_KEY: int(result.num_examples), "train-loss": loss}
    if protocol == "dpsgd":
        n = int(x.shape[0])
        rate = (min(mini, n) / n) if mini > 0 else 1.0
        eps_cum = _cumulative_epsilon(context, float(cfg["noise-multiplier"]), rate,
                                      int(result.steps), float(cfg["delta"]))
        metrics.update({EPSILON_KEY: float(result.epsilon), EPSILON_CUMULATIVE_KEY: eps_cum,
                        DELTA_KEY: float(result.delta), NOISE_STD_KEY: float(result.noise_std)})
    info: dict[str, Any] = {PARTITION_ID_KEY: pid}
    if bool(cfg["audit"]):
        info[SAMPLE_INDICES_KEY] = [int(i) for i in idx]
    arrays = ArrayRecord(result.state_dict)
    if pid in faults:
        arrays = _inject(faults[pid], arrays, global_arrays)
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics),
                          CLIENT_INFO_KEY: ConfigRecord(info)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the global model on (up to ``eval-size``) samples of the partition:
    samples it never trains on with ``eval-held-out``, else samples it may also train on."""
    cfg = client_config(msg, context)
    torch.set_num_threads(max(1, int(cfg["client-threads"])))
    if cfg["task"] == "text":
        from fl_attack_flwr.clients.text_task import text_evaluate

        return text_evaluate(msg, cfg, *_partition_of(context))
    model = _model(cfg, next(iter(msg.content.array_records.values())))
    _, x, y, _ = _local_data(cfg, context, int(cfg.get("server-round", 1)), train=False)
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(dim=1) == y).double().mean())
    metrics = MetricRecord({NUM_EXAMPLES_KEY: int(x.shape[0]), "eval-loss": loss,
                            "eval-acc": acc})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
