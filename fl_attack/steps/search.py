"""Step 2 of SPEAR++ (SPEAR++ §4.2): sparse directions as local minima of φ(L q) on the sphere.

All K random initialisations are optimised together as one (K, B) matrix, so each step is two
dense matrix products, on whatever device ``L`` lives on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from fl_attack.core.clock import passed
from fl_attack.core.tuning import TUNING


def _geoopt() -> ModuleType:
    """geoopt, imported on first use: at import it calls ``torch.jit.script``, which torch
    deprecates with a FutureWarning that says nothing about this package. Exactly that warning
    is silenced, here only; the first import pays geoopt's import time (~0.1 s)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                                category=FutureWarning)
        import geoopt
    return geoopt


def sparsity_loss(V: torch.Tensor, loss: str, alpha: float) -> torch.Tensor:
    """Σ_j φ(v_j) per row of V (..., K, m); ``alpha`` is LogCosh's sharpness on unit-RMS entries."""
    if loss == "l1":
        return V.abs().sum(dim=-1)
    if loss == "logcosh":
        scale = V.detach().square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-30)
        a = alpha / scale
        # log cosh(x) = |x| + log1p(exp(-2|x|)) - log 2, stable for large |x|
        x = (a * V).abs()
        return ((x + torch.log1p(torch.exp(-2 * x)) - 0.6931471805599453) / a).sum(dim=-1)
    if loss == "l4":
        return -V.pow(4).sum(dim=-1)
    raise ValueError(f"unknown loss {loss!r}; choose 'l1', 'logcosh' or 'l4'")


def signed_sparsity_loss(V: torch.Tensor, loss: str, alpha: float,
                         kappa: float = TUNING.sign_penalty) -> torch.Tensor:
    """φ(v) + κ min(Σ_j v_j⁺, Σ_j v_j⁻) per row of ``V`` (..., K, n).

    The inputs of a layer preceded by a ReLU are non-negative and, on real data, share most of
    their zeros, so differences of two inputs are about as ℓ1-sparse as the inputs themselves
    and plain ℓ1 stalls at them. The penalty charges a direction for its minority-sign mass:
    ±x_i (one sign) pays nothing extra, mixtures with opposite signs do.
    """
    pos = V.clamp_min(0).sum(dim=-1)
    neg = (-V).clamp_min(0).sum(dim=-1)
    return sparsity_loss(V, loss, alpha) + kappa * torch.minimum(pos, neg)


