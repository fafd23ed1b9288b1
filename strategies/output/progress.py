"""Leakage as the model trains: what the server read in each round, beside the model's accuracy.

A federation runs many rounds, and the auditor's question is whether the server can read the
clients *while the model trains*, not only at its initialisation. :func:`by_round` puts each
round's audit (client updates attacked and certified, samples read) beside the accuracy of the
global model after that round (Flower's evaluate round, as the auditing strategy stores it with
the round); :func:`trend_sentence` says in one sentence, from those numbers only, how leakage
changed between the first and the last audited rounds while the accuracy moved;
:func:`progress_png` draws both against the round.

A sample counts as *read* when its reconstruction is recognisable against the client's true
sample (PSNR above the readable threshold, audit mode) or, without ground truth, when it
belongs to a batch certified exact from the model's own inputs. Updates whose attack gave no
answer (a timeout, a crash, the run's end) are counted apart and left out of the shares.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fl_attack_flwr import verdicts
from fl_attack_flwr.results.records import ClientAudit

ACCURACY_KEYS = ("eval-acc", "accuracy", "acc", "eval_acc", "eval-accuracy", "val-acc",
                 "test-acc")
"""Metric names read as the model's accuracy (the bundled client's ``eval-acc`` first)."""
SOURCES = (("evaluate-server", "server"), ("evaluate", "clients"))
"""Where a round's accuracy comes from, in order of preference: a server-side ``evaluate_fn``
(one test set), then the clients' evaluate replies as the strategy aggregated them."""


