"""What happened to a client's data: the status words of an audit, and how each is decided.

The same words appear in ``metrics.jsonl``, the log, the HTML report and the round's metrics.
A status says what the *server* could do with the update, so that an auditor reads it as an
answer, not as a crash report:

==================  ===========================================================================
``certified``       every sample of the batch was reconstructed and the reconstruction carries
                    the attack's certificate (sparsity match λ = 1 with all B directions, no
                    noise, every sample's column pinned down by its own zero rows, one
                    gradient step): exact without any ground truth
``not-certified``   a full reconstruction without the certificate; ``reason`` says why (λ < 1,
                    noise detected, samples read only up to a mixture of each other, a sum of
                    local steps, the time budget ended the search); its quality is only
                    known from PSNR against the ground truth
``partial``         k of B directions found: a reconstruction in which no sample is guaranteed
                    but those verified one by one through the next layer
``protected``       the update does not reveal the batch to this attack; ``reason`` says why
                    (it mixes at least min(m, n) samples, or noise hides every sample)
``refused``         the client's ``LeakGuard`` proved its update readable and withheld it: the
                    reply carries no update
``not-covered``     the update is outside what this attack covers (``reason`` says which of its
                    assumptions fails: a ReLU after the attacked layer, a BatchNorm between them,
                    a bias gradient); where a later layer is covered the audit attacks that one
                    and lists this one in the record's ``passed_over`` instead
``no-update``       the client sent back the global model unchanged: nothing to attack
``skipped``         not attacked by the audit's sampling (``reason`` says which rule)
``corrupt``         the reply cannot be aggregated (NaN, wrong shapes, ...): withheld
``client-error``    the client reported an error instead of an update
``timeout``         the attack ran past its hard time limit and was stopped
``out-of-memory``   the attack exceeded its memory cap and was stopped; the server stays up
``worker-died``     the process running the attack died; only that attack is lost
``unfinished``      the run ended before the attack did (background audit, drain timeout)
``attack-error``    a fault in the attack or the audit (a bug, bad settings)
==================  ===========================================================================
"""

from __future__ import annotations

from typing import Any

CERTIFIED = "certified"
NOT_CERTIFIED = "not-certified"
PARTIAL = "partial"
PROTECTED = "protected"
REFUSED = "refused"
NOT_COVERED = "not-covered"
NO_UPDATE = "no-update"
SKIPPED = "skipped"
CORRUPT = "corrupt"
CLIENT_ERROR = "client-error"
TIMEOUT = "timeout"
OUT_OF_MEMORY = "out-of-memory"
WORKER_DIED = "worker-died"
UNFINISHED = "unfinished"
ATTACK_ERROR = "attack-error"
PENDING = "pending"

#: Statuses whose record holds a reconstruction.
RECONSTRUCTED = (CERTIFIED, NOT_CERTIFIED, PARTIAL)
#: Statuses in which the audit, not the client, failed to give an answer.
ERRORS = (TIMEOUT, OUT_OF_MEMORY, WORKER_DIED, UNFINISHED, ATTACK_ERROR)
STATUSES = (*RECONSTRUCTED, PROTECTED, REFUSED, NOT_COVERED, NO_UPDATE, SKIPPED, CORRUPT,
            CLIENT_ERROR, *ERRORS, PENDING)

#: One line of plain words per status, for the report's legend.
MEANINGS: dict[str, str] = {
    CERTIFIED: "the server reconstructed every sample, and the attack's certificate proves the "
               "reconstruction exact without seeing the data",
    NOT_CERTIFIED: "the server reconstructed the batch, but without a certificate: how close it "
                   "is shows only in the PSNR against the true data",
    PARTIAL: "the server found only some of the batch's directions: no sample is guaranteed, "
             "except those verified one by one through the next layer (framed in green)",
    PROTECTED: "this update does not reveal its batch to the attack",
    REFUSED: "the client's LeakGuard proved its update readable and did not send it",
    NOT_COVERED: "the update is outside what this attack covers: no answer either way",
    NO_UPDATE: "the client sent back the global model unchanged: nothing to attack",
    SKIPPED: "not attacked (the audit samples replies)",
    CORRUPT: "the reply could not be aggregated and was withheld from the model",
    CLIENT_ERROR: "the client reported an error instead of an update",
    TIMEOUT: "the attack ran past its hard time limit and was stopped (no answer)",
    OUT_OF_MEMORY: "the attack exceeded its memory cap and was stopped (no answer)",
    WORKER_DIED: "the process running the attack died (no answer)",
    UNFINISHED: "the run ended before this attack did (no answer)",
    ATTACK_ERROR: "the attack failed (no answer)",
    PENDING: "the attack has not finished yet",
}


