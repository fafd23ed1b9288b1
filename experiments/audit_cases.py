"""What the audit records on users' apps it was not built around: Flower simulations, end to end.

Cases (each a Flower simulation of 2 SuperNodes, one round, one SGD step per client on real
photo crops, the server's ``AuditingStrategy`` with its records read back from the run
directory):

* ``quickstart-8`` / ``quickstart-32``: ``examples/quickstart-cnn`` (Flower's quickstart CNN,
  its training loop, the model given to the audit) on 8 or 32 photos per client: the batch
  size each record reads against the reply's ``num-examples``, its reason, and the pictures
  estimated from the features, stored as ``pixels.npz``;
* ``bn-first`` / ``bn-first-model``: a third-party MLP (its own layer names and loop) with
  Linear -> BatchNorm1d -> ReLU first, in train mode, without and with the model given: the
  first layer is ``not-covered`` and the next one's input features are read;
* ``bn-second``: the same MLP with the BatchNorm after its second layer: the first is attacked.

Prints one markdown section (``--out`` appends it to a results file).

    python -m experiments.audit_cases
    python -m experiments.audit_cases --cases bn-first --out experiments/results/cnn.md
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments import harness

MODULE = "experiments.audit_cases"
CASES = ("quickstart-8", "quickstart-32", "bn-first", "bn-first-model", "bn-second")
QUICKSTART = harness.ROOT / "examples" / "quickstart-cnn"
POOL, SAMPLES, MEAN, STD = 4000, 16, 0.5, 0.25


class NormedMLP(nn.Module):
    """A user's MLP on flattened 3x32x32 photos: enc -> mid -> out, with a BatchNorm1d right
    after ``enc`` (``place="first"``, before the ReLU) or after ``mid`` (``"second"``)."""

    def __init__(self, place: str = "first") -> None:
        super().__init__()
        self.place = place
        self.enc = nn.Linear(3 * 32 * 32, 128)
        self.norm = nn.BatchNorm1d(128 if place == "first" else 64)
        self.mid = nn.Linear(128, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.place == "first":
            return self.out(torch.relu(self.mid(torch.relu(self.norm(self.enc(x))))))
        return self.out(torch.relu(self.norm(self.mid(torch.relu(self.enc(x))))))


def bn_client_app(place: str) -> Any:
    """The MLP's ClientApp: one SGD step (lr 0.1, train mode) on the client's photos; it sends
    its weights, ``num-examples`` and, for the audit's scores only, its sample indices."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fl_attack.testbed.data import load_images

    app = ClientApp()

    @app.train()
    def fit(msg: Message, context: Any) -> Message:
        net = NormedMLP(place)
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        images, labels = load_images("photos32", POOL, seed=7)
        idx = torch.arange(pid * SAMPLES, (pid + 1) * SAMPLES)
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loss = nn.functional.cross_entropy(net((images[idx] - MEAN) / STD), labels[idx])
        loss.backward()
        opt.step()
        return Message(content=RecordDict({
            "arrays": ArrayRecord(net.state_dict()),
            "metrics": MetricRecord({"train_loss": float(loss), "num-examples": SAMPLES}),
            "client-info": ConfigRecord({"partition-id": pid,
                                         "sample-indices": [int(i) for i in idx]})}),
            reply_to=msg)

    return app


def bn_server_app(out: str, name: str, place: str, given: bool) -> Any:
    """The MLP's ServerApp: FedAvg wrapped in the audit (the model given or not; the app's
    input shape and normalisation always, so that inputs are scored as the app sees them)."""
    from flwr.app import ArrayRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fl_attack_flwr import AttackSettings, AuditingStrategy, AuditStore, GroundTruth

    app = ServerApp()

    @app.main()
    def main(grid: Any, context: Any) -> None:
        model = {"model": functools.partial(NormedMLP, place), "pixel_seconds": 30.0}
        strategy = AuditingStrategy(FedAvg(fraction_evaluate=0.0), store=AuditStore(out, name),
                                    attack=AttackSettings(max_seconds=60.0),
                                    ground_truth=GroundTruth("photos32", POOL, seed=7),
                                    input_shape=(3, 32, 32),
                                    input_transform=((MEAN,) * 3, (STD,) * 3),
                                    **(model if given else {}))
        torch.manual_seed(0)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(NormedMLP(place).state_dict()),
                       num_rounds=1)
        strategy.store.finalize()

    return app


