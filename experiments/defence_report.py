"""The matrix's answer: one row of numbers and one sentence per defence, as Markdown and HTML.

:func:`collect` reads what each row's audit stored (``summary.json`` via ``defence.json``,
``metrics.jsonl``) and reduces it to the columns of the table: can the server read the data
(updates certified, share of the attacked samples reconstructed above 25 dB and above 90 dB),
how many updates the clients' own ``LeakGuard`` refused to send, the privacy the defence claims
(ε), the clients' accuracy at the end, and what a round costs.
:func:`sentence` says the same in plain words; :func:`render_html` puts the table and a plot of
leakage against accuracy (one point per defence) at the top of one self-contained page.
"""

from __future__ import annotations

import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import harness
from experiments.defence_variants import Defence, claimed_epsilon
from fl_attack_flwr import verdicts
from fl_attack_flwr.output import report
from fl_attack_flwr.output.private_files import records_from_jsonl
from fl_attack_flwr.output.report import fmt
from fl_attack_flwr.output.summary import EXACT_DB, READABLE_DB
from fl_attack_flwr.settings import RoundFilter

__all__ = ["collect", "markdown_table", "plot_png", "render_html", "sentence"]

#: Statuses of replies the audit did not attack (nothing to score). A refused reply (the client's
#: LeakGuard withheld its update) carries no update; its samples count as not read (see ``_row``).
_NOT_ATTACKED = (verdicts.SKIPPED, verdicts.NO_UPDATE, verdicts.CORRUPT, verdicts.CLIENT_ERROR,
                 verdicts.REFUSED)


def collect(run_dir: Path, defences: Sequence[Defence], rounds: int) -> list[dict[str, Any]]:
    """One dict of numbers per defence, read from the matrix's run directory."""
    return [_row(run_dir / d.key, d, rounds) for d in defences]


def _row(row_dir: Path, d: Defence, rounds: int) -> dict[str, Any]:
    row: dict[str, Any] = {"key": d.key, "family": d.family, "label": d.label}
    try:
        summary = json.loads((row_dir / "defence.json").read_text())["summary"]
        lines = records_from_jsonl(row_dir / "metrics.jsonl")
    except (OSError, ValueError, KeyError) as exc:
        return {**row, "status": "missing", "error": f"{type(exc).__name__}: {exc}"}
    row["status"], row["error"] = summary.get("status"), summary.get("error")
    config = json.loads((row_dir / "config.json").read_text())
    audited = RoundFilter(str(config["audit-rounds"]))
    attacked = [ln for ln in lines if ln["status"] not in _NOT_ATTACKED]
    psnrs = [p for ln in attacked for p in (ln.get("psnr") or [])]
    replies = [ln for ln in lines if not ln["client"].startswith("aggregate")]
    refused = [ln for ln in replies if ln["status"] == verdicts.REFUSED]
    # A reply withheld in an audited round: the server had its batch to read and got nothing.
    # The plugin's clients train on exactly batch-size samples per round.
    withheld = [ln for ln in refused if int(ln["server_round"]) in audited]
    row.update(
        attacked=len(attacked),
        certified=sum(ln["status"] == verdicts.CERTIFIED for ln in attacked),
        reconstructed=sum(ln["status"] in verdicts.RECONSTRUCTED for ln in attacked),
        protected=sum(ln["status"] == verdicts.PROTECTED for ln in attacked),
        no_answer=sum(ln["status"] in verdicts.ERRORS for ln in attacked),
        statuses=sorted({ln["status"] for ln in attacked}),
        clients=len({ln["client"] for ln in lines if not ln["client"].startswith("aggregate")}),
        samples=sum(int(ln.get("true_batch_size") or ln.get("num_examples") or 0)
                    for ln in attacked) + len(withheld) * int(config["batch-size"]),
        guarded=sum(ln.get("guard") is not None for ln in replies),
        refused=len(refused), withheld=len(withheld),
        readable=sum(p > READABLE_DB for p in psnrs),
        exact=sum(p > EXACT_DB for p in psnrs),
        certified_min_psnr=min((ln["psnr_mean"] for ln in attacked
                                if ln["status"] == verdicts.CERTIFIED
                                and ln.get("psnr_mean") is not None), default=None),
        attack_seconds=sum(float(ln.get("attack_seconds") or 0.0) for ln in attacked),
    )
    eps = [ln.get("epsilon_cumulative") for ln in lines if ln.get("epsilon_cumulative")]
    row["epsilon"] = claimed_epsilon(d, rounds, max(eps) if eps else None)
    evals = summary.get("evaluate_metrics") or {}
    last = max(evals, key=int) if evals else None
    row["accuracy"] = (evals[last].get("eval-acc") if last else None)
    per_round = summary.get("per_round") or {}
    plain = [float(v["train-round-seconds"]) for k, v in per_round.items()
             if "train-round-seconds" in v and int(k) not in audited]
    row["round_seconds"] = sum(plain) / len(plain) if plain else None
    row["row_seconds"] = summary.get("row_seconds")
    row["report"] = summary.get("report")
    return row


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "–"


