"""The audit's answer: a run's totals and the verdict in plain words.

:func:`summarize` reduces a run's records to the numbers of ``summary.json``; :func:`verdict`
turns them into the sentence an auditor reads first. The words say exactly what was read: the
model's own inputs (a first layer), or a later layer's input *features*, which are exact when
certified while the pictures estimated from them are an approximation, scored on their own.
Where nothing was read, the sentence says that this attack failed within its budget and what
protects the clients (the noise's ε, or how many samples an update mixes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.output import progress
from fl_attack_flwr.output.private_files import jsonable
from fl_attack_flwr.results.records import ClientAudit

EXACT_DB = 90.0
"""PSNR above which a reconstruction is exact to float precision (the papers' threshold)."""
READABLE_DB = 25.0
"""PSNR above which a reconstructed image is recognisable (the SPEAR papers' DP threshold)."""


def summarize(records: Sequence[ClientAudit], rounds: Mapping[int, Mapping[str, Any]],
              config: Mapping[str, Any], *, run_name: str, run_dir: Path | str,
              wall_seconds: float) -> dict[str, Any]:
    """Totals over a run (JSON-safe), with the verdict.

    ``psnr_mean`` is ``None`` without ground truth; ``epsilon`` is the largest cumulative ε any
    client reported (``None`` without DP). ``by_round`` puts each round's leakage beside the
    model's accuracy and ``leakage_trend`` says how leakage changed as the model trained
    (:mod:`fl_attack_flwr.output.progress`; ``None`` with fewer than two audited rounds).
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
        "readable": sum(1 for r in rec if recognisable(r)),
        "samples_scored": sum(len(_sample_scores(r)) for r in rec),
        "samples_readable": sum(progress.readable_samples(r, READABLE_DB) for r in rec),
        "certified_or_readable": sum(1 for r in rec if (
            r.status == verdicts.CERTIFIED and r.reads != "features") or recognisable(r)),
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
    summary.update(_feature_totals(records), **_text_totals(records), budget=_budget(config))
    summary["by_round"] = progress.by_round(records, rounds, readable_db=READABLE_DB)
    summary["leakage_trend"] = progress.trend_sentence(summary["by_round"])
    summary["verdict"], summary["verdict_level"] = verdict(summary)
    summary["notes"] = config_notes(config)
    return jsonable(summary)


def _sample_scores(record: ClientAudit) -> list[float]:
    """The finite per-sample PSNRs of a scored reconstruction (empty when only a mean is
    known)."""
    return [p for p in record.psnr or () if p is not None and math.isfinite(p)]


def recognisable(record: ClientAudit) -> bool:
    """Whether a scored reconstruction holds a recognisable sample: any sample above
    ``READABLE_DB`` (the batch's mean PSNR when no per-sample score is known). One readable
    photo is a leak even where the batch's mean is low."""
    if _sample_scores(record):
        return progress.readable_samples(record, READABLE_DB) > 0
    mean = record.psnr_mean
    return mean is not None and math.isfinite(mean) and mean > READABLE_DB


def _feature_totals(records: Sequence[ClientAudit]) -> dict[str, Any]:
    """Certified inputs vs certified features, the pictures estimated from features, and why
    updates were protected."""
    cert = [r for r in records if r.status == verdicts.CERTIFIED]
    feats = [r for r in records if r.reconstructed and r.reads == "features"]
    scored = [r.psnr_mean for r in feats if r.psnr_mean is not None]
    ssims = [r.ssim_mean for r in feats if r.ssim_mean is not None]
    residual = [r.pixels["feature_residual_mean"] for r in feats
                if r.pixels and r.pixels.get("feature_residual_mean") is not None]
    mixing = [r for r in records if r.status == verdicts.PROTECTED
              and r.protected_by == "full-rank"]
    return {
        "inputs_certified": sum(1 for r in cert if r.reads not in ("features", "text")),
        "features_certified": sum(1 for r in cert if r.reads == "features"),
        "feature_layers": ", ".join(sorted({_layer_name(r.layer) for r in feats})) or None,
        "pictures_estimated": sum(1 for r in feats if r.pixels and not r.pixels.get("error")),
        "pictures_failed": sum(1 for r in feats if r.pixels and r.pixels.get("error")),
        "pictures_scored": len(scored),
        "pictures_readable": sum(1 for r in feats if recognisable(r)),
        "pictures_samples": sum(len(_sample_scores(r)) for r in feats),
        "pictures_samples_readable": sum(progress.readable_samples(r, READABLE_DB)
                                         for r in feats),
        "pictures_psnr_mean": float(np.mean(scored)) if scored else None,
        "pictures_ssim_mean": float(np.mean(ssims)) if ssims else None,
        "feature_residual_mean": float(np.mean(residual)) if residual else None,
        "not_covered": sum(1 for r in records if r.status == verdicts.NOT_COVERED),
        "protected_mixing": len(mixing),
    }


def _text_totals(records: Sequence[ClientAudit]) -> dict[str, Any]:
    """Language models' updates: how many were read, certified, and their sentences (with
    the truth: how many of the clients' sentences were read exactly, and ROUGE)."""
    read = [r for r in records if r.reads == "text" and r.reconstructed]
    cert = [r for r in read if r.status == verdicts.CERTIFIED]
    scored = [r.text for r in read if r.text and "sentences_true" in r.text]

    def sentences(rs: Sequence[ClientAudit]) -> int:
        return sum(int((r.text or {}).get("sentences_read") or 0) for r in rs)

    bags = [r for r in read if not (r.text or {}).get("sentences_read")
            and (r.text or {}).get("tokens_read")]

    return {
        "text_read": len(read), "text_certified": len(cert), "text_tokens_only": len(bags),
        "tokens_only_read": sum(int(r.text["tokens_read"]) for r in bags),
        "sentences_read": sentences(read), "sentences_certified": sentences(cert),
        "sentences_true": sum(t["sentences_true"] for t in scored),
        "sentences_exact": sum(t["sentences_exact"] for t in scored),
        "text_scored": len(scored),
        "rouge1_mean": float(np.mean([t["rouge1"] for t in scored])) if scored else None,
        "rouge2_mean": float(np.mean([t["rouge2"] for t in scored])) if scored else None,
    }


def _text_sentences(s: Mapping[str, Any]) -> list[str]:
    """What was read off language models' updates, in words."""
    if not s.get("text_read"):
        return []
    out, attacked = [], s["attacked"]
    truth = (f" Against the clients' own sentences: {s['sentences_exact']} of "
             f"{s['sentences_true']} read exactly (token for token), ROUGE-1 "
             f"{s['rouge1_mean']:.3f}, ROUGE-2 {s['rouge2_mean']:.3f}."
             if s.get("text_scored") else "")
    bags = s.get("text_tokens_only") or 0
    cert, more = s["text_certified"], s["text_read"] - s["text_certified"] - bags
    if cert:
        out.append(f"The server read {s['sentences_certified']} sentence(s) of {cert} of "
                   f"{attacked} client updates exactly (certified): every token of every "
                   "sentence of those batches, proven without the clients' data.")
    if more:
        out.append(f"{'It read' if cert else 'The server read'} "
                   f"{s['sentences_read'] - s['sentences_certified']} sentence(s) of {more} "
                   f"{'more ' if cert else ''}client update(s) without a certificate.")
    if bags:
        out.append(f"{'It' if out else 'The server'} read the words of {bags} "
                   f"{'more ' if out else ''}client update(s) ({s['tokens_only_read']} distinct "
                   "tokens in all), not their order: no sentence of those batches was read.")
    return out + ([truth.strip()] if truth else [])


def _layer_name(weight_key: str | None) -> str:
    """``"fc1.weight"`` -> ``"fc1"``: the layer as its model names it."""
    return str(weight_key).removesuffix(".weight")


def _budget(config: Mapping[str, Any]) -> str | None:
    seconds = config.get("max-seconds")
    return f"SPEAR++, {float(seconds):g} s per update" if seconds else None


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

    ``level`` is ``"leak"`` (some batch certified from the model's own inputs, or readable:
    PSNR above 25 dB, of the inputs or of pictures estimated from features), ``"some"``
    (something was recovered but not shown readable: exact features whose pictures are not
    recognisable or not scored, reconstructions without certificate or ground truth), ``"safe"``
    (nothing attacked was read) or ``"none"`` (nothing was attacked to the end).
    """
    attacked = s["attacked"]
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
    parts += _read_sentences(s)
    level = _level(s)
    if s["protected"]:
        n = s["protected"]
        why = "" if level == "safe" else f": {_protection(s)}"
        parts.append(f"{n} of {attacked} {'update was' if n == 1 else 'updates were'} "
                     f"protected from this attack{why}.")
    if s.get("not_covered"):
        parts.append(f"{s['not_covered']} update(s) are outside what this attack covers (no "
                     "answer either way; the clients table says why).")
    if s["attack_failures"]:
        parts.append(f"{s['attack_failures']} attack(s) gave no answer ({_status_list(s)}).")
    if level == "safe":
        budget = f" within its budget ({s['budget']})" if s.get("budget") else ""
        parts.insert(0, f"The attack could not read any attacked client's batch{budget}: "
                        f"{_protection(s)}.")
    return " ".join(parts), level


def _read_sentences(s: Mapping[str, Any]) -> list[str]:
    """What was read: certified inputs, certified features (and their pictures), the rest."""
    attacked, out = s["attacked"], _text_sentences(s)
    cert_in, cert_ft = s["inputs_certified"], s["features_certified"]
    if cert_in:
        which = "that batch" if cert_in == 1 else "those batches"
        out.append(f"The server reconstructed {cert_in} of {attacked} client batches exactly "
                   f"(certified): every sample of {which} is readable.")
    if cert_ft:
        out.append(f"The server recovered the {s['feature_layers']} input features of {cert_ft} "
                   f"of {attacked} client batches exactly (certified): what the model computes "
                   "from each sample, not the samples themselves.")
        out.append(_pictures_sentence(s))
    uncert = s["not_certified"] + s["partial"] - (s.get("text_read", 0)
                                                  - s.get("text_certified", 0))
    if uncert:
        how = (f"; {s['readable']} of the {s['scored']} scored reconstructions hold "
               f"recognisable samples (PSNR > {READABLE_DB:.0f} dB"
               f"{_of_samples(s['samples_readable'], s['samples_scored'], 'samples')})."
               if s["scored"] else " (no ground truth to say how close).")
        if out:
            out.append(f"{uncert} more {'was' if uncert == 1 else 'were'} reconstructed "
                       f"without a certificate{how}")
        else:
            out.append(f"The server reconstructed {uncert} of {attacked} client batches, "
                       f"without a certificate{how}")
    return out


def _pictures_sentence(s: Mapping[str, Any]) -> str:
    """How far the pictures estimated from exact features go."""
    if s["pictures_scored"]:
        each = _of_samples(s["pictures_samples_readable"], s["pictures_samples"], "pictures")
        return (f"From the features it estimated the pictures by feature inversion, an "
                f"approximation: mean PSNR {s['pictures_psnr_mean']:.1f} dB, SSIM "
                f"{s['pictures_ssim_mean']:.2f}; {s['pictures_readable']} of "
                f"{s['pictures_scored']} batches hold recognisable pictures (PSNR > "
                f"{READABLE_DB:.0f} dB{each}).")
    if s["pictures_estimated"]:
        return ("From the features it estimated pictures by feature inversion, an "
                "approximation (their own features match the recovered ones to "
                f"{100 * s['feature_residual_mean']:.1f}%); without ground truth how close "
                "they are to the photos is not known.")
    if s["pictures_failed"]:
        return (f"Estimating pictures from them failed ({s['pictures_failed']}); the clients "
                "table says why.")
    return ("No pictures were estimated from them: give the audit the model "
            "(AuditingStrategy(..., model=Net)) to estimate them.")


def _of_samples(readable: int, scored: int, noun: str) -> str:
    """': k of n samples' (``noun``), where per-sample scores exist."""
    return f": {readable} of {scored} {noun}" if scored else ""


def _level(s: Mapping[str, Any]) -> str:
    answered = s["reconstructions"] + s["protected"]
    if (s["inputs_certified"] or s["readable"] or s["pictures_readable"]
            or s.get("text_certified") or s.get("sentences_exact")):
        return "leak"
    if not answered:
        return "none"
    nothing_read = (s["features_certified"] == 0 and s["scored"] == s["reconstructions"]
                    and s["readable"] == 0)
    return "safe" if s["protected"] == answered or nothing_read else "some"


def _protection(s: Mapping[str, Any]) -> str:
    """What protects the clients, from the protected records' reasons and the DP they report."""
    why = []
    if s.get("epsilon") is not None:
        delta = s.get("delta")
        at = f" at δ = {float(delta):g}" if delta is not None else " (δ not reported)"
        why.append(f"the noise the clients add (DP, ε ≤ {_eps(s['epsilon'])}{at})")
    if s.get("protected_mixing"):
        why.append(f"{s['protected_mixing']} update(s) mix more samples than the attacked layer "
                   "can separate")
    if not why:
        why.append("its reconstructions are not recognisable against the true samples"
                   if s["scored"] else "the attack found no reading of the updates")
    return "; ".join(why)


def _eps(value: Any) -> str:
    return "∞" if value in ("inf", math.inf) else f"{float(value):.3g}"


def _status_list(s: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {k}" for k, n in s["statuses"].items()) or "no replies"
