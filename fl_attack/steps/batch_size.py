"""Choosing between two readings of the batch size of a noisy update.

Under DP-SGD noise the weakest samples' singular values sink towards the edge of the noise's
singular values: counted above a safe margin (``rank_margin`` x the edge) B comes out too small,
counted above the edge itself the extra directions are partly noise. Both readings are
attacked (``output_side.invert_output``); this module keeps the one whose reconstruction explains
the update better, as a statistician would choose between two models: the residual of the
update once each reconstructed sample's ∂L/∂Z is fitted on the units it activates, against
the noise's own size, with a penalty for the parameters fitted (Akaike's criterion).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fl_attack.core.clock import Clock
from fl_attack.result import Reconstruction
from fl_attack.validation import LayerUpdate


def explained_residual(weight_grad: torch.Tensor, bias_grad: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, inputs: torch.Tensor) -> tuple[float, int]:
    """Residual sum of squares of the update given reconstructed ``inputs`` (B, n), and the
    number of ∂L/∂Z entries fitted.

    Each unit j's row of the update is ``[∂L/∂W_j, ∂L/∂b_j] = Σ_i D_ji [x_i, 1]`` over the
    samples i the unit is active for (``W x_i + b > 0``): D_j is fitted by least squares on
    those samples, the rest is the residual. A reading that misses samples leaves their part
    of the update in the residual; one with wrong samples gets wrong activity patterns.
    """
    X = inputs.to(device=weight_grad.device, dtype=torch.float64)
    Y = torch.cat([weight_grad.double(), bias_grad.double()[:, None]], dim=1)  # (m, n + 1)
    Xt = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype, device=X.device)], dim=1)
    active = ((weight.double() @ X.T + bias.double()[:, None]) > 0).double()  # (m, B)
    P = (Y @ Xt.T) * active  # (m, B)
    gram = Xt @ Xt.T
    rss, chunk = 0.0, max(1, 2**22 // max(X.shape[0] ** 2, 1))
    for start in range(0, Y.shape[0], chunk):
        a = active[start:start + chunk]
        g = gram[None] * (a[:, :, None] * a[:, None, :]) + torch.diag_embed(1.0 - a)
        sol = torch.linalg.lstsq(g, P[start:start + chunk, :, None]).solution[:, :, 0]
        explained = (P[start:start + chunk] * sol).sum(dim=1)
        rss += float((Y[start:start + chunk].square().sum(dim=1) - explained).sum())
    return max(rss, 0.0), int(active.sum())


def criterion(rec: Reconstruction, layer: LayerUpdate) -> float:
    """Akaike's criterion of a reconstruction of a noisy update (smaller is better):
    residual / ν² + 2 x (inputs and ∂L/∂Z entries fitted). ν is the noise std the
    decomposition estimated (``Reconstruction.noise_std``)."""
    assert layer.weight is not None and layer.bias is not None
    rss, entries = explained_residual(layer.weight_grad, layer.bias_grad, layer.weight,
                                      layer.bias, rec.inputs)
    nu2 = max(rec.noise_std, torch.finfo(torch.float64).tiny) ** 2
    params = entries + rec.batch_size * rec.inputs.shape[1]
    return rss / nu2 + 2.0 * params


def choose(recs: Sequence[Reconstruction], layer: LayerUpdate, clock: Clock) -> Reconstruction:
    """The reconstruction (one per batch-size reading) that explains the update best.

    Without the layer's weight and bias there are no activity patterns to fit: the first
    (safest) reading is kept. The chosen one reports the whole call's seconds, every
    reading in ``batch_size_readings`` and a spent budget if any reading spent its share.
    """
    if layer.weight is None or layer.bias is None:
        best = recs[0]
    else:
        scores = [criterion(r, layer) for r in recs]
        best = recs[min(range(len(recs)), key=lambda i: (scores[i], i))]
        best.reading_scores = tuple(scores)
    best.batch_size_readings = tuple(r.batch_size for r in recs)
    best.seconds = clock.elapsed()
    best.budget_exhausted = any(r.budget_exhausted for r in recs)
    return best