def protected_reason(reason: str, rank: int, limit: int, num_examples: int | None = None) -> str:
    """The plain-words reason of a ``protected`` verdict for an ``fl_attack.NotIdentifiable``.

    Parameters
    ----------
    reason : str
        ``NotIdentifiable.reason``: ``"full-rank"`` or ``"no-signal"``.
    rank, limit : int
        The update's numerical rank and min(m, n) of the attacked layer (over the rows and
        columns that carry any signal).
    num_examples : int, optional
        The samples the reply says the client trained on; the reason then says both, and it
        is only given where they agree (the caller attacks an update whose reply reports fewer
        samples than ``limit`` at the reported size instead).
    """
    if reason == "no-signal":
        return "noise hides the batch: the update has numerical rank 0"
    told = "" if num_examples is None else f"the reply reports {num_examples} samples; "
    return (f"{told}the update mixes at least min(m, n) = {limit} samples (numerical rank "
            f"{rank}), more than the attacked layer can separate, or noise swamps the signal")


def separated_reason(batch_size: int, num_examples: int, noisy: bool) -> str:
    """Why an update separates fewer samples than its reply reports, in plain words.

    A batch's update has rank below its sample count when samples repeat, when two are equal
    to the update's precision, or when a sample's gradient vanishes below its rounding (a
    sample the model already fits); under noise, when the noise hides the weakest ones. What
    the attack reads (and may certify) is then those ``batch_size`` directions, never the
    ``num_examples`` the reply counts.
    """
    why = ("repeat a sample, are indistinguishable from one at the update's precision, or add "
           "nothing the update keeps") + (", or are hidden by its noise" if noisy else "")
    return (f"the update separates {batch_size} of the {num_examples} samples the reply reports "
            f"(its numerical rank): the others {why}")


def not_relu_reason(layer: str, after: str | None) -> str:
    """Why a layer whose output does not go straight into a ReLU is ``not-covered``."""
    name = layer.removesuffix(".weight")
    if after is not None and after.startswith("BatchNorm"):
        return batchnorm_reason(layer, after, train=None)
    return (f"the layer {name}'s output goes into {after or 'something the model does not name'}"
            ", not a ReLU: the sparsity this attack reads (and its certificate) needs a ReLU "
            "right after the layer")


def batchnorm_reason(layer: str, norm: str, train: bool | None) -> str:
    """Why a layer followed by a BatchNorm is ``not-covered``.

    ``train``: the client's running statistics moved (the norm normalised with each batch's
    own statistics), ``False``: they did not (frozen statistics), ``None``: unknown.
    """
    name = layer.removesuffix(".weight")
    if train is False:
        return (f"the layer {name}'s output goes into a BatchNorm ({norm}) with frozen "
                "statistics: the ReLU after it cuts the normalised output at zero, not the "
                "layer's own output, so the zeros this attack reads are not the layer's: "
                "outside what this attack covers")
    into = (f"goes into a BatchNorm ({norm}) in train mode: its" if train else
            f"goes into a BatchNorm ({norm}): in train mode its")
    return (f"the layer {name}'s output {into} batch statistics couple the batch's samples "
            "and cancel the layer's bias gradient, so neither the ReLU's zeros nor the bias "
            "gradient (with which the attack fixes each sample's scale) belong to single "
            "samples: outside what this attack covers")


def still_bias_reason(layer: str) -> str:
    """Why a layer whose bias did not move while its weights did is ``not-covered``."""
    name = layer.removesuffix(".weight")
    return (f"the layer {name}'s bias did not move while its weights did (on every unit by "
            "less than 1e-4 of the unit's weight change: rounding): a BatchNorm over the batch "
            "after the layer "
            "cancels the bias gradient (or the bias is frozen), and the attack needs it to "
            "fix each sample's scale: outside what this attack covers")


