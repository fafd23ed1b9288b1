"""Which defence protects you? One audited federation under each defence Flower offers.

The same federation (real photo crops shaped like CIFAR-10, ``photos32``; a ReLU MLP; FedSGD
clients of the plugin) runs once per defence, all in one Flower simulation
(``experiments.defence_apps``); the server inverts what it receives in round 1 with SPEAR++ and
scores it against the clients' true samples. Defences (``experiments.defence_variants``):

* none; FedAvg with larger local batches and more local epochs;
* Flower's central DP: ``DifferentialPrivacyServerSideFixedClipping`` and
  ``DifferentialPrivacyClientSideFixedClipping`` with the client mod ``fixedclipping_mod``;
* ``LocalDpMod`` at several ε; Opacus DP-SGD at several noise multipliers;
* the clients' own ``LeakGuard`` with ``policy="refuse"`` (run config ``leak-guard``): a client
  withholds an update its check proves readable (the share refused is its own column);
* secure aggregation: the audit attacks only the round's aggregate; and a real SecAgg+ run
  (``SecAggPlusWorkflow`` / ``secaggplus_mod``, see ``experiments.defence_secaggplus``).

For each: updates certified, updates refused by the clients' guard, share of the attacked
samples reconstructed above 25 dB and 90 dB, ε where defined, the clients' final accuracy, round
time. Writes a section to
``experiments/results/defences.md`` and one HTML page (table, plot, plain words).

    .venv/bin/python -m experiments.defences                 # small: about a minute
    .venv/bin/python -m experiments.defences --size demo     # the demo's federation
    .venv/bin/python -m experiments.defences --only none,secagg --rounds 3

Each row's full audit (reconstructions beside the originals, per-client tables) is written under
``runs/defences-<time>/<row>/`` (owner-only: it holds the clients' private images).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments import harness
from experiments.defence_variants import SIZES, Defence, Size, matrix

MODULE = "experiments.defences"
ROOT = harness.ROOT
RESULTS_MD = harness.RESULTS_DIR / "defences.md"
RESULTS_HTML = harness.RESULTS_DIR / "defences.html"

TITLE = "Which defence protects you?"
"""The title of ``defences.md`` (also used by :mod:`experiments.aggregate_precision`)."""
INTRO = """The same audited federation under each defence Flower offers; the server inverts what it
receives in round 1 (SPEAR++, first layer) and scores it against the clients' true samples.
Produced by `python -m experiments.defences` (see its docstring); the newest run's HTML page
(table, plot, plain words) is `experiments/results/defences.html`.

How the rows are built (`experiments/defence_*.py`): the plugin's own ClientApp `train` and
`evaluate`, and `AuditingStrategy` outermost on the server, so the audit reads each reply as the
server process receives it. Central DP is Flower's `DifferentialPrivacyServerSideFixedClipping` /
`DifferentialPrivacyClientSideFixedClipping` (+ `fixedclipping_mod` on the clients' train
handler); local DP is `LocalDpMod` on the train handler; DP-SGD is the clients' Opacus
protocol. "Client-side guard (refuse)" is the plugin's `LeakGuard` in the clients (run config
`leak-guard = "refuse"`, `leak-guard-seconds` = the server's attack budget): a client runs the
server's exact attack on its own update and withholds one it proves readable (it sends the
received arrays back at a weight FedAvg ignores); *refused* counts those replies over all rounds,
and a withheld round-1 reply counts as its batch's samples, none read. "Secure aggregation" is
the audit's `target="aggregate"`: only the round's aggregate is attacked, as one batch of every
client's samples. "SecAgg+" is a real run of Flower's `SecAggPlusWorkflow` and `secaggplus_mod`.

SecAgg+ and the Message API (flwr 1.41): `flwr.serverapp` and `flwr.clientapp` have no secure
aggregation. The only SecAgg+ is the legacy one: `SecAggPlusWorkflow` needs a `LegacyContext`
and a legacy `flwr.server.strategy.Strategy` (`configure_fit`/`aggregate_fit`), and
`secaggplus_mod` feeds the wrapped train function legacy `fitins.*` records and reads its reply
with `recorddict_to_fitres`, which fails on a Message-API reply (no `fitres.*` records). So it
cannot run with Message-API apps as they are; the SecAgg+ rows run it through thin adapters
(`experiments/defence_secaggplus.py`): a legacy FedAvg that hands the unmasked aggregate to
`AuditingStrategy`, and a client train function that converts `FitIns`/`FitRes` around the
plugin's own `train`.