_RUN = textwrap.dedent("""
    import json, sys
    from flwr.simulation import run_simulation
    out, name, case = sys.argv[1], sys.argv[2], sys.argv[3]
    if case.startswith("quickstart"):
        from quickstart_cnn.client_app import make_client_app
        from quickstart_cnn.server_app import make_server_app
        n = int(case.split("-")[1])
        server = make_server_app({"output-dir": out, "run-name": name, "max-seconds": 60.0,
                                  "pixel-seconds": 30.0})
        client = make_client_app({"samples": n, "batch-size": 32})
    else:
        from experiments.audit_cases import bn_client_app, bn_server_app
        place = "second" if case == "bn-second" else "first"
        server = bn_server_app(out, name, place, case.endswith("model"))
        client = bn_client_app(place)
    run_simulation(server_app=server, client_app=client, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "num_gpus": 0,
                                                 "include_dashboard": False,
                                                 "logging_level": "ERROR"}})
""")


def run_case(case: str, out: Path) -> list[dict[str, Any]]:
    """Run one case's simulation; its metrics lines."""
    from fl_attack_flwr.output.private_files import records_from_jsonl

    path = os.pathsep.join([str(QUICKSTART), str(harness.ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _RUN, str(out), case, case], cwd=out, env=env,
                          capture_output=True, text=True, timeout=1800)
    metrics = out / case / "metrics.jsonl"
    if not metrics.is_file():
        raise RuntimeError(f"{case} wrote no records:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return records_from_jsonl(metrics)


def _fmt(value: object, digits: int = 1) -> str:
    return "–" if value is None else f"{float(value):.{digits}f}"


def rows(case: str, lines: list[dict[str, Any]]) -> tuple[list[list[object]], list[str]]:
    """Table rows and reason lines of one case's records."""
    table, words = [], []
    for ln in sorted(lines, key=lambda ln: ln["client"]):
        passed = ", ".join(f"{p['layer']} {p['status']}" for p in ln.get("passed_over") or [])
        pictures = ln["pixels"] and not ln["pixels"].get("error")
        table.append([case, ln["client"], ln["status"], ln["layer"], ln["batch_size"],
                      ln["num_examples"], _fmt(ln["sparsity_match"], 4), passed or "–",
                      "yes" if "pixels.npz" in ln["files"] else "no",
                      _fmt(ln["psnr_mean"], 1) if pictures or ln["reads"] == "inputs"
                      else "–", _fmt(ln["attack_seconds"], 1)])
        for why in [ln.get("reason"), ln.get("error"),
                    *[p["reason"] for p in ln.get("passed_over") or []],
                    (ln["pixels"] or {}).get("batch_statistics")]:
            if why:
                words.append(f"- {case}, {ln['client']}: {why}")
    return table, words


COLUMNS = ["case", "client", "status", "layer", "B", "num-examples", "λ", "passed over",
           "pixels.npz", "PSNR [dB]", "attack s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=harness.list_of(str, "case"), default=list(CASES))
    parser.add_argument("--out", type=Path, default=None, help="append the section here")
    args = parser.parse_args(argv)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        parser.error(f"unknown case(s) {bad}; choose from {list(CASES)}")
    torch.set_num_threads(1)
    head = [harness.section_heading(MODULE, argv), "", harness.machine_line("cpu"), "",
            *harness.table_header(COLUMNS)]
    table, words = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            got = rows(case, run_case(case, Path(tmp)))
            table += got[0]
            words += got[1]
    lines = [*head, *(harness.table_row(r) for r in table), "", "Reasons as recorded:", "",
             *words]
    print("\n".join(lines))
    if args.out is not None:
        harness.append_lines(args.out, "", *lines)


if __name__ == "__main__":
    main()
