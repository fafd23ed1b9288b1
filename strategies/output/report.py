"""The audit's HTML report: one self-contained page (pictures inline as data URIs) that opens
with the verdict (:mod:`fl_attack_flwr.output.summary`) and explains how to read itself."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.output.png import image_grid, png_bytes
from fl_attack_flwr.output.progress import progress_png
from fl_attack_flwr.output.summary import EXACT_DB, READABLE_DB
from fl_attack_flwr.output.text_report import (
    TEXT_MEANINGS,
    TEXT_WORDS,
    is_text_run,
    text_clients_table,
    text_section,
    text_summary_rows,
)
from fl_attack_flwr.results.records import ClientAudit

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
    "mark{background:#f5b7b1}table.text td{font-family:monospace;white-space:pre-wrap}"
)


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
    meanings = {**verdicts.MEANINGS, **(TEXT_MEANINGS if is_text_run(records) else {})}
    legend = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in meanings.items()
                     if k in present)
    others = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in meanings.items()
                     if k not in present and k != verdicts.PENDING)
    dp = ("<dt>ε, δ</dt><dd>The differential privacy a DP-SGD client reported (Opacus' RDP "
          "accountant): smaller ε is stronger privacy; ε = ∞ means no noise.</dd>"
          if _reports_dp(records) else "")
    if is_text_run(records):
        return (f"<h2>How to read this report</h2><dl>{TEXT_WORDS}{legend}</dl><details>"
                f"<summary>Other statuses</summary><dl>{others}</dl></details>")
    return (
        "<h2>How to read this report</h2><dl>"
        "<dt>The attack</dt><dd>The server inverts each client's update of one linear layer "
        "followed by a ReLU (SPEAR / SPEAR++, exact gradient inversion): it recovers the inputs "
        "that layer saw during the client's training step, that is, the client's data.</dd>"
        "<dt>λ (sparsity match)</dt><dd>The share of the layer's units whose activation "
        "pattern, recomputed from the reconstruction, matches the zeros of the client's update. "
        "The server computes it without any ground truth.</dd>"
        "<dt>Certified exact</dt><dd>λ = 1 with every direction of the batch found, no noise "
        "on the update, one gradient step, and every sample pinned down by its own zero "
        "entries: the units it leaves inactive single out its column (SPEAR's Theorem 3.3, "
        "checked on the reconstruction). The reconstruction is then exact, proven from the "
        "update alone. λ = 1 by itself is not enough: two samples whose active units nest "
        "(near-duplicates, such as two overlapping crops of one photo) can be mixed without "
        "changing λ; such samples are named as read only up to a mixture of each other, unless "
        "the next layer's update tells them apart.</dd>"
        f"<dt>PSNR, SSIM</dt><dd>Similarity to the client's true samples (audit mode only): "
        f"above {EXACT_DB:.0f} dB the reconstruction is exact to float precision; above "
        f"{READABLE_DB:.0f} dB an image is recognisable (readable); below about 15 dB it is "
        "noise. SSIM (structural similarity, 1 = identical) is given beside it.</dd>"
        f"{_features_words(records)}"
        f"{dp}{legend}</dl><details><summary>Other statuses</summary><dl>{others}</dl></details>"
    )


def _features_words(records: Sequence[ClientAudit]) -> str:
    """Definitions for runs whose attacked layer is not the model's first."""
    if not any(r.reads == "features" for r in records):
        return ""
    return (
        "<dt>Features</dt><dd>Where the attacked layer is not the model's first (a CNN's first "
        "linear layer), the attack recovers that layer's inputs: the features the model "
        "computes from each sample, not the sample. Certified features are exact, proven "
        "from the update alone. Exact features tell an attacker what the model makes of each "
        "sample (its class, the attributes the features encode) and let it match them "
        "against candidate images or train an inversion on similar data, even where the "
        "pictures below stay blurry.</dd>"
        "<dt>Pictures from features</dt><dd>Estimated by feature inversion through the "
        "model's earlier layers (the server sent their weights; each sample's gradient into "
        "them is known from the exact features): an approximation, never certified. With "
        f"ground truth they are scored (readable above {READABLE_DB:.0f} dB PSNR); without "
        "it, the feature residual says how well the pictures' own features match the "
        "recovered ones (0% is a perfect fit, not a perfect picture).</dd>")


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
        _summary_table(summary, records, config),
        _explanations(records),
        _training_section(summary, records, config),
        _rounds_section(summary, rounds, records),
        _clients_section(records),
        _reconstructions_section(records, str(summary.get("reconstructions_kept") or "all")),
        text_section(records, str(summary.get("reconstructions_kept") or "all")),
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
    scored = [r for r in s.get("by_round") or [] if r["accuracy"] is not None]
    if scored:
        parts.append(f"model accuracy {100 * scored[-1]['accuracy']:.0f}% after round "
                     f"{scored[-1]['round']}")
    return "; ".join(parts) + "."


