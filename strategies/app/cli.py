"""``fl-attack``: the plugin's command line (a console script of the package).

``fl-attack audit SENT RETURNED [RETURNED ...]`` audits saved weights: the global model a
server sent and the models clients returned after training from it
(:func:`fl_attack_flwr.saved_audit.audit_update`). It writes the run directory the plugin
writes (``metrics.jsonl``, the reconstructions, ``summary.json``, ``report.html``), prints the
verdict, and exits as the privacy gate says:

====  ==========================================================================================
0     the audit ran (and ``--fail-on``, when given, passed)
2     a bad setting or input file, named in the message; nothing was attacked or written
3     the privacy gate ``--fail-on`` trips: the clients leaked what it names (report written)
====  ==========================================================================================

Also ``python -m fl_attack_flwr.app.cli audit ...``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from fl_attack_flwr.output.privacy_gate import FAIL_ON
from fl_attack_flwr.settings import UPDATES, AttackSettings

EXIT_BAD_INPUT = 2
EXIT_GATE = 3


def parser() -> argparse.ArgumentParser:
    """The ``fl-attack`` argument parser (choices from the settings' own lists)."""
    top = argparse.ArgumentParser(prog="fl-attack", description=(
        "Audit how much private data a federated-learning setup leaks (exact gradient "
        "inversion: SPEAR, SPEAR++)."))
    commands = top.add_subparsers(dest="command", required=True)
    p = commands.add_parser("audit", help="audit saved weights: SENT and the RETURNED models",
                            description=(
        "Attack the update SENT -> RETURNED of each RETURNED model as an honest-but-curious "
        "server would, write the run directory (records, reconstructions, summary.json, "
        "report.html) and print the verdict. Exit 0, 2 on a bad input or setting, 3 when "
        "--fail-on trips."))
    p.add_argument("sent", metavar="SENT", help="the global model the server sent (.pt, .pth, "
                   ".bin state dict; .npz; .safetensors)")
    p.add_argument("returned", metavar="RETURNED", nargs="+", help="a model a client returned "
                   "after training from SENT; several files or a folder: one client each")
    p.add_argument("--num-examples", type=_positive_int, default=None, metavar="N",
                   help="samples each client trained on, when known (the reply's num-examples)")
    p.add_argument("--layer", default=None, help="the attacked layer, e.g. fc1 or fc1.weight "
                   "(default: the first linear layer with a bias that the attack covers)")
    p.add_argument("--update", choices=UPDATES, default="auto", help="how to read the update: "
                   "one gradient step, a sum of local steps, or both in turn (default: auto)")
    p.add_argument("--max-seconds", type=float, default=AttackSettings.max_seconds,
                   metavar="S", help="soft time budget of one attack (default: %(default)s)")
    p.add_argument("--model", default=None, metavar="MODULE:CLASS", help="the clients' model "
                   "(pictures from features, the layers' order of a .safetensors SENT); for a "
                   "language model also a checkpoint folder with config.json (default: SENT's)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="a language model's "
                   "tokenizer folder, to decode the sentences read (default: SENT's)")
    p.add_argument("--input-shape", type=_shape, default=None, metavar="C,H,W",
                   help="the model's input shape, to show reconstructions as pictures")
    p.add_argument("--input-transform", nargs=2, type=_floats, default=None,
                   metavar=("MEAN", "STD"), help="the clients' per-channel normalisation, e.g. "
                   "0.5,0.5,0.5 0.5,0.5,0.5")
    p.add_argument("--out", default="runs", help="parent of the run directory "
                   "(default: runs/)")
    p.add_argument("--run-name", default=None, help="the run directory's name (default: a "
                   "fresh timestamped one)")
    p.add_argument("--fail-on", choices=[f for f in FAIL_ON if f], default="",
                   help="privacy gate: exit 3 when some client's batch is certified, readable "
                   "or reconstructed")
    p.add_argument("--seed", type=int, default=0, help="the attack's random seed")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda[:i]")
    p.add_argument("--tensorboard", action="store_true", help="also write the audit numbers "
                   "as TensorBoard scalars (needs fl-attack[tensorboard])")
    p.add_argument("--no-reconstructions", action="store_true", help="metrics only: write no "
                   "reconstruction")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fl-attack``; return the exit status (see the module docstring)."""
    args = parser().parse_args(argv)
    try:
        result = _audit(args)
    except (ValueError, ImportError, FileExistsError) as exc:
        print(f"fl-attack: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for record in result.records:
        print(_line(record))
    print(f"verdict: {result.verdict}")
    print(f"report: {result.report}")
    if result.failure is not None:
        print(f"fl-attack: {result.failure}", file=sys.stderr)
        return EXIT_GATE
    return 0


def _audit(args: argparse.Namespace) -> Any:
    """``audit_update`` with the command's options (``ValueError`` naming a bad one)."""
    from fl_attack_flwr.saved_audit import audit_update

    device = None if args.device in ("", "auto") else args.device
    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:i], got {args.device!r}")
    settings = AttackSettings(executor="inline", seed=args.seed, device=device,
                              max_seconds=args.max_seconds)  # ValueError names the field
    return audit_update(args.sent, args.returned, num_examples=args.num_examples,
                        layer=args.layer, update=args.update, model=_model(args.model),
                        input_shape=args.input_shape,
                        input_transform=(None if args.input_transform is None
                                         else tuple(args.input_transform)),
                        out=args.out, run_name=args.run_name, fail_on=args.fail_on,
                        tensorboard=args.tensorboard,
                        reconstructions=not args.no_reconstructions,
                        tokenizer=args.tokenizer, settings=settings)


def _model(spec: str | None) -> Any:
    """The class ``--model MODULE:CLASS`` names (the working directory is importable), or a
    checkpoint folder's path as it is."""
    if not spec:
        return None
    import os

    if os.path.isdir(spec):
        return spec
    from fl_attack_flwr.app.run_config import model_factory

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return model_factory(spec)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers separated by commas: {text!r}") from None


def _shape(text: str) -> tuple[int, int, int]:
    parts = [p for p in text.replace("x", ",").split(",") if p.strip()]
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected C,H,W (three positive integers), got "
                                         f"{text!r}")
    c, h, w = (int(p) for p in parts)
    return c, h, w


def _line(record: Any) -> str:
    """One client's result in a line: status, batch size, λ, seconds, layer, why."""
    parts = [f"{record.client_label}: {record.status}"]
    if record.text is not None:
        parts.append(f"{record.text.get('sentences_read', 0)} sentence(s) read")
        if not record.text.get("sentences_read") and record.text.get("tokens_read"):
            parts.append(f"{record.text['tokens_read']} distinct token(s) read, not their order")
    elif record.batch_size is not None:
        parts.append(f"B = {record.batch_size}")
    if record.sparsity_match is not None:
        parts.append(f"λ = {record.sparsity_match:.4f}")
    if record.attack_seconds is not None:
        parts.append(f"{record.attack_seconds:.1f} s")
    if record.layer:
        parts.append(f"layer {record.layer} {tuple(record.layer_shape or ())}")
    if record.reading:
        parts.append(f"read as {record.reading}")
    why = record.reason or record.error
    return ", ".join(parts) + (f" ({why})" if why else "")


if __name__ == "__main__":
    raise SystemExit(main())
