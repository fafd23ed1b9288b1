"""The text certificate: the recovered batch reproduces the update.

A batch is certified when all of these hold (``docs/algorithm.md``, "The text certificate"):

1. every token and every prefix was kept with a clear margin: the largest kept score (distance
   to the span over the tilt rounding alone explains, ``span.Span.score``) is at most
   ``MARGIN`` times smaller than the smallest rejected one;
2. the spans are fully explained: no span has more directions than the recovered batch has
   distinct inputs there (no position of the update is left unread);
3. every sentence has its last token, read with an integer coefficient;
4. the gradient of the mean next-token loss on the recovered batch, computed by the server from
   the model it sent, equals the update on every parameter read, up to one common scale, to
   ``RESIDUAL`` relative error (float32 rounding): a single wrong token changes the output
   layer's gradient by about ``1/√N`` of its norm over N labelled positions, and noise on the
   update shows there too. For a weight difference ``W₀ − W₁`` the rounding of storing ``W₁``
   is known entry by entry (``span.storage_rounding``): the residual may hold its energy,
   ``STORAGE_SLACK`` more, and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fl_attack.text.batch import logits_and_head_inputs, next_token_loss, padded

#: Kept scores must sit this many times below the nearest rejected one.
MARGIN = 3.0
#: Relative residual of the recomputed update, per parameter: the float32 disagreement of two
#: machines computing one gradient, with a margin. Measured on SmolLM2: 3e-7 to 3e-6 where the
#: client and the server compute alike, up to 1.1e-4 where their thread counts differ (a Flower
#: client on one thread, the audit on two). One wrong token leaves at least 0.4 (B = 1-16), and
#: at most ~1/√N over N labelled positions can hide it (0.04 at the width bound N = 576).
RESIDUAL = 1e-3
#: A weight difference's residual energy may exceed the storage rounding's expected energy
#: (plus ``RESIDUAL``'s) by this fraction. Measured on correct SmolLM2 reads (B = 1-16, lr 0.01
#: to 0.5): 0.98-1.01 of it, and 1.07 on SmolLM2's own GGUF-grid weights; one wrong token
#: leaves 40x more than allowed.
STORAGE_SLACK = 0.25


@dataclass
class Recomputed:
    """The update the recovered batch would have produced, against the one observed.

    Attributes
    ----------
    scale : float
        α fitted over every parameter at once (observed ≈ α × recomputed).
    residuals : dict[str, float]
        Per parameter, ``‖observed − α recomputed‖ / ‖observed‖``.
    allowed : dict[str, float]
        Per parameter, the largest residual that rounding explains: ``RESIDUAL``, and for a
        weight difference the storage rounding's expected norm (``STORAGE_SLACK`` more energy)
        relative to ``‖observed‖`` beside it.
    """

    scale: float
    residuals: dict[str, float]
    allowed: dict[str, float]

    @property
    def worst(self) -> float:
        """The largest residual."""
        return max(self.residuals.values())

    @property
    def unexplained(self) -> dict[str, float]:
        """The parameters whose residual rounding does not explain, with their residual."""
        return {n: r for n, r in self.residuals.items() if r > self.allowed[n]}


def recompute(model: nn.Module, sentences: Sequence[Sequence[int]],
              observed: Mapping[str, torch.Tensor],
              rounding: Mapping[str, torch.Tensor] | None = None,
              labels: Sequence[int] | None = None) -> Recomputed:
    """Recompute the gradient of the parameters in ``observed`` on ``sentences`` and compare.

    Parameters
    ----------
    model
        The model the client started from (eval mode: no dropout).
    sentences
        The recovered batch, whole sentences.
    observed
        Parameter name → the update observed for it (same shape as the parameter).
    rounding
        For a weight difference: parameter name → per entry, the standard deviation of the
        storage rounding (``span.storage_rounding``).
    labels
        For a sequence classifier: each sentence's class (the model's own mean cross-entropy,
        ``labels=``); None for next-token loss.
    """
    params = dict(model.named_parameters())
    names = list(observed)
    device = params[names[0]].device
    ids, mask = padded(sentences, device)
    with torch.enable_grad():
        if labels is not None:
            loss = model(input_ids=ids, attention_mask=mask,
                         labels=torch.as_tensor(list(labels), device=device)).loss
        else:
            logits, _ = logits_and_head_inputs(model, ids, mask)
            loss, _ = next_token_loss(logits, ids, mask)
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    obs = [observed[n].double() for n in names]
    rec = [torch.zeros_like(o) if g is None else g.double() for g, o in zip(grads, obs,
                                                                              strict=True)]
    num = sum(float((o * r).sum()) for o, r in zip(obs, rec, strict=True))
    den = sum(float((r * r).sum()) for r in rec)
    alpha = num / den if den > 0 else 0.0
    norms = {n: float(o.norm().clamp_min(1e-300)) for n, o in zip(names, obs, strict=True)}
    residuals = {n: float((o - alpha * r).norm()) / norms[n]
                 for n, o, r in zip(names, obs, rec, strict=True)}
    allowed = {}
    for n in names:
        energy = RESIDUAL ** 2
        if rounding is not None and n in rounding:
            energy += (1 + STORAGE_SLACK) * float(rounding[n].pow(2).sum()) / norms[n] ** 2
        allowed[n] = energy ** 0.5
    return Recomputed(alpha, residuals, allowed)


@dataclass
class Labels:
    """The classes read off a classification head's update.

    Attributes
    ----------
    labels : list[int]
        Per sentence, its class.
    scale : float
        The update's scale α (observed ≈ α × the gradient of the mean cross-entropy).
    """

    labels: list[int]
    scale: float


@torch.no_grad()
def read_labels(model: nn.Module, head: nn.Linear, sentences: Sequence[Sequence[int]],
                observed: torch.Tensor) -> Labels | None:
    """Each sentence's class from the head's weight update, once the sentences are known.

    The head's gradient is ``(α/B) Σ_i (p_i − e_{y_i}) h_iᵀ``: with every ``h_i`` (the head's
    input) and ``p_i`` (the softmax) computed from the recovered batch, the coefficients
    ``r_i = α (p_i − e_{y_i})`` are solved for; the label is the one negative entry, α the
    ratio ``r_ic / p_ic`` of the others. None where the inputs are dependent (solution not
    unique) or no entry is negative. The recomputed update then judges the reading.
    """
    ids, mask = padded(sentences, head.weight.device)
    logits, inputs = logits_and_head_inputs(model, ids, mask, head)
    h = inputs.double()                                    # (B, d)
    p = torch.softmax(logits.double(), dim=-1)             # (B, C)
    gram = h @ h.T
    if torch.linalg.matrix_rank(gram) < len(sentences):
        return None
    r = torch.linalg.solve(gram, h @ observed.double().T) * len(sentences)   # (B, C)
    labels, ratios = [], []
    for ri, pi in zip(r, p, strict=True):
        y = int(ri.argmin())
        if float(ri[y]) >= 0:
            return None
        others = [c for c in range(len(pi)) if c != y]
        labels.append(y)
        ratios += [float(ri[c] / pi[c]) for c in others]
    return Labels(labels, float(torch.tensor(ratios).median()) if ratios else 1.0)