def _unproven(result: dict[str, Any]) -> str:
    """Why a full reconstruction with λ = 1 is not certified (``Reconstruction.as_dict()``)."""
    mixed = result.get("mixed") or []
    if result.get("noisy", True) and not mixed:
        sigma = float(result.get("noise_std") or 0.0)
        return (f"noise detected on the update (σ ≈ {sigma:.2e}): a noisy update is never "
                "certified; see PSNR")
    if result.get("merged"):
        return (f"the update separates {result['batch_size']} of the "
                f"{result['batch_size'] + result['merged']} samples given: each of the others "
                "is within the noise or the rounding of one it holds, which stands for both")
    pairs = [list(group) for group in mixed if len(group) > 1]
    if pairs:
        count = sum(len(group) for group in pairs)
        return (f"λ = 1, but {count} samples are read only up to a mixture of each other "
                f"(groups {pairs}): their ReLU patterns nest or differ on a single unit, so "
                "this layer's update does not single them out; the other samples are read as "
                "usual")
    if result.get("rounding_limited"):
        return ("λ = 1, but the update's weakest samples sit near the float32 rounding of the "
                "gradient (a trained model's confidently classified samples): they are read only "
                "to that precision, so nothing is certified; see PSNR")
    if result.get("update") == "fedavg":
        return ("read as a sum of local steps (FedAvg): λ = 1 shows the reconstruction "
                "consistent with the update, which for a sum proves nothing; see PSNR")
    return ("λ = 1, but not every sample's column is pinned down by its own zero rows, so "
            "the update does not prove this reconstruction")


#: How the verdict names each reason a sample is not proven (``Reconstruction.unproven``).
_UNPROVEN_WORDS = {
    "not-found": "not found by the search (completed from the others)",
    "rounding": "held by the update only near its noise or float32 rounding",
    "mixture": "read only up to a mixture with others",
    "unpinned": "not singled out by their own zero rows",
    "mismatch": "activation pattern breaking the ReLU law",
    "incomplete": "found, but read through the completed directions",
}


PER_SAMPLE_UNPROVEN = frozenset(_UNPROVEN_WORDS)
"""The reasons of ``Reconstruction.unproven`` that single a sample out (not batch-wide)."""


def unproven_samples(result: dict[str, Any]) -> str | None:
    """The samples that keep a batch from being proven, by reason, in words (None when the
    facts name none, or only a batch-wide reason: noise, a FedAvg sum)."""
    by_reason: dict[str, list[int]] = {}
    for row, why in result.get("unproven") or []:
        if why in _UNPROVEN_WORDS:
            by_reason.setdefault(why, []).append(int(row))
    if not by_reason:
        return None
    parts = []
    for why, rows in by_reason.items():
        shown = ", ".join(map(str, rows[:12])) + (", ..." if len(rows) > 12 else "")
        parts.append(f"{len(rows)} {_UNPROVEN_WORDS[why]} (rows {shown})")
    return "the samples not proven, by row of the reconstruction: " + "; ".join(parts)


def reconstruction_verdict(result: dict[str, Any]) -> tuple[str, str | None]:
    """``(status, reason)`` of a finished attack from its facts (``Reconstruction.as_dict()``).

    ``certified`` needs the library's ``exact`` flag (λ = 1, every direction found, no noise);
    every other outcome gets the first reason that applies.
    """
    B, found = int(result["batch_size"]), int(result["n_directions"])
    if result.get("exact"):
        return CERTIFIED, None
    verified = len(result.get("verified") or [])
    named = unproven_samples(result)
    if found < B:
        why = f"{found} of {B} directions found: no sample is guaranteed"
        if verified:
            why = (f"{found} of {B} directions found: {verified} sample(s) verified one by one "
                   "through the next layer are read exactly, no other sample is guaranteed")
        return PARTIAL, why + (f"; {named}" if named else "")
    status, why = _full_basis(result, B)
    if verified and why is not None:
        why += (f"; {verified} sample(s) verified one by one through the next layer are read "
                "exactly")
    if named and why is not None:
        why += f"; {named}"
    return status, why


def _full_basis(result: dict[str, Any], B: int) -> tuple[str, str | None]:
    """``(status, reason)`` of a full basis that is not certified."""
    lam = result.get("sparsity_match")
    if lam is None:
        return NOT_CERTIFIED, "no certificate without the layer's weights and bias"
    if lam >= 1.0:  # every pattern matches, yet not exact: say which condition failed
        return NOT_CERTIFIED, _unproven(result)
    why = f"λ = {lam:.4f} < 1: some samples' activation patterns do not match the update"
    if result.get("budget_exhausted"):
        why += "; the time budget ended the search"
    elif result.get("stopped") == "converged":
        why += "; the search ended when more rounds stopped improving it"
    readings = result.get("batch_size_readings") or []
    if len(readings) > 1:
        why += (f"; the noisy spectrum allowed B = {' or '.join(map(str, readings))}, "
                f"B = {B} explained the update best")
    return NOT_CERTIFIED, why
