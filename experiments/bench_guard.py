"""What ``LeakGuard`` costs a client per round, and what it finds, on real updates.

The client mod (``fl_attack_flwr.LeakGuard``, ``clients/leak_guard.py``) runs the server's own
exact attack on the client's update after the client trains, under its own budget
(``max_seconds``). This script puts the mod, with ``policy="refuse"``, around a real training
handler: the handler trains on real photo crops (``photos32``) from the global model it receives
and replies with its weights and ``num-examples``, as a Flower client does; the mod checks the
update and decides. Per round it records the training time (the handler's own step), the check's
time (``leak-guard-seconds``, what the guard measured) and the mod's whole overhead, the check's
finding (``leak-guard-status``) and whether ``refuse`` withheld the update. ``report`` runs the
same check and sends every update, so its cost is the same and it withholds nothing.

Settings (each on ``--batches`` batches, seeds 0 onwards, at each budget of ``--budgets``):

* the bundled client's model, ``relu_mlp(3072, 200, 3)`` (lr 0.01, as the bundled ClientApp):
  FedSGD one step on B = 16 and B = 32; FedAvg one epoch of mini-batches of 8 over 32 samples
  (4 local steps);
* the example app's own ``Net`` (``examples/photo-mlp``: fc1 3072->128, fc2 128->64, head; lr
  0.05, its own normalisation): one step on B = 16; 96 samples in mini-batches of 32 for 2
  epochs (6 local steps, the update mixes 96 samples in a 128-unit layer: protected).

Appends a section to ``experiments/results/leak_guard.md`` (``--out`` to write elsewhere), one row
per (setting, budget) as it finishes.

    python -m experiments.bench_guard                  # 5 batches, budgets 30 and 10 s
    python -m experiments.bench_guard --smoke          # a quick check (< 1 min), to /tmp
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments import harness

MODULE = "experiments.bench_guard"
RESULTS = harness.RESULTS_DIR / "leak_guard.md"
EXAMPLE = harness.ROOT / "examples" / "photo-mlp"
TITLE = "LeakGuard: what the client's own check costs a round, and what it finds"
INTRO = """`fl_attack_flwr.LeakGuard` (a Flower client mod) runs the server's own exact attack
(SPEAR++, first layer, next layer for peeling) on the client's update after the client trains,
under its own budget `max_seconds` (default 30 s). Produced by `python -m experiments.bench_guard`:
the mod, `policy="refuse"`, around a real training handler on real photo crops (`photos32`), one
client round per batch (seeds 0 onwards), after one untimed warm-up round (the process's first
check and each setting's first training pay one-off set-up costs). *check s*: the guard's own
measure of its check (`leak-guard-seconds`); *overhead s*: the mod's whole time minus the
training (the check, plus copying the arrays); *check CPU s*: the process's CPU seconds in that
overhead (with one thread, what the check costs a core, whatever else loads the machine);
*training s*: the handler's training step alone; *findings*: the check's statuses over the
batches; *refused*: the share of rounds `refuse` withholds (an update the check proves readable:
certified, or samples verified one by one). `report` runs the same check and
withholds nothing. Timings are one process with one torch thread (as the bundled client:
`client-threads = 1`)."""
COLUMNS = ("model", "update", "B", "budget s", "batches", "check median s", "check max s",
           "overhead median s", "check CPU median / max s", "training median s", "findings",
           "refused")
ALIGN = ("l", "l", "r", "r", "r", "r", "r", "r", "r", "r", "l", "r")
FINDINGS = ("certified", "not-certified", "partial", "protected", "timeout")
"""The statuses the findings cell counts first (others follow when they occur)."""


@dataclass(frozen=True)
class Setting:
    """One client setting: its model, what it trains, and how."""

    key: str
    model: str
    update: str
    samples: int
    make: Callable[[int], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]
    """seed -> (global model, inputs, labels)."""
    train: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]
    """(model, inputs, labels, seed) -> the trained state dict (the model is left as received)."""


def _photos(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from fl_attack.testbed import data

    return data.sample_batch("photos32", n, seed=seed)


def _bundled(n: int) -> Callable[[int], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """The bundled client's ReLU MLP 3 x 200 and ``n`` photos, normalised as it does."""
    def make(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        from fl_attack.testbed import data, models

        x, y = _photos(n, seed)
        return models.relu_mlp(3 * 32 * 32, 200, 3, seed=seed), data.normalize(x, "photos32"), y

    return make


def _local_update(protocol: str, epochs: int = 1, batch_size: int | None = None
                  ) -> Callable[..., dict[str, torch.Tensor]]:
    """The bundled client's training (``fl_attack.testbed.simulate.local_update``, lr 0.01)."""
    def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              seed: int) -> dict[str, torch.Tensor]:
        from fl_attack.testbed.simulate import local_update

        kwargs: dict[str, Any] = {"protocol": protocol, "lr": 0.01, "seed": seed}
        if protocol != "fedsgd":
            kwargs.update(epochs=epochs, batch_size=batch_size)
        return local_update(model, x.flatten(1), y, **kwargs).state_dict

    return train


def _example() -> Any:
    """The example app's ``photo_mlp.task`` (its folder is not installed: put it on the path)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    from photo_mlp import task

    return task


def _example_data(n: int) -> Callable[[int], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """The example's ``Net`` (seeded) and ``n`` photos, normalised as its ``load_partition``."""
    def make(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        task = _example()
        x, y = _photos(n, seed)
        torch.manual_seed(seed)
        return task.Net(), (x - task.MEAN) / task.STD, y

    return make


def _example_train(epochs: int, batch_size: int) -> Callable[..., dict[str, torch.Tensor]]:
    """The example's own ``train`` (mini-batch SGD in order, lr 0.05) on a copy of the model."""
    def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              seed: int) -> dict[str, torch.Tensor]:
        import copy

        net = copy.deepcopy(model)
        _example().train(net, x, y, epochs=epochs, batch_size=batch_size, lr=0.05)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    return train


MLP = "ReLU MLP 3 x 200 (bundled client)"
NET = "example `Net` (fc1 128, fc2 64)"
SETTINGS: dict[str, Setting] = {s.key: s for s in (
    Setting("mlp-fedsgd-16", MLP, "FedSGD, 1 step", 16, _bundled(16), _local_update("fedsgd")),
    Setting("mlp-fedsgd-32", MLP, "FedSGD, 1 step", 32, _bundled(32), _local_update("fedsgd")),
    Setting("mlp-fedavg-32", MLP, "FedAvg, 1 epoch of mini-batches of 8 (4 steps)", 32,
            _bundled(32), _local_update("fedavg", epochs=1, batch_size=8)),
    Setting("net-step-16", NET, "1 step", 16, _example_data(16), _example_train(1, 16)),
    Setting("net-fedavg-96", NET, "2 epochs of mini-batches of 32 (6 steps)", 96,
            _example_data(96), _example_train(2, 32)),
)}


def _metadata(kind: str, src: int, dst: int, reply_to: str = "") -> Any:
    from flwr.app import Metadata

    return Metadata(run_id=1, message_id=f"{kind}-{src}-{dst}", src_node_id=src,
                    dst_node_id=dst, reply_to_message_id=reply_to, group_id="1",
                    created_at=time.time(), ttl=3600.0, message_type="train")


def client_round(setting: Setting, seed: int, guard: Any) -> dict[str, Any]:
    """One client round: the guard around the setting's training handler, on batch ``seed``.

    Returns
    -------
    dict
        ``train_s`` (the handler's training), ``mod_s`` (the mod's whole call),
        ``overhead_cpu`` (the process's CPU seconds in the mod outside the training), ``check_s``
        (``leak-guard-seconds``), ``status`` (the check's finding), ``refused``,
        ``readable`` (samples the check proves readable).
    """
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

    from fl_attack_flwr.wire import GUARD_CODES

    model, x, y = setting.make(seed)
    received = {k: v.detach().clone() for k, v in model.state_dict().items()}
    msg = Message(content=RecordDict({"arrays": ArrayRecord(received)}),
                  metadata=_metadata("ins", 0, 1))
    timing: dict[str, float] = {}

    def handler(m: Message, _ctx: Context) -> Message:
        t0, c0 = time.perf_counter(), time.process_time()
        state = setting.train(model, x, y, seed)
        timing["train"] = time.perf_counter() - t0
        timing["train_cpu"] = time.process_time() - c0
        content = RecordDict({"arrays": ArrayRecord(state),
                              "metrics": MetricRecord({"num-examples": int(x.shape[0])})})
        return Message(content=content, metadata=_metadata("reply", 1, 0, m.metadata.message_id))

    t0, c0 = time.perf_counter(), time.process_time()
    out = guard(msg, Context(1, 1, {}, RecordDict(), {}), handler)
    mod_s, mod_cpu = time.perf_counter() - t0, time.process_time() - c0
    metrics = out.content["metrics"]
    return {"train_s": timing["train"], "mod_s": mod_s,
            "overhead_cpu": mod_cpu - timing["train_cpu"],
            "check_s": float(metrics["leak-guard-seconds"]),
            "status": GUARD_CODES[int(metrics["leak-guard-status"])],
            "refused": bool(metrics["leak-guard-refused"]),
            "readable": int(metrics["leak-guard-readable-samples"])}


def findings_cell(statuses: Sequence[str]) -> str:
    """``"5 certified"``, ``"3 certified, 2 timeout"``: the statuses' counts, known ones first."""
    count = Counter(statuses)
    order = [s for s in FINDINGS if count[s]] + sorted(s for s in count if s not in FINDINGS)
    return ", ".join(f"{count[s]} {s}" for s in order)


def run_setting(setting: Setting, budget: float, seeds: Sequence[int]) -> dict[str, Any]:
    """Every batch of ``setting`` at ``budget``; the row's numbers."""
    from fl_attack_flwr import LeakGuard

    guard = LeakGuard("refuse", max_seconds=budget)
    model, x, y = setting.make(seeds[0])
    setting.train(model, x, y, seeds[0])  # untimed: the first call pays one-off set-up costs
    rounds = []
    for seed in seeds:
        r = client_round(setting, seed, guard)
        rounds.append(r)
        print(f"  {setting.key} budget {budget:g} s, batch {seed}: {r['status']}"
              f", readable {r['readable']}, check {r['check_s']:.2f} s (CPU "
              f"{r['overhead_cpu']:.2f} s), training "
              f"{r['train_s']:.3f} s{', refused' if r['refused'] else ', sent'}", flush=True)
    checks = [r["check_s"] for r in rounds]
    overhead = [r["mod_s"] - r["train_s"] for r in rounds]
    return {"check_median": statistics.median(checks), "check_max": max(checks),
            "overhead_median": statistics.median(overhead),
            "cpu_median": statistics.median(r["overhead_cpu"] for r in rounds),
            "cpu_max": max(r["overhead_cpu"] for r in rounds),
            "train_median": statistics.median(r["train_s"] for r in rounds),
            "findings": findings_cell([r["status"] for r in rounds]),
            "refused": sum(r["refused"] for r in rounds), "batches": len(rounds)}


def main(argv: Sequence[str] | None = None) -> None:
    """Run every (setting, budget) and append its row to the results file as it finishes."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_batches(parser, 5)
    harness.add_first_seed(parser)
    parser.add_argument("--budgets", type=harness.list_of(float, "--budgets"), default=[30.0, 10.0],
                        help="the guard's max_seconds, comma-separated (default 30,10)")
    parser.add_argument("--settings", type=harness.list_of(str, "--settings"),
                        default=list(SETTINGS),
                        help=f"comma-separated setting keys (default all: {', '.join(SETTINGS)})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as the bundled client's client-threads)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check (< 1 min): one batch of two settings at a 10 s "
                             "budget, written under the temp folder unless --out is given")
    harness.add_out(parser, RESULTS)
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    unknown = [k for k in args.settings if k not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    if min(args.budgets) <= 0 or args.threads < 1:
        parser.error("--budgets must be > 0 and --threads >= 1")
    if args.smoke:
        args.batches, args.budgets = 1, [10.0]
        args.settings = ["mlp-fedsgd-16", "net-fedavg-96"]
        if args.out == RESULTS:
            args.out = Path(tempfile.gettempdir()) / "leak_guard_smoke.md"
    torch.set_num_threads(args.threads)
    from fl_attack_flwr import LeakGuard

    # One untimed round first: the process's first check pays imports and one-off set-up.
    client_round(SETTINGS["mlp-fedsgd-16"], 10_000, LeakGuard("report", max_seconds=10.0))
    seeds = list(range(args.first_seed, args.first_seed + args.batches))
    setup = (f"Policy `refuse` (on_unknown `send`), budgets {', '.join(f'{b:g}' for b in args.budgets)}"
             f" s, batches from seeds {seeds[0]}-{seeds[-1]}, {args.threads} torch thread(s)"
             f"{', smoke run' if args.smoke else ''}.")
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line("cpu"), "", setup, "",
        *harness.table_header(COLUMNS, ALIGN)])
    for budget in args.budgets:
        for key in args.settings:
            s = SETTINGS[key]
            res = run_setting(s, budget, seeds)
            row = harness.table_row([
                s.model, s.update, s.samples, f"{budget:g}", res["batches"],
                f"{res['check_median']:.2f}", f"{res['check_max']:.2f}",
                f"{res['overhead_median']:.2f}", f"{res['cpu_median']:.2f} / {res['cpu_max']:.2f}",
                f"{res['train_median']:.3f}", res["findings"],
                f"{res['refused']}/{res['batches']}"])
            print(row, flush=True)
            harness.append_lines(args.out, row)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