ε is what each defence claims at δ = 1e-5: DP-SGD as the clients report it (Opacus RDP,
composed over rounds); central DP the client-level ε of its Gaussian noise on the aggregate
(noise multiplier z, every client every round, from Flower's own `RdpAccountant`, the accountant
its DP wrappers take); `LocalDpMod` the ε it is configured with, per round, and R·ε over R
rounds by basic composition. Each ε names the accountant that gave it.
"""
"""What ``defences.md`` opens with under its title: how the rows are built."""


def base_config(size: Size, out_dir: Path, executor: str) -> dict[str, Any]:
    """The run config every row shares (each row overrides its own keys)."""
    return {
        "num-clients": size.clients, "num-server-rounds": size.rounds,
        "dataset": "photos32", "dataset-size": size.dataset_size,
        "batch-size": size.batch_size, "width": size.width, "depth": 3,
        "protocol": "fedsgd", "lr": 0.01, "audit": True, "eval-size": size.eval_size,
        "max-seconds": size.max_seconds, "attack-timeout": 10 * size.max_seconds,
        "audit-executor": executor, "audit-rounds": "1", "output-dir": str(out_dir),
    }


def simulate(defences: list[Defence], base: dict[str, Any], *, num_cpus: int | None = None,
             verbose: bool = False) -> None:
    """Run every row in one Flower simulation (Ray starts and stops once)."""
    from flwr.simulation import run_simulation

    from experiments.defence_apps import client_app, server_app

    cpus = int(num_cpus or os.cpu_count() or 2)
    backend = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False,
                      "logging_level": "ERROR", "log_to_driver": True},
    }
    run_simulation(server_app=server_app(defences, base), client_app=client_app(defences),
                   num_supernodes=int(base["num-clients"]), backend_config=backend,
                   verbose_logging=verbose)


def run_header(args: argparse.Namespace, size: Size, seconds: float) -> str:
    """The run's one-line header: date, command, machine and versions, the federation."""
    import flwr

    when = harness.utc_now()
    return (f"{when:%Y-%m-%d %H:%M} UTC, `{harness.command_line(MODULE, args.argv)}` "
            f"({seconds / 60:.1f} min). "
            f"{harness.machine_line(versions={'flwr': flwr.__version__})} "
            f"Federation: {size.clients} clients, photos32, ReLU MLP 3 x {size.width}, "
            f"B = {size.batch_size} (FedAvg rows: their own B), {size.rounds} rounds, lr 0.01; "
            f"round 1 attacked (SPEAR++, budget {size.max_seconds:g} s per attack); accuracy = "
            f"the clients' evaluation of the final model on {size.eval_size} samples of their "
            "shards.")


def write_results(rows: list[dict[str, Any]], header: str, md: Path, html: Path) -> None:
    """Append a section to ``md`` (created with its title and intro) and write the HTML page."""
    from experiments.defence_report import baseline_accuracy, markdown_table, render_html, sentence
    from fl_attack_flwr.output.private_files import atomic_write_bytes

    base = baseline_accuracy(rows)
    harness.start_section(md, TITLE, INTRO, [
        f"## {header}", "", markdown_table(rows), "", *[f"- {sentence(r, base)}" for r in rows]])
    atomic_write_bytes(html, render_html(rows, header, html.parent).encode())
    os.chmod(html, 0o644)  # the page holds numbers and a plot, no client data


def _size(args: argparse.Namespace) -> Size:
    size = SIZES[args.size]
    changes = {k: v for k, v in (("rounds", args.rounds), ("clients", args.clients),
                                 ("max_seconds", args.max_seconds)) if v is not None}
    return dataclasses.replace(size, **changes)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="small (default: minutes, every family once) or demo (make demo's)")
    p.add_argument("--rounds", type=int, help="rounds per defence (default: the size's)")
    p.add_argument("--clients", type=int, help="clients (default: the size's)")
    p.add_argument("--max-seconds", type=float, help="attack budget per update")
    p.add_argument("--only", default="", help="comma-separated row keys or families")
    p.add_argument("--no-secaggplus", action="store_true", help="leave out the SecAgg+ run")
    p.add_argument("--executor", default="inline", choices=("inline", "process", "pool"),
                   help="where the attacks run (default inline: no worker start per row)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs",
                   help="parent of the matrix's run directory (default runs/)")
    harness.add_out(p, RESULTS_MD, "--md")
    p.add_argument("--html", type=Path, default=RESULTS_HTML, help=f"page ({RESULTS_HTML})")
    p.add_argument("--verbose", action="store_true", help="Flower debug logging")
    args = p.parse_args(argv)
    args.argv = argv
    if (args.rounds or 1) < 1 or (args.clients is not None and args.clients < 3):
        p.error("--rounds must be >= 1 and --clients >= 3 (SecAgg+ needs 3)")
    size = _size(args)
    rows = matrix(size, secaggplus=not args.no_secaggplus)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        rows = [d for d in rows if d.key in wanted or d.family in wanted]
        if not rows:
            p.error(f"--only {args.only!r} matches no row")
    run_dir = args.out_dir / time.strftime("defences-%Y%m%d-%H%M%S", time.gmtime())
    base = base_config(size, run_dir, args.executor)
    if not args.verbose:
        from experiments.demo import quiet_logging

        quiet_logging()
    t0 = time.time()
    simulate(rows, base, verbose=args.verbose)
    from experiments.defence_report import collect

    results = collect(run_dir, rows, size.rounds)
    write_results(results, run_header(args, size, time.time() - t0), args.out, args.html)
    (run_dir / "rows.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out} and {args.html}; run directory {run_dir}")
    return 0 if all(r.get("status") == "completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
