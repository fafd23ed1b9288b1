"""From an attack's outcome to what the audit shows: pictures and scores, one log line per
record, and the round's numbers for Flower's MetricRecord."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome
from fl_attack_flwr.results.pictures import GroundTruth, InputView, score_images
from fl_attack_flwr.results.records import ClientAudit, Pictures, ReplyFacts
from fl_attack_flwr.settings import AttackSettings

__all__ = ["log_record", "log_round", "log_settings", "outcome_of", "pictures_of",
           "round_metrics"]

log = logging.getLogger("flwr")


def outcome_of(fut: Future[AttackOutcome]) -> AttackOutcome:
    """A finished future's outcome; a cancelled or failed one becomes an error outcome."""
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001 - CancelledError included
        status = verdicts.UNFINISHED if fut.cancelled() else verdicts.ATTACK_ERROR
        return error_outcome(status, f"{type(exc).__name__}: {exc}")


def pictures_of(outcome: AttackOutcome, facts: ReplyFacts, view: InputView,
                truth: GroundTruth | None) -> Pictures:
    """Pictures of a reconstruction; with ground truth, matched to the originals and scored.

    Inputs of the model's own input layer are shown as they are; features of a later layer
    are shown as the pictures estimated from them (``outcome.pixels``), or as a table of
    numbers when there are none (features and photos do not compare, so they are not scored).
    Never raises: what could not be shown or scored is the pictures' ``error``.
    """
    px = outcome.pixels
    if facts.reads == "features" and (px is None or px.images is None):
        rows = Pictures(note="No pictures: these are features, shown as numbers.")
        return rows if px is None or px.error is None else Pictures(note=rows.note,
                                                                    error=px.error)
    flat = outcome.inputs if facts.reads != "features" else px.images.reshape(
        px.images.shape[0], -1)
    try:
        images, inferred = view.images(flat)
    except ValueError as exc:
        return Pictures(error=f"pictures: {exc}")
    if images is None:
        return Pictures(note="The inputs are not images: the first reconstructed rows are "
                             "shown as numbers.")
    note = (f"Input shape {images.shape[1:]} inferred from the layer's {images[0].size} "
            "inputs; pictures scaled per image.") if inferred else None
    kept = {} if facts.reads != "features" else {"estimated": images,
                                                  "estimated_scale": view.scale_words(inferred)}
    if truth is None or not facts.sample_indices:
        return Pictures(recon_images=images, note=note, **kept)
    try:
        originals = truth.images(facts.sample_indices)
        score = score_images(images, originals)
    except ValueError as exc:
        return Pictures(recon_images=images, note=note, error=f"scoring failed: {exc}", **kept)
    return Pictures(recon_images=score.matched, original_images=originals.numpy(),
                    matching=score.matching, psnr=score.psnr, psnr_mean=score.psnr_mean,
                    ssim=score.ssim, ssim_mean=score.ssim_mean,
                    true_batch_size=int(originals.shape[0]), note=note, **kept)


def log_record(record: ClientAudit) -> None:
    """One line per finished record (round, client, status, λ, PSNR, seconds, why)."""
    lam = "" if record.sparsity_match is None else f", λ={record.sparsity_match:.4f}"
    psnr = "" if record.psnr_mean is None else f", PSNR {record.psnr_mean:.1f} dB"
    if record.reads == "features" and record.reconstructed:
        lam = f" ({str(record.layer).removesuffix('.weight')} input features){lam}"
        psnr = psnr and f", pictures estimated: PSNR {record.psnr_mean:.1f} dB"
    secs = "" if record.attack_seconds is None else f", {record.attack_seconds:.1f}s"
    why = record.reason or record.error
    level = (logging.WARNING if record.status in (*verdicts.ERRORS, verdicts.CORRUPT)
             else logging.INFO)
    log.log(level, "[audit] round %d, %s: %s%s%s%s%s", record.server_round, record.client_label,
            record.status, lam, psnr, secs, f" ({why})" if why else "")


def log_round(server_round: int, stats: dict[str, float], queued: int) -> None:
    """One line per round: what the audit found, its throughput and what is still queued."""
    log.info("[audit] round %d: %d replies, %d certified, %d reconstructed, %d protected, "
             "%d without answer; %.1f attacks/min, %d still queued", server_round,
             int(stats["audit-replies"]), int(stats["audit-certified"]),
             int(stats["audit-reconstructions"]), int(stats["audit-protected"]),
             int(stats["audit-failures"]), stats.get("audit-attacks-per-minute", 0.0), queued)


def log_settings(a: AttackSettings, enabled: bool, ground_truth: bool, output: str) -> None:
    """The audit's part of the strategy summary Flower logs at the start."""
    log.info("\t├──> Privacy audit (%s):", "on" if enabled else "off")
    log.info("\t│\t├── Attack: %s, update read as %s, budget %s s, device %s", a.method,
             a.update, a.max_seconds, a.device or "auto")
    log.info("\t│\t├── Runs on: %s executor, %s mode, hard timeout %s s", a.executor, a.mode,
             a.timeout)
    log.info("\t│\t├── Ground truth: %s", "yes (audit mode)" if ground_truth else "no")
    log.info("\t│\t└── Output: %s", output)


def round_metrics(records: list[ClientAudit], seconds: float) -> dict[str, float]:
    """The audit's numbers for a round's MetricRecord (numbers only, as Flower requires)."""
    done = [r for r in records if r.reconstructed]

    def n(*statuses: str) -> int:
        return sum(1 for r in records if r.status in statuses)

    stats: dict[str, float] = {
        "audit-replies": len(records),
        "audit-reconstructions": len(done),
        "audit-certified": n(verdicts.CERTIFIED),
        "audit-protected": n(verdicts.PROTECTED),
        "audit-refused": n(verdicts.REFUSED),
        "audit-skipped": n(verdicts.SKIPPED),
        "audit-failures": n(*verdicts.ERRORS),
        "audit-corrupt": n(verdicts.CORRUPT),
        "audit-client-errors": n(verdicts.CLIENT_ERROR),
        "audit-attack-seconds": float(sum(r.attack_seconds or 0.0 for r in records)),
        "audit-seconds": float(seconds),
    }
    if seconds > 0 and stats["audit-attack-seconds"] > 0:
        attacked = len(done) + n(verdicts.PROTECTED, *verdicts.ERRORS)
        stats["audit-attacks-per-minute"] = 60.0 * attacked / seconds
    lams = [r.sparsity_match for r in done if r.sparsity_match is not None]
    if lams:
        stats["audit-lambda-mean"] = float(np.mean(lams))
    psnrs = [r.psnr_mean for r in done if r.psnr_mean is not None and math.isfinite(r.psnr_mean)]
    if psnrs:
        stats["audit-psnr-mean"] = float(np.mean(psnrs))
    return stats