#: Why a family's numbers look the way they do: facts about where each mechanism acts.
_MECHANISM = {
    "central-dp-server": "the server receives every raw update; the noise comes only after "
                         "aggregation",
    "central-dp-client": "the server receives every clipped update; the noise comes only after "
                         "aggregation",
    "local-dp": "the noise is added on the client, before the server sees the update",
    "dp-sgd": "the noise is added on the client, before the server sees the update",
    "leak-guard": "each client runs the server's exact attack on its own update and withholds one "
                  "it proves readable (the model learns nothing from a withheld update)",
    "secagg": "the server sees only the sum, yet the sum is one batch of every client's samples",
    "secagg+": "SecAgg+ quantizes each client's weighted parameters with stochastic rounding: "
               "the unmasked aggregate carries that rounding noise",
}


def _reading(row: dict[str, Any]) -> str:
    """What the server read, from the row's counts."""
    n, s, k = row["attacked"], row["samples"], row["certified"]
    w = row.get("withheld", 0)
    if w:
        head = (f"the clients' LeakGuard withheld {w} of {n + w} audited updates as provably "
                f"readable, nothing read from them; ")
        if not n:
            return head + f"nothing readable (0 of {s} samples above {READABLE_DB:.0f} dB)"
        if row["readable"]:
            return (head + f"of the {n} sent, {k} certified: {row['readable']} of {s} samples "
                    f"readable (> {READABLE_DB:.0f} dB), {row['exact']} exact "
                    f"(> {EXACT_DB:.0f} dB)")
        return (head + f"the {n} sent left nothing readable (0 of {s} samples above "
                f"{READABLE_DB:.0f} dB)")
    if row["family"] in ("secagg", "secagg+"):
        head = f"the aggregate of {row['clients']} clients ({s} samples): "
        if k:
            return head + "certified exact, every sample of every client readable"
        if row["protected"]:
            return head + "protected, nothing read"
    else:
        head = ""
        if k == n and n:
            return f"every client's batch readable by the server ({n} of {n} certified exact)"
        if row["protected"] == n and n:
            return f"protected: the attack read none of the {n} updates"
    if row["readable"]:
        return (head + f"{row['readable']} of {s} samples readable (> {READABLE_DB:.0f} dB), "
                f"{row['exact']} exact (> {EXACT_DB:.0f} dB), {k} of {n} updates certified")
    return head + f"nothing readable (0 of {s} samples above {READABLE_DB:.0f} dB)"


def sentence(row: dict[str, Any], baseline: float | None) -> str:
    """The row in plain words, built from its numbers."""
    if row.get("status") != "completed":
        return f"{row['label']}: the run did not complete ({row.get('error')})."
    why = f"; {_MECHANISM[row['family']]}" if row["family"] in _MECHANISM else ""
    acc = row.get("accuracy")
    cost = ""
    if acc is not None:
        cost = f"; accuracy {100 * acc:.1f}%"
        if baseline is not None and row["family"] != "none":
            cost += f" ({100 * (acc - baseline):+.1f} points vs no defence)"
    return f"{row['label']}: {_reading(row)}{why}{cost}."


_COLUMNS = ("defence", "updates attacked", "certified", "protected", "refused (all rounds)",
            "samples > 25 dB", "samples > 90 dB", "ε (δ = 1e-5)", "accuracy", "round s",
            "attack s")


def _cells(row: dict[str, Any]) -> list[str]:
    if row.get("status") != "completed":
        return [row["label"], row.get("status") or "–"] + ["–"] * (len(_COLUMNS) - 2)
    s, guarded = row["samples"], row.get("guarded", 0)
    refused = (f"{row['refused']}/{guarded} ({_pct(row['refused'], guarded)})" if guarded
               else "–")
    return [row["label"], str(row["attacked"]), str(row["certified"]), str(row["protected"]),
            refused, f"{row['readable']}/{s} ({_pct(row['readable'], s)})",
            f"{row['exact']}/{s} ({_pct(row['exact'], s)})", row["epsilon"],
            "–" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f}%",
            fmt(row["round_seconds"], 2), fmt(row["attack_seconds"], 2)]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table as Markdown (one line per defence)."""
    cells = ([c.replace("|", "\\|") for c in _cells(r)] for r in rows)
    return "\n".join(harness.markdown_table(_COLUMNS, cells))


def baseline_accuracy(rows: Sequence[dict[str, Any]]) -> float | None:
    """The no-defence row's final accuracy (what the other rows are compared with)."""
    return next((r.get("accuracy") for r in rows if r["family"] == "none"
                 and r.get("status") == "completed"), None)