def random_sphere(K: int, B: int, *, generator: torch.Generator, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """K points drawn uniformly from the unit sphere in R^B, as rows."""
    X = torch.randn(K, B, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    return X / X.norm(dim=1, keepdim=True)


CHECK_EVERY = 10
"""Steps between two looks at the deadline of :func:`optimise_on_sphere`."""


def _past(deadline: float | None, step: int) -> bool:
    return step > 0 and step % CHECK_EVERY == 0 and passed(deadline)


def optimise_on_sphere(
    L: torch.Tensor,
    init: torch.Tensor,
    *,
    loss: str = "l1",
    optimizer: str = "radam",
    steps: int = 300,
    lr: float | None = None,
    milestones: tuple[float, ...] = (0.4, 0.8),
    gamma: float = 0.1,
    alpha: float = 20.0,
    objective: Callable[[torch.Tensor], torch.Tensor] | None = None,
    deadline: float | None = None,
) -> torch.Tensor:
    """Minimise φ(L q) over the sphere from each row of ``init`` (K, B); returns (B, K) columns.

    ``objective`` replaces φ: it maps the rows of ``V = init @ Lᵀ`` (..., K, m) to one loss each
    (the input side adds a sign penalty, ``fl_attack.solver.input_side``).

    ``L`` (m, B) fixes device and dtype. A stack of problems (F, m, B) with ``init`` (F, K, B)
    is solved in one batch and returns (F, B, K); zero padding rows of L do not change φ.
    Riemannian Adam is geoopt's; PGD takes a Euclidean gradient step on the mean loss and
    renormalises. ``deadline`` (a ``time.perf_counter()`` value) stops the steps early, checked
    every :data:`CHECK_EVERY` steps: the caller's time budget, the iterates as they are then.

    Parameters
    ----------
    L : (m, B) or (F, m, B)
        The factor (or a stack of factors) whose sparse directions are sought.
    init : (K, B) or (F, K, B)
        Starting points on the unit sphere.
    loss, optimizer, steps, lr, milestones, gamma, alpha
        φ, the optimiser and its schedule (``AttackConfig``).
    objective
        Replaces φ (see above).
    deadline
        A ``time.perf_counter()`` value, or None.

    Returns
    -------
    torch.Tensor
        (B, K) (or (F, B, K)) the optimised unit directions, in ``L``'s dtype.

    Raises
    ------
    ValueError
        An unknown loss or optimizer.
    """
    L = L.detach()
    Lt = L.transpose(-1, -2).contiguous()
    X0 = init.to(device=L.device, dtype=L.dtype)
    marks = sorted({int(f * steps) for f in milestones})
    if objective is None:
        def objective(V: torch.Tensor) -> torch.Tensor:
            return sparsity_loss(V, loss, alpha)
    if optimizer == "radam":
        X = _radam(Lt, X0, objective, steps, 0.1 if lr is None else lr, marks, gamma, deadline)
    elif optimizer == "pgd":
        X = _pgd(Lt, X0, objective, steps, 5.0 if lr is None else lr, marks, gamma, deadline)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose 'radam' or 'pgd'")
    return X.transpose(-1, -2).contiguous()


Objective = Callable[[torch.Tensor], torch.Tensor]


def _radam(Lt: torch.Tensor, X0: torch.Tensor, objective: Objective, steps: int, lr: float,
           marks: list[int], gamma: float, deadline: float | None) -> torch.Tensor:
    """Riemannian Adam (geoopt) on the sphere from the rows of ``X0``; the final rows."""
    geoopt = _geoopt()
    param = geoopt.ManifoldParameter(X0.clone(), manifold=geoopt.Sphere())
    opt = geoopt.optim.RiemannianAdam([param], lr=lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=gamma)
    for it in range(steps):
        if _past(deadline, it):
            break
        opt.zero_grad(set_to_none=True)
        objective(param @ Lt).sum().backward()
        opt.step()
        sched.step()
    return param.detach()


def _pgd(Lt: torch.Tensor, X0: torch.Tensor, objective: Objective, steps: int, lr: float,
         marks: list[int], gamma: float, deadline: float | None) -> torch.Tensor:
    """Projected gradient descent on the mean loss: a Euclidean step, then renormalise."""
    m = Lt.shape[-1]
    X = X0.clone().requires_grad_(True)
    step = lr
    for it in range(steps):
        if _past(deadline, it):
            break
        if it in marks:
            step *= gamma
        (grad,) = torch.autograd.grad((objective(X @ Lt) / m).sum(), X)
        with torch.no_grad():
            X -= step * grad
            X /= X.norm(dim=-1, keepdim=True)
    return X.detach()


def random_complement(found: torch.Tensor, K: int, *, generator: torch.Generator,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """K uniform unit starting points (K, B) in the orthogonal complement of ``found`` (B, F).

    On real data most random starts fall into the basins of a few columns, found first
    again and again. Starts orthogonal to the columns already found leave the landscape as it
    is (its minima are still the sparse directions) but land in the basins of the missing
    ones far more often (tested in tests/test_steps.py).
    """
    B = found.shape[0]
    Fq = found.double().cpu()
    U, _, _ = torch.linalg.svd(Fq / Fq.norm(dim=0, keepdim=True), full_matrices=True)
    N = U[:, Fq.shape[1]:]  # (B, k)
    c = torch.randn(K, N.shape[1], generator=generator, dtype=torch.float64)
    X = c @ N.T
    X = X / X.norm(dim=1, keepdim=True)
    assert X.shape == (K, B)
    return X.to(device=device, dtype=dtype)
