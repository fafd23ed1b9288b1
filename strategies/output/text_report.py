"""The report's section for language models' updates: each sentence the server read beside the
client's own (audit mode), the tokens that differ marked."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from fl_attack_flwr.results.records import ClientAudit


def text_section(records: Sequence[ClientAudit], kept: str = "all") -> str:
    """``<h2>Sentences read</h2>`` for the text records that hold sentences ('' if none)."""
    texts = [r for r in sorted(records, key=lambda r: (r.server_round, r.client_label))
             if r.reads == "text"]
    if not texts:
        return ""
    shown = [r for r in texts if r.sentences]
    out = ["<h2>Sentences read</h2>"]
    if not shown:
        out.append(f"<p>No sentence is shown (reconstructions kept: {html.escape(kept)}; "
                   "the clients table gives each language model update's verdict).</p>")
        return "".join(out)
    out.append("<p>Left: each sentence the server read off the client's update alone, token "
               "ids decoded with the model's tokenizer. Right, in audit mode: the client's "
               "own sentence matched to it; <mark>marked</mark> tokens differ from the "
               "client's at that position (a sentence with one marked token is not read "
               "exactly).</p>")
    for r in shown:
        out.append(f"<h3>Round {r.server_round}, {html.escape(r.client_label)}</h3>"
                   f"<p>{html.escape(_stats(r))}</p>")
        out.append(_table(r))
    return "".join(out)


def _stats(r: ClientAudit) -> str:
    t = r.text or {}
    words = [str(r.status), f"{t.get('sentences_read', 0)} sentence(s) read"]
    if "sentences_true" in t:
        words.append(f"{t['sentences_exact']} of {t['sentences_true']} of the client's "
                     f"sentences read exactly, ROUGE-1 {t['rouge1']:.3f}, ROUGE-2 "
                     f"{t['rouge2']:.3f}")
    if r.attack_seconds is not None:
        words.append(f"{r.attack_seconds:.1f} s")
    return ", ".join(words)


def _table(r: ClientAudit) -> str:
    truth = any("original" in s for s in r.sentences or [])
    head = "<tr><th class='l'>read by the server</th>" + (
        "<th class='l'>the client's sentence</th><th>exact</th>" if truth else "") + "</tr>"
    rows = []
    for s in r.sentences or []:
        cells = [_tokens(s.get("pieces"), s.get("token_ids"), s.get("original_ids"),
                         s.get("text"))]
        if truth:
            cells += [html.escape(str(s.get("original", "–"))),
                      "yes" if s.get("exact") else "<b>no</b>"]
        rows.append("<tr>" + "".join(f"<td class='l'>{c}</td>" for c in cells) + "</tr>")
    for missed in r.missed_sentences or []:
        rows.append(f"<tr><td class='l'><i>(not read)</i></td><td class='l'>"
                    f"{html.escape(missed)}</td><td><b>no</b></td></tr>")
    return f"<table class='text'>{head}{''.join(rows)}</table>"


def _tokens(pieces: list[str] | None, ids: list[int] | None, original: list[int] | None,
            text: str | None) -> str:
    """The sentence read, token by token, with those that differ from ``original`` marked."""
    if not pieces or ids is None:
        return html.escape(text if text is not None else str(ids))
    out = []
    for i, (piece, tok) in enumerate(zip(pieces, ids, strict=True)):
        differs: Any = original is not None and (i >= len(original) or original[i] != tok)
        cell = html.escape(piece)
        out.append(f"<mark>{cell}</mark>" if differs else cell)
    if original is not None and len(original) > len(ids):
        out.append(f" <mark>[{len(original) - len(ids)} token(s) missing]</mark>")
    return "".join(out)


def is_text_run(records: Sequence[ClientAudit]) -> bool:
    """Whether every attacked update of the run was a language model's (the report then speaks
    of sentences and tokens, not pictures, λ or PSNR)."""
    reads = {r.reads for r in records if r.reads is not None}
    return reads == {"text"}


def text_summary_rows(s: dict[str, Any], config: dict[str, Any]) -> list[tuple[str, Any]]:
    """The summary table of a text run."""
    scored = bool(s.get("text_scored"))
    return [
        ("protocol", s.get("protocol")), ("model", config.get("text-model")),
        ("sentences from", config.get("text-source")),
        ("rounds", s.get("rounds")), ("clients", s.get("clients")),
        ("replies", s.get("replies")), ("attacked", s.get("attacked")),
        ("certified (every token proven)", s.get("text_certified")),
        ("read without certificate", (s.get("text_read") or 0) - (s.get("text_certified") or 0)),
        ("protected", s.get("protected")), ("not covered", s.get("not_covered")),
        ("sentences read", s.get("sentences_read")),
        ("clients' sentences read exactly", f"{s.get('sentences_exact')} of "
         f"{s.get('sentences_true')}" if scored else
         "no ground truth: the clients did not report their sentences"),
        ("mean ROUGE-1 / ROUGE-2", f"{s['rouge1_mean']:.3f} / {s['rouge2_mean']:.3f}"
         if scored else None),
        ("no answer (attack failures)", s.get("attack_failures")),
        ("corrupt replies", s.get("corrupt_replies")), ("client errors", s.get("client_errors")),
        ("attack seconds (total)", s.get("attack_seconds_total")),
    ]


#: What the statuses mean for a language model's update (the others read as for images).
TEXT_MEANINGS = {
    "certified": "the server read every sentence of the batch, and proved every token of it "
                 "from the update alone",
    "not-certified": "the server read the sentences, but the update does not prove every "
                     "token (the reason says which check failed); in audit mode 'read "
                     "exactly' says how many are the client's",
    "partial": "the search stopped (time budget, or span checks that do not separate) with "
               "some sentences read; or, for an encoder, the batch's words were read but not "
               "their order",
    "protected": "the update does not show its sentences to this attack: it holds at least as "
                 "many token positions as the model is wide, or noise or rounding fills "
                 "every direction of it (the reason says which)",
    "not-covered": "outside what the text attack reads (a LoRA adapter whose rank the batch "
                   "reaches, or a model the audit was not given)",
}

TEXT_WORDS = (
    "<dt>The attack</dt><dd>The server reads each client's update of a language model with "
    "DAGER (exact gradient inversion for transformers): the gradient of a linear layer spans "
    "the inputs it saw, so while a batch holds fewer token positions than the model is wide, "
    "block 0's attention gradient tells which vocabulary tokens the client's sentences hold, "
    "block 1's orders them into sentences, and the output layer's gradient gives each "
    "sentence's last token. An encoder (BERT) with a classification head: its sentences are "
    "searched as wholes against block 0's MLP span, and each sentence's label is read from "
    "the head's update.</dd>"
    "<dt>Certified</dt><dd>Every token of every sentence is proven from the update alone: the "
    "tokens and prefixes kept are separated from those rejected with margin, no direction of "
    "the update is left unexplained, every last token is read with a whole count, and the "
    "batch read, run through the model the server sent, reproduces the update on every "
    "parameter read up to the rounding of the client's float32 weights. For an encoder: every "
    "position lies in block 0's MLP span, and the batch with the labels read reproduces the "
    "update.</dd>"
    "<dt>Exact, ROUGE</dt><dd>Audit mode only: a sentence is read exactly when every token id "
    "equals the client's (one wrong token and it is not). ROUGE-1 / ROUGE-2: the share of "
    "the client's words / word pairs the server's sentence holds (1 = all).</dd>")


def text_clients_table(records: Sequence[ClientAudit]) -> tuple[list[str], list[list[str]]]:
    """The clients table of a text run: header and rows (HTML-escaped)."""
    header = ["round", "client", "status", "why", "sentences read", "read exactly", "ROUGE-1",
              "attack s"]
    rows = []
    for r in sorted(records, key=lambda r: (r.server_round, r.client_label)):
        t = r.text or {}
        exact = (f"{t['sentences_exact']} of {t['sentences_true']}" if "sentences_true" in t
                 else "–")
        rows.append([str(r.server_round), html.escape(r.client_label),
                     f"<span class='st'>{html.escape(r.status)}</span>",
                     html.escape(r.reason or r.error or ""),
                     str(t.get("sentences_read", "–")), exact,
                     f"{t['rouge1']:.3f}" if "rouge1" in t else "–",
                     "–" if r.attack_seconds is None else f"{r.attack_seconds:.1f}"])
    return header, rows