def _summary_table(s: Mapping[str, Any], records: Sequence[ClientAudit],
                   config: Mapping[str, Any]) -> str:
    if is_text_run(records):
        rows = text_summary_rows(dict(s), dict(config))
        return "<h2>Summary</h2>" + html_table(
            ["", "value"], [[_esc(k), fmt(v)] for k, v in rows if v is not None], left=(0,))
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
        (f"batches with a recognisable sample (PSNR > {READABLE_DB:.0f} dB)",
         s.get("readable") if gt else None),
        (f"samples recognisable (PSNR > {READABLE_DB:.0f} dB)",
         f"{s.get('samples_readable')} of {s.get('samples_scored')}"
         if gt and s.get("samples_scored") else None),
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


def _training_section(s: Mapping[str, Any], records: Sequence[ClientAudit],
                      config: Mapping[str, Any]) -> str:
    """How leakage changed as the model trained: the sentence, the plot, where the accuracy
    comes from (only for runs with an accuracy or two audited rounds)."""
    rows = s.get("by_round") or []
    sentence = s.get("leakage_trend")
    png = progress_png(rows)
    if sentence is None and not any(r["accuracy"] is not None for r in rows):
        return ""
    source = next((r["accuracy_from"] for r in rows if r["accuracy_from"]), None)
    if source == "server":
        acc = "evaluated by the server (its evaluate_fn)"
    elif config.get("eval-held-out") is True:
        acc = (f"evaluated by the clients on {fmt(config.get('eval-size'))} samples each that "
               "they never train on")
    elif "eval-held-out" in config:
        acc = ("evaluated by the clients on samples of their own shards, which they may also "
               "train on (eval-held-out = false)")
    else:
        acc = "evaluated by the clients (Flower's evaluate round, weighted by their examples)"
    if is_text_run(records):
        return ("<h2>Leakage as the model trains</h2>"
                + (f"<p id='trend'><b>{_esc(sentence)}</b></p>" if sentence else "")
                + (inline_png(png, "leakage per round") if png else "")
                + "<p>Leakage per round: of the sentences in the client updates the attack "
                  "answered, those in a batch certified exact, and the share of those updates "
                  "certified.</p>")
    words = ("<p>Leakage per round: of the samples in the client updates the attack answered, "
             f"those the server read (recognisable, PSNR &gt; {READABLE_DB:.0f} dB, or in a "
             "batch certified exact), and the share of those updates certified exact. "
             f"Accuracy: the global model after the round, {_esc(acc)}.</p>")
    if any(r.reading == "fedavg" for r in records if r.reconstructed):
        words += ("<p>An update read as a sum over local steps (FedAvg) is never certified: "
                  "only the PSNR against the true samples (audit mode) says what was read of "
                  "it.</p>")
    return ("<h2>Leakage as the model trains</h2>"
            + (f"<p id='trend'><b>{_esc(sentence)}</b></p>" if sentence else "")
            + (inline_png(png, "leakage and accuracy per round") if png else "") + words)


def _rounds_section(s: Mapping[str, Any], rounds: Mapping[int, Mapping[str, Any]],
                    records: Sequence[ClientAudit]) -> str:
    cols = [("audit-replies", "replies", 0), ("audit-certified", "certified", 0),
            ("audit-reconstructions", "reconstructed", 0), ("audit-protected", "protected", 0),
            ("audit-lambda-mean", "mean λ", 4), ("audit-psnr-mean", "mean PSNR [dB]", 1),
            ("audit-attack-seconds", "attack s", 1), ("train-round-seconds", "round s", 1)]
    if not rounds:
        return ""
    text = is_text_run(records)
    if text:  # no λ or PSNR for sentences
        cols = [c for c in cols if c[0] not in ("audit-lambda-mean", "audit-psnr-mean")]
    leak = {r["round"]: r for r in s.get("by_round") or []}
    learning = any(r["accuracy"] is not None for r in leak.values())
    rows = []
    for rnd, info in sorted(rounds.items()):
        r = leak.get(rnd) or {"accuracy": None, "attacked": 0}
        read = f"{r['read']} of {r['samples']}" if r["attacked"] else "–"
        rows.append([str(rnd)] + ([_pct(r["accuracy"])] if learning else []) + [read]
                    + [fmt(info.get(k), d) if d else fmt(info.get(k)) for k, _, d in cols])
    header = ["round"] + (["accuracy"] if learning else []) + [
        "sentences read" if text else "samples read"]
    out = "<h2>Per round</h2>" + html_table(header + [t for _, t, _ in cols], rows)
    if text:
        return out
    png = figure_png(records)
    return out + (inline_png(png, "per-round metrics") if png else "")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _clients_section(records: Sequence[ClientAudit]) -> str:
    if is_text_run(records):
        header, rows = text_clients_table(records)
        return "<h2>Clients</h2>" + html_table(header, rows, left=(1, 2, 3))
    dp = _reports_dp(records)
    guarded = any(r.guard is not None for r in records)
    features = any(r.reads == "features" for r in records)
    header = ["round", "client", "status", "why", "read as", "B", "λ", "PSNR [dB]", "SSIM",
              "attack s"]
    header += ["what was read"] if features else []
    header += ["ε (round)", "ε (cumul.)", "δ"] if dp else []
    header += ["client's LeakGuard"] if guarded else []
    rows = []
    for r in sorted(records, key=lambda r: (r.server_round, r.client_label)):
        why = r.reason or r.error or ""
        row = [fmt(r.server_round), _esc(r.client_label), f"<span class='st'>{_esc(r.status)}"
               "</span>", f"<span class='{'err' if r.error else ''}'>{_esc(why)}</span>",
               fmt(r.reading), fmt(r.batch_size), fmt(r.sparsity_match, 4), fmt(r.psnr_mean, 1),
               fmt(r.ssim_mean, 3), fmt(r.attack_seconds, 1)]
        if features:
            row.append(_esc(_what_was_read(r)))
        if dp:
            row += [fmt(r.epsilon), fmt(r.epsilon_cumulative), fmt(r.delta)]
        if guarded:
            row.append(_esc(_guard_words(r.guard)))
        rows.append(row)
    left = (1, 2, 3, 4, len(header) - 1) if guarded else (1, 2, 3, 4)
    return "<h2>Clients</h2>" + html_table(header, rows, left=left)