def plot_png(rows: Sequence[dict[str, Any]]) -> bytes | None:
    """Leakage (% of attacked samples above 25 dB) against final accuracy, one point per
    defence (matplotlib Figure, no pyplot state)."""
    done = [r for r in rows if r.get("status") == "completed" and r.get("accuracy") is not None
            and r.get("samples")]
    if not done:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 5.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    spots: list[tuple[float, float, list[str]]] = []  # rows close together share a label
    for i, r in enumerate(done):
        x, y = 100.0 * r["accuracy"], 100.0 * r["readable"] / r["samples"]
        ax.plot([x], [y], ls="none", ms=8, color=f"C{i % 10}", marker="os^D"[i // 10 % 4])
        near = next((s for s in spots if abs(s[0] - x) < 0.8 and abs(s[1] - y) < 4.0), None)
        if near is None:
            spots.append((x, y, [str(i + 1)]))
        else:
            near[2].append(str(i + 1))
    for x, y, labels in spots:
        ax.annotate(", ".join(labels), (x, y), textcoords="offset points", xytext=(5, 4),
                    fontsize=9)
    base = baseline_accuracy(rows)
    if base is not None:
        ax.axvline(100.0 * base, color="grey", ls="--", lw=1, label="no defence")
        ax.legend(loc="center right", fontsize=9)
    ax.set_xlabel("final accuracy of the clients' evaluation [%]")
    ax.set_ylabel(f"attacked samples readable (> {READABLE_DB:.0f} dB) [%]")
    ax.set_ylim(-5, 105)
    ax.set_title("What each defence leaves readable, and what it costs", fontsize=11)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _link(path: str | None, page_dir: Path) -> str:
    """A link to a row's own audit report, relative to the page (it lives under ``runs/``)."""
    if not path:
        return "–"
    rel = Path(os.path.relpath(path, page_dir)).as_posix()
    return f"<a href='{_esc(rel)}'>{_esc(rel)}</a>"


def render_html(rows: Sequence[dict[str, Any]], header: str, page_dir: Path) -> str:
    """One self-contained page: plain-words verdicts, the table, the plot, then details
    (links to each row's audit report, relative to ``page_dir``, where the page is written)."""
    base = baseline_accuracy(rows)
    done = [r for r in rows if r.get("status") == "completed" and r.get("accuracy") is not None
            and r.get("samples")]
    numbers = {r["key"]: i + 1 for i, r in enumerate(done)}
    png = plot_png(rows)
    items = "".join(f"<li>{_esc(sentence(r, base))}</li>" for r in rows)
    table_rows = [[str(numbers.get(r["key"], "–"))] + [_esc(c) for c in _cells(r)]
                  for r in rows]
    details = [[_esc(r["label"]), _esc(", ".join(r.get("statuses") or [])),
                fmt(r.get("certified_min_psnr"), 1), fmt(r.get("row_seconds"), 1),
                _link(r.get("report"), page_dir)] for r in rows]
    return "\n".join([
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>fl-attack: which defence protects you</title><style>{report.STYLE}</style>"
        "</head><body>",
        "<h1>Which defence protects you?</h1>",
        f"<p>{_esc(header)}</p>",
        f"<ol>{items}</ol>",
        report.html_table(["#", *_COLUMNS], table_rows, left=(1, 8)),
        report.inline_png(png, "leakage against accuracy") if png else "<p>No point to plot.</p>",
        "<h2>How to read this</h2><dl>"
        "<dt>updates attacked</dt><dd>Client updates the server inverted (under secure "
        "aggregation: the round's aggregate, one batch of every client's samples).</dd>"
        "<dt>certified</dt><dd>Reconstructions the attack proves exact from the update alone "
        "(λ = 1, every direction, no noise).</dd>"
        "<dt>refused (all rounds)</dt><dd>Replies in which the client's own LeakGuard "
        "(policy refuse) proved its update readable and withheld it, of all replies its guard "
        "checked, over every round; – where the clients run no guard. A withheld update of an "
        "attacked round counts as its batch's samples, none read.</dd>"
        f"<dt>samples &gt; {READABLE_DB:.0f} / {EXACT_DB:.0f} dB</dt><dd>Of all samples in the "
        "attacked updates, those the server reconstructed recognisably / exactly (PSNR "
        "against the client's true samples; a protected update counts as nothing read).</dd>"
        "<dt>ε</dt><dd>The privacy the defence claims at δ = 1e-5.</dd>"
        "<dt>accuracy</dt><dd>The clients' evaluation of the final global model.</dd>"
        "<dt>round s</dt><dd>Mean wall time of the rounds the audit did not attack: what the "
        "defence itself costs a round.</dd></dl>",
        "<h2>Details</h2>",
        report.html_table(["defence", "statuses", "lowest PSNR of a certified update [dB]",
                       "row wall s", "the row's full audit report"], details, left=(0, 1, 4)),
        "</body></html>"])
