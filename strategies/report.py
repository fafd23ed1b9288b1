"""The audit's answer: summary statistics, the verdict in plain words, and the HTML report.

:func:`summarize` reduces a run's records to the numbers of ``summary.json``; :func:`verdict`
turns them into the sentence an auditor reads first ("the server reconstructed 6 of 6 client
batches exactly ..."); :func:`render_report` writes one self-contained HTML page (pictures inline
as data URIs) that explains how to read itself.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.pictures import image_grid, png_bytes
from fl_attack_flwr.private_files import jsonable
from fl_attack_flwr.records import ClientAudit

__all__ = ["EXACT_DB", "READABLE_DB", "STYLE", "accountant_notes", "config_notes", "figure_png",
           "fmt", "html_table", "inline_png", "render_report", "strategy_notes", "summarize",
           "verdict"]

EXACT_DB = 90.0
"""PSNR above which a reconstruction is exact to float precision (the papers' threshold)."""
READABLE_DB = 25.0
"""PSNR above which a reconstructed image is recognisable (the SPEAR papers' DP threshold)."""

STYLE = (  # the reports' stylesheet (also used by the defence matrix's page)
    "body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:right;vertical-align:top}th{background:#eee}td.l,th.l{text-align:left}"
    "img{image-rendering:pixelated;max-width:100%}.pair{display:flex;gap:1.5em;"
    "align-items:flex-start}.pair div{text-align:center}.err{color:#b00}"
    ".warn{background:#fff3cd;padding:.6em;border:1px solid #e0c060}"
    ".verdict{padding:1em 1.2em;border-radius:6px;font-size:1.15em;margin:1em 0}"
    ".leak{background:#fde2e1;border:2px solid #c0392b}.some{background:#fff3cd;"
    "border:2px solid #d4a017}.safe{background:#e3f6e8;border:2px solid #2e8b57}"
    ".none{background:#eee;border:2px solid #999}.st{font-weight:bold}"
    ".facts{font-size:.8em;margin-top:.4em;color:#444}"
    "dt{font-weight:bold;margin-top:.5em}dd{margin-left:1.5em}"
)


def summarize(records: Sequence[ClientAudit], rounds: Mapping[int, Mapping[str, Any]],
              config: Mapping[str, Any], *, run_name: str, run_dir: Path | str,
              wall_seconds: float) -> dict[str, Any]:
    """Totals over a run (JSON-safe), with the verdict.

    ``psnr_mean`` is ``None`` without ground truth; ``epsilon`` is the largest cumulative ε any
    client reported (``None`` without DP).
    """
    count = {s: sum(1 for r in records if r.status == s) for s in verdicts.STATUSES}
    rec = [r for r in records if r.reconstructed]
    psnrs = [r.psnr_mean for r in rec if r.psnr_mean is not None and math.isfinite(r.psnr_mean)]
    lams = [r.sparsity_match for r in rec if r.sparsity_match is not None]
    eps = [r.epsilon_cumulative if r.epsilon_cumulative is not None else r.epsilon
           for r in records]
    eps = [e for e in eps if e is not None]
    deltas = [r.delta for r in records if r.delta is not None]
    summary: dict[str, Any] = {
        "run_name": run_name, "run_dir": str(run_dir),
        "rounds": len({r.server_round for r in records} | set(rounds)),
        "clients": len({r.client_label for r in records}),
        "replies": len(records),
        "attacked": len(rec) + count[verdicts.PROTECTED] + sum(count[s] for s in verdicts.ERRORS),
        "reconstructions": len(rec),
        "certified": count[verdicts.CERTIFIED],
        "not_certified": count[verdicts.NOT_CERTIFIED],
        "partial": count[verdicts.PARTIAL],
        "protected": count[verdicts.PROTECTED],
        "refused": count[verdicts.REFUSED],
        "guarded": sum(1 for r in records if r.guard is not None),
        "skipped": count[verdicts.SKIPPED],
        "attack_failures": sum(count[s] for s in verdicts.ERRORS),
        "corrupt_replies": count[verdicts.CORRUPT],
        "client_errors": count[verdicts.CLIENT_ERROR],
        "no_update": count[verdicts.NO_UPDATE],
        "statuses": {s: n for s, n in count.items() if n},
        "readable": sum(1 for p in psnrs if p > READABLE_DB),
        "certified_or_readable": sum(1 for r in rec if r.status == verdicts.CERTIFIED or (
            r.psnr_mean is not None and r.psnr_mean > READABLE_DB)),
        "exact_by_psnr": sum(1 for p in psnrs if p > EXACT_DB),
        "scored": len(psnrs),
        "psnr_mean": float(np.mean(psnrs)) if psnrs else None,
        "psnr_min": float(np.min(psnrs)) if psnrs else None,
        "lambda_mean": float(np.mean(lams)) if lams else None,
        "attack_seconds_total": float(sum(r.attack_seconds or 0.0 for r in records)),
        "epsilon": max(eps) if eps else None,
        "delta": max(deltas) if deltas else None,
        "protocol": config.get("protocol"),
        "dataset": config.get("dataset"),
        "wall_seconds": wall_seconds,
        "per_round": {str(k): dict(v) for k, v in sorted(rounds.items())},
        "report": str(Path(run_dir) / "report.html"),
    }
    summary["verdict"], summary["verdict_level"] = verdict(summary)
    summary["notes"] = config_notes(config)
    return jsonable(summary)


def strategy_notes(strategy: object) -> list[str]:
    """Warnings about the audited strategy itself (Flower's central DP wrappers)."""
    name = type(strategy).__name__
    if not name.startswith("DifferentialPrivacy"):
        return []
    return [f"Central DP ({name}) clips and noises the aggregate only: the server still "
            "receives every client's update, and this audit attacked those. Only noise added "
            "on the client (LocalDpMod, DP-SGD) reaches what the server sees."]


def accountant_notes(strategy: object) -> list[str]:
    """The ε a wrapped Flower central-DP strategy reports from its own accountant (its
    ``privacy_spent()``, given ``accountant=``), naming the accountant."""
    spent_of = getattr(strategy, "privacy_spent", None)
    spent = spent_of() if callable(spent_of) else None
    if spent is None:
        return []
    return [f"{type(strategy).__name__} reports ε = {spent.epsilon:.3g} at δ = {spent.delta:g} "
            f"after {spent.num_releases} release(s) (Flower's accountant, "
            f"{spent.accounting_method.upper()}): a client-level guarantee for the noised "
            "aggregate, not for the individual updates this audit read."]


def config_notes(config: Mapping[str, Any]) -> list[str]:
    """Warnings an auditor needs about the configuration itself."""
    notes = []
    if config.get("protocol") == "dpsgd" and not config.get("noise-multiplier"):
        notes.append("DP-SGD with noise multiplier 0 is clipping only: ε = ∞, no privacy "
                     "guarantee (set noise-multiplier > 0).")
    return notes


def verdict(s: Mapping[str, Any]) -> tuple[str, str]:
    """``(sentence, level)`` answering "can the server read the clients' data?".

    ``level`` is ``"leak"`` (some batch certified or readable), ``"some"`` (reconstructions
    without certificate or ground truth), ``"safe"`` (every attacked update protected) or
    ``"none"`` (nothing was attacked to the end).
    """
    attacked, cert, prot = s["attacked"], s["certified"], s["protected"]
    answered = s["reconstructions"] + prot
    parts: list[str] = []
    refused = s.get("refused", 0)
    if refused:
        parts.append(f"{refused} client{' refused' if refused == 1 else 's refused'} to send a "
                     "readable update: the client's own LeakGuard proved it readable and "
                     "withheld it.")
    if attacked == 0:
        if refused:
            return " ".join(parts) + " No other update was attacked.", "safe"
        return ("No update was attacked: there is no answer in this run "
                f"({_status_list(s)}).", "none")
    if cert:
        which = "that batch" if cert == 1 else "those batches"
        parts.append(f"The server reconstructed {cert} of {attacked} client batches exactly "
                     f"(certified): every sample of {which} is readable.")
    uncert = s["not_certified"] + s["partial"]
    if uncert:
        if s["scored"]:
            parts.append(f"{uncert} more {'was' if uncert == 1 else 'were'} reconstructed "
                         f"without a certificate; {s['readable']} of the {s['scored']} scored "
                         f"reconstructions are recognisable (PSNR > {READABLE_DB:.0f} dB).")
        else:
            parts.append(f"{uncert} more {'was' if uncert == 1 else 'were'} reconstructed "
                         "without a certificate (no ground truth to say how close).")
    if prot:
        parts.append(f"{prot} of {attacked} {'update was' if prot == 1 else 'updates were'} "
                     "protected: the attack could not read the batch.")
    if s["attack_failures"]:
        parts.append(f"{s['attack_failures']} attack(s) gave no answer ({_status_list(s)}).")
    leaked = cert or (s["readable"] if s["scored"] else 0)
    if leaked:
        level = "leak"
    elif answered and prot == answered:
        level = "safe"
        parts.insert(0, "Protected: the server could not read any attacked client's batch.")
    elif answered:
        level = "some"
    else:
        level = "none"
    return " ".join(parts), level


def _status_list(s: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {k}" for k, n in s["statuses"].items()) or "no replies"


# --------------------------------------------------------------------------- HTML


def _esc(v: Any) -> str:
    return html.escape(str(v))


def fmt(v: Any, digits: int = 2) -> str:
    """A table cell: ``–`` for missing, yes/no, fixed digits, δ-like values in sci notation."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "∞" if v > 0 else "−∞"
        if v != 0 and abs(v) < 10 ** (-digits):
            return f"{v:.1e}"
        return f"{v:.{digits}f}"
    return _esc(v)


def inline_png(png: bytes, alt: str) -> str:
    """An ``<img>`` whose PNG is inline (a data URI): the page stays self-contained."""
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]],
               left: Sequence[int] = ()) -> str:
    """An HTML table of already-escaped cells; columns in ``left`` are left-aligned."""
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td class='l'>{c}</td>" if i in left else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>")
    return "".join(out) + "</table>"


def _reports_dp(records: Sequence[ClientAudit]) -> bool:
    """Whether any client reported differential privacy (the report then shows and explains
    ε and δ)."""
    return any(r.epsilon is not None for r in records)


def _explanations(records: Sequence[ClientAudit]) -> str:
    present = {r.status for r in records}
    legend = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in verdicts.MEANINGS.items()
                     if k in present)
    others = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in verdicts.MEANINGS.items()
                     if k not in present and k != verdicts.PENDING)
    dp = ("<dt>ε, δ</dt><dd>The differential privacy a DP-SGD client reported (Opacus' RDP "
          "accountant): smaller ε is stronger privacy; ε = ∞ means no noise.</dd>"
          if _reports_dp(records) else "")
    return (
        "<h2>How to read this report</h2><dl>"
        "<dt>The attack</dt><dd>The server inverts each client's update of one linear layer "
        "followed by a ReLU (SPEAR / SPEAR++, exact gradient inversion): it recovers the inputs "
        "that layer saw during the client's training step, that is, the client's data.</dd>"
        "<dt>λ (sparsity match)</dt><dd>The share of the layer's units whose activation "
        "pattern, recomputed from the reconstruction, matches the zeros of the client's update. "
        "The server computes it without any ground truth.</dd>"
        "<dt>Certified exact</dt><dd>λ = 1 with every direction of the batch found and no noise "
        "on the update: the reconstruction is then exact, proven from the update alone.</dd>"
        f"<dt>PSNR</dt><dd>Similarity to the client's true samples (audit mode only): above "
        f"{EXACT_DB:.0f} dB the reconstruction is exact to float precision; above "
        f"{READABLE_DB:.0f} dB an image is recognisable; below about 15 dB it is noise.</dd>"
        f"{dp}{legend}</dl><details><summary>Other statuses</summary><dl>{others}</dl></details>"
    )


def render_report(summary: Mapping[str, Any], records: Sequence[ClientAudit],
                  rounds: Mapping[int, Mapping[str, Any]], config: Mapping[str, Any]) -> str:
    """One self-contained HTML page for a run (pictures inline as base64 data URIs)."""
    title = _esc(summary.get("run_name"))
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>fl-attack audit {title}</title><style>{STYLE}</style></head><body>",
        f"<h1>Privacy audit: {title}</h1>",
        _privacy_banner(str(summary.get("reconstructions_kept") or "all")),
        f"<div class='verdict {summary.get('verdict_level')}' id='verdict'>"
        f"{_esc(summary.get('verdict'))}<div class='facts'>{_esc(_facts(summary))}</div></div>",
        "".join(f"<p class='warn'>{_esc(n)}</p>" for n in summary.get("notes") or []),
        _summary_table(summary, records),
        _explanations(records),
        _rounds_section(rounds, records),
        _clients_section(records),
        _reconstructions_section(records, str(summary.get("reconstructions_kept") or "all")),
        "<h2>Configuration</h2>",
        html_table(["setting", "value"], [[_esc(k), fmt(v)] for k, v in sorted(config.items())],
               left=(0, 1)) if config else "<p>No run configuration was given.</p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _privacy_banner(kept: str) -> str:
    if kept.startswith("none"):
        return ("<p class='warn'>Metrics-only run: this report holds no reconstruction of the "
                "clients' data, only what the audit found about it. It is still written with "
                "owner-only permissions.</p>")
    return ("<p class='warn'>This report contains reconstructions of clients' private training "
            "data. Keep it private (it is written with owner-only permissions).</p>")


def _facts(s: Mapping[str, Any]) -> str:
    """The run in one line under the verdict."""
    parts = [f"{s.get('clients')} clients, {s.get('rounds')} round(s)"]
    if s.get("protocol"):
        parts.append(f"protocol {s['protocol']}")
    if s.get("psnr_mean") is not None:
        parts.append(f"mean PSNR {s['psnr_mean']:.1f} dB against the true samples")
    if s.get("epsilon") is not None:
        eps = s["epsilon"]
        parts.append("DP ε = ∞" if eps == "inf" else f"DP ε = {float(eps):.3g}")
    return "; ".join(parts) + "."


def _summary_table(s: Mapping[str, Any], records: Sequence[ClientAudit]) -> str:
    gt = s.get("scored")
    rows = [
        ("protocol", s.get("protocol")), ("dataset", s.get("dataset")),
        ("rounds", s.get("rounds")), ("clients", s.get("clients")),
        ("replies", s.get("replies")), ("attacked", s.get("attacked")),
        ("certified exact (λ = 1)", s.get("certified")),
        ("reconstructed without certificate", (s.get("not_certified") or 0)
         + (s.get("partial") or 0)),
        ("protected", s.get("protected")), ("mean λ", s.get("lambda_mean")),
        ("mean PSNR [dB]", s.get("psnr_mean") if gt else
         "no ground truth: the clients did not report their samples"),
        (f"recognisable (PSNR > {READABLE_DB:.0f} dB)", s.get("readable") if gt else None),
        ("no answer (attack failures)", s.get("attack_failures")),
        ("corrupt replies", s.get("corrupt_replies")), ("client errors", s.get("client_errors")),
        ("attack seconds (total)", s.get("attack_seconds_total")),
    ]
    if _reports_dp(records):
        rows += [("DP ε (largest, cumulative)", s.get("epsilon")), ("DP δ", s.get("delta"))]
    layers = sorted({f"{r.layer} {tuple(r.layer_shape or ())}" for r in records if r.layer})
    if layers:
        rows.append(("attacked layer (m, n)", ", ".join(layers)))
    return "<h2>Summary</h2>" + html_table(["", "value"], [[_esc(k), fmt(v)] for k, v in rows],
                                       left=(0,))


def _rounds_section(rounds: Mapping[int, Mapping[str, Any]],
                    records: Sequence[ClientAudit]) -> str:
    cols = [("audit-replies", "replies", 0), ("audit-certified", "certified", 0),
            ("audit-reconstructions", "reconstructed", 0), ("audit-protected", "protected", 0),
            ("audit-lambda-mean", "mean λ", 4), ("audit-psnr-mean", "mean PSNR [dB]", 1),
            ("audit-attack-seconds", "attack s", 1), ("train-round-seconds", "round s", 1)]
    if not rounds:
        return ""
    rows = [[str(rnd)] + [fmt(info.get(k), d) if d else fmt(info.get(k)) for k, _, d in cols]
            for rnd, info in sorted(rounds.items())]
    out = "<h2>Per round</h2>" + html_table(["round"] + [t for _, t, _ in cols], rows)
    png = figure_png(records)
    return out + (inline_png(png, "per-round metrics") if png else "")


def _clients_section(records: Sequence[ClientAudit]) -> str:
    dp = _reports_dp(records)
    guarded = any(r.guard is not None for r in records)
    header = ["round", "client", "status", "why", "read as", "B", "λ", "PSNR [dB]", "attack s"]
    header += ["ε (round)", "ε (cumul.)", "δ"] if dp else []
    header += ["client's LeakGuard"] if guarded else []
    rows = []
    for r in sorted(records, key=lambda r: (r.server_round, r.client_label)):
        why = r.reason or r.error or ""
        row = [fmt(r.server_round), _esc(r.client_label), f"<span class='st'>{_esc(r.status)}"
               "</span>", f"<span class='{'err' if r.error else ''}'>{_esc(why)}</span>",
               fmt(r.reading), fmt(r.batch_size), fmt(r.sparsity_match, 4), fmt(r.psnr_mean, 1),
               fmt(r.attack_seconds, 1)]
        if dp:
            row += [fmt(r.epsilon), fmt(r.epsilon_cumulative), fmt(r.delta)]
        if guarded:
            row.append(_esc(_guard_words(r.guard)))
        rows.append(row)
    left = (1, 2, 3, 4, len(header) - 1) if guarded else (1, 2, 3, 4)
    return "<h2>Clients</h2>" + html_table(header, rows, left=left)


def _guard_words(guard: Mapping[str, Any] | None) -> str:
    """A client's own LeakGuard finding in a few words (table cell)."""
    if guard is None:
        return "–"
    words = [str(guard["status"])]
    if guard.get("readable_samples"):
        words.append(f"{guard['readable_samples']} sample(s) provably readable")
    words.append("refused" if guard.get("refused") else
                 "local DP applied, sent" if guard.get("escalated") else "sent")
    return f"{', '.join(words)} ({fmt(guard.get('seconds'), 1)} s)"


def _reconstructions_section(records: Sequence[ClientAudit], kept: str = "all") -> str:
    shown = [r for r in sorted(records, key=lambda r: (r.server_round, r.client_label))
             if r.recon_images is not None or (r.inputs is not None and r.reconstructed)]
    policy = ("" if kept == "all" else
              f"<p>Reconstructions kept by this run: {_esc(kept)}. The clients' verdicts and "
              "scores above cover every audited update.</p>")
    if not shown:
        return ("<h2>Reconstructions</h2>" + (policy or "<p>No update was reconstructed, so "
                                               "there is nothing to show.</p>"))
    out = ["<h2>Reconstructions</h2>", policy]
    if any(r.original_images is not None for r in shown):
        out.append("<p>Left: what the server reconstructed from the client's update alone. "
                   "Right: the client's true batch (audit ground truth), in the same order.</p>")
    for r in shown:
        stats = [f"B = {r.batch_size}", f"λ = {fmt(r.sparsity_match, 4)}", r.status]
        if r.psnr_mean is not None:
            stats.append(f"PSNR = {fmt(r.psnr_mean, 1)} dB")
        out.append(f"<h3>Round {r.server_round}, {_esc(r.client_label)}</h3>"
                   f"<p>{_esc(', '.join(stats))}</p>")
        if r.inputs_are:
            out.append(f"<p><i>{_esc(r.inputs_are)}</i></p>")
        if r.recon_images is None:
            out.append(_rows_table(np.asarray(r.inputs)))
            continue
        out.append("<div class='pair'><div>" + inline_png(png_bytes(image_grid(r.recon_images)),
                                                     "reconstruction") + "<br>reconstruction</div>")
        if r.original_images is not None:
            out.append("<div>" + inline_png(png_bytes(image_grid(r.original_images)), "original")
                       + "<br>original</div>")
        out.append("</div>")
    return "".join(out)


def _rows_table(x: np.ndarray, max_rows: int = 8, max_cols: int = 12) -> str:
    """The first reconstructed rows of non-image inputs, as a table."""
    rows = [[fmt(float(v), 3) for v in row[:max_cols]] for row in x[:max_rows]]
    rows_shown, cols_shown = min(max_rows, x.shape[0]), min(max_cols, x.shape[1])
    more = (f"<p>Showing {rows_shown} of {x.shape[0]} rows, {cols_shown} of {x.shape[1]} "
            "input values.</p>")
    return html_table([f"x{j}" for j in range(min(max_cols, x.shape[1]))], rows) + more


def figure_png(records: Sequence[ClientAudit]) -> bytes | None:
    """Per-round PSNR (with ground truth), λ and attack seconds: clients as dots, the mean as a
    line (matplotlib Figure, no pyplot state)."""
    done = [r for r in records if r.reconstructed]
    if not done:
        return None
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("sparsity_match", "mean λ (1 = certified)"),
              ("attack_seconds", "attack seconds per client")]
    if any(r.psnr_mean is not None for r in done):
        panels.insert(0, ("psnr_mean", "mean PSNR [dB]"))
    rounds = sorted({r.server_round for r in done})
    fig = Figure(figsize=(4.0 * len(panels), 3.0), dpi=100)
    FigureCanvasAgg(fig)
    for i, (attr, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        values = {rd: [getattr(r, attr) for r in done if r.server_round == rd
                       and getattr(r, attr) is not None and math.isfinite(getattr(r, attr))]
                  for rd in rounds}
        for rd, vs in values.items():
            ax.plot([rd] * len(vs), vs, "o", color="tab:blue", alpha=0.4, ms=4)
        ax.plot(rounds, [float(np.mean(v)) if v else float("nan") for v in values.values()],
                "-", color="tab:red", lw=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("round")
        ax.set_xticks(rounds)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