def _layer(r: ClientAudit) -> str:
    return str(r.layer).removesuffix(".weight")


def _what_was_read(r: ClientAudit) -> str:
    """Features (certified or not) and the pictures estimated from them, in a few words."""
    if r.reads != "features" or not r.reconstructed:
        return "–" if r.reads != "features" else f"{_layer(r)} input features"
    words = [f"{_layer(r)} input features" + (" (exact)" if r.status == "certified" else "")]
    px = r.pixels or {}
    if px.get("error"):
        words.append(f"no pictures ({px['error']})")
    elif px:
        words.append("pictures estimated (PSNR/SSIM are theirs)" if r.psnr_mean is not None
                     else f"pictures estimated, feature residual "
                          f"{100 * (px.get('feature_residual_mean') or 0):.1f}%")
    return "; ".join(words)


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
    if not shown and any(r.reads == "text" for r in records):
        return ""  # a language model's sentences: text_section
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
        out.append(f"<h3>Round {r.server_round}, {_esc(r.client_label)}</h3>"
                   f"<p>{_esc(', '.join(_stats(r)))}</p>")
        if r.inputs_are:
            out.append(f"<p><i>{_esc(r.inputs_are)}</i></p>")
        if r.recon_images is None:
            out.append(_rows_table(np.asarray(r.inputs)))
            continue
        what = "pictures estimated from the features" if r.reads == "features" else \
            "reconstruction"
        marked = r.verified_pictures()
        if marked is not None and not r.exact:
            out.append(f"<p>Framed in green: the {int(marked.sum())} of {marked.size} samples "
                       "verified on their own through the next layer, exact to the update's "
                       "precision whatever the rest of the batch.</p>")
        else:
            marked = None
        flagged = None if r.exact else r.unproven_pictures()
        if flagged is not None:
            out.append(f"<p>Framed in orange: the {int(flagged.sum())} of {flagged.size} "
                       "samples the reason names as keeping the batch unproven (the others "
                       "pass every per-sample condition of the certificate).</p>")
        grid = image_grid(r.recon_images, marked=marked, flagged=flagged)
        out.append("<div class='pair'><div>" + inline_png(png_bytes(grid), "reconstruction")
                   + f"<br>{what}</div>")
        if r.original_images is not None:
            out.append("<div>" + inline_png(png_bytes(image_grid(r.original_images)), "original")
                       + "<br>original</div>")
        out.append("</div>")
    return "".join(out)


def _stats(r: ClientAudit) -> list[str]:
    """The facts printed over one client's pictures."""
    if r.reads == "features":
        stats = [f"B = {r.batch_size}", f"λ = {fmt(r.sparsity_match, 4)}",
                 f"{_layer(r)} input features {r.status}"]
        px = r.pixels or {}
        if r.psnr_mean is not None:
            stats.append(f"pictures: PSNR = {fmt(r.psnr_mean, 1)} dB, SSIM = "
                         f"{fmt(r.ssim_mean, 3)} (estimated, not certified)")
        elif px.get("feature_residual_mean") is not None:
            stats.append(f"pictures: feature residual {100 * px['feature_residual_mean']:.1f}% "
                         "(estimated, not certified; no ground truth)")
        return stats
    stats = [f"B = {r.batch_size}", f"λ = {fmt(r.sparsity_match, 4)}", r.status]
    if r.psnr_mean is not None:
        stats.append(f"PSNR = {fmt(r.psnr_mean, 1)} dB")
    return stats


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
    from matplotlib.ticker import MaxNLocator

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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