def accuracy_of(info: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """``(accuracy in [0, 1], "server" | "clients")`` of one round's stored facts, or
    ``(None, None)`` when the round holds no accuracy."""
    for key, source in SOURCES:
        metrics = info.get(key) or {}
        for name in ACCURACY_KEYS:
            value = metrics.get(name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                return float(value), source
    return None, None


def samples_of(record: ClientAudit) -> int:
    """How many samples the client's update holds, as best known."""
    return int(record.true_batch_size or record.num_examples or record.batch_size or 0)


def readable_samples(record: ClientAudit, readable_db: float) -> int:
    """Samples of ``record`` whose PSNR against the ground truth is above ``readable_db``."""
    return sum(1 for p in record.psnr or () if p is not None and p > readable_db)


def samples_read(record: ClientAudit, readable_db: float) -> int:
    """Samples of the update the server read (see the module docstring)."""
    if record.psnr is not None:
        return readable_samples(record, readable_db)
    if record.status == verdicts.CERTIFIED and record.reads != "features":
        return samples_of(record)
    return 0


def by_round(records: Sequence[ClientAudit], rounds: Mapping[int, Mapping[str, Any]], *,
             readable_db: float) -> list[dict[str, Any]]:
    """One row per round (JSON-safe): ``round``, ``accuracy``, ``accuracy_from``, ``attacked``
    (updates the attack answered: reconstructed or protected), ``certified``, ``samples`` (in
    those updates), ``read`` (samples read) and ``no_answer`` (attacks without an answer)."""
    answered = (*verdicts.RECONSTRUCTED, verdicts.PROTECTED)
    rows = []
    for rnd in sorted({r.server_round for r in records} | {int(k) for k in rounds}):
        done = [r for r in records if r.server_round == rnd and r.status in answered]
        accuracy, source = accuracy_of(rounds.get(rnd, {}))
        rows.append({
            "round": rnd, "accuracy": accuracy, "accuracy_from": source,
            "attacked": len(done),
            "certified": sum(1 for r in done if r.status == verdicts.CERTIFIED),
            "samples": sum(samples_of(r) for r in done),
            "read": sum(samples_read(r, readable_db) for r in done),
            "no_answer": sum(1 for r in records
                             if r.server_round == rnd and r.status in verdicts.ERRORS),
        })
    return rows


def _span(rows: Sequence[Mapping[str, Any]]) -> str:
    """``"round 3"``, ``"rounds 1-10"``, or the audited rounds of a window with gaps."""
    first, last = rows[0]["round"], rows[-1]["round"]
    if len(rows) == 1:
        return f"round {first}"
    if last - first + 1 == len(rows):
        return f"rounds {first}-{last}"
    return f"the {len(rows)} audited rounds from {first} to {last}"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "–"


def _moved(before: float, after: float) -> str:
    """How a share moved, judged on the whole percentages the sentence prints."""
    a, b = round(100 * before), round(100 * after)
    return "rose" if b > a else "fell" if b < a else "stayed the same"


def _window(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, int, int]:
    """``(read, samples, certified, attacked)`` summed over rows."""
    return (sum(r["read"] for r in rows), sum(r["samples"] for r in rows),
            sum(r["certified"] for r in rows), sum(r["attacked"] for r in rows))


def trend_sentence(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """How leakage changed as the model trained, from ``rows`` (:func:`by_round`) alone.

    Compares the first and the last audited rounds (up to ten each, a third of the audited
    rounds at most, so the two never overlap), names the round where the share read was
    lowest when rounds lie between them, and gives the accuracy after the first and the last
    round; ``None`` with fewer than two audited rounds.
    """
    audited = [r for r in rows if r["attacked"]]
    if len(audited) < 2:
        return None
    k = max(1, min(10, len(audited) // 3))
    early, late = audited[:k], audited[-k:]
    read1, n1, cert1, att1 = _window(early)
    read2, n2, cert2, att2 = _window(late)
    share1, share2 = (read1 / n1 if n1 else 0.0), (read2 / n2 if n2 else 0.0)
    sentence = (f"As the model trained, the share of attacked samples the server read "
                f"{_moved(share1, share2)}: {read1} of {n1} ({_pct(read1, n1)}) in "
                f"{_span(early)}, {read2} of {n2} ({_pct(read2, n2)}) in {_span(late)}")
    if len(audited) > 2 * k:  # rounds between the windows: say where the share was lowest
        low = min(audited, key=lambda r: r["read"] / r["samples"] if r["samples"] else 0.0)
        sentence += (f", the fewest in round {low['round']} ({low['read']} of "
                     f"{low['samples']}, {_pct(low['read'], low['samples'])})")
    sentence += f"; client updates certified exact: {cert1} of {att1}, then {cert2} of {att2}"
    scored = [r for r in rows if r["accuracy"] is not None]
    if len(scored) >= 2:
        a, b = scored[0], scored[-1]
        verb = _moved(a["accuracy"], b["accuracy"])
        change = (f"stayed at {100 * a['accuracy']:.0f}%" if verb == "stayed the same" else
                  f"{verb} from {100 * a['accuracy']:.0f}% after round {a['round']} to "
                  f"{100 * b['accuracy']:.0f}% after round {b['round']}")
        sentence += f"; the model's accuracy {change}"
    missing = sum(r["no_answer"] for r in rows)
    if missing:
        sentence += (f" ({missing} attack{' gave' if missing == 1 else 's gave'} no answer and "
                     f"{'is' if missing == 1 else 'are'} left out)")
    return sentence + "."


def progress_png(rows: Sequence[Mapping[str, Any]]) -> bytes | None:
    """Leakage (samples read, client updates certified, as % of those attacked) and accuracy
    (%) against the round, on one axis; ``None`` when there is neither."""
    audited = [r for r in rows if r["attacked"]]
    scored = [r for r in rows if r["accuracy"] is not None]
    if not audited and not scored:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if audited:  # the samples read drawn last: on top where the two lines coincide
        xs = [r["round"] for r in audited]
        ax.plot(xs, [100.0 * r["certified"] / r["attacked"] for r in audited], "s--",
                color="tab:orange", ms=7, label="client updates certified exact")
        ax.plot(xs, [100.0 * r["read"] / r["samples"] if r["samples"] else 0.0
                     for r in audited], "o-", color="tab:red", ms=4,
                label="samples the server read")
    if scored:
        ax.plot([r["round"] for r in scored], [100.0 * r["accuracy"] for r in scored], "-",
                color="tab:blue", lw=2, label="model accuracy after the round")
    ax.set_ylim(-5, 105)
    ax.set_ylabel("% (leakage: of those attacked)")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("What the server read, and the model's accuracy, round by round", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
