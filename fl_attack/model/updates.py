"""Server side: turn the weights a client sends back into the pair the attack inverts.

SPEAR App. F: for a linear layer followed by a ReLU, a FedSGD or FedAvg weight delta has the same
low-rank structure as the gradient, ``W0 - W_E = lr * sum_e (dL/dZ_e) X^T`` and
``b0 - b_E = lr * sum_e (dL/dZ_e) 1``. The learning rate is a common scale that cancels in the
attack's scale fix, so the server can attack ``(W0 - W_E, b0 - b_E)`` exactly like a gradient,
without knowing ``lr``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from fl_attack.errors import ZeroUpdate

ArrayLike = Tensor | np.ndarray


def _as_f64(value: object, key: str) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(device="cpu", dtype=torch.float64)
    if isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.number) or np.iscomplexobj(value):
            raise ValueError(f"{key!r} is not a real numeric array (dtype {value.dtype})")
        return torch.from_numpy(np.asarray(value, dtype=np.float64))
    raise ValueError(f"{key!r} is neither a torch tensor nor a numpy array: {type(value).__name__}")


def _is_float(value: object) -> bool:
    """Whether ``value`` (a torch tensor or anything with a numpy dtype) holds real floats."""
    if isinstance(value, Tensor):
        return value.is_floating_point()
    dtype = getattr(value, "dtype", None)
    return dtype is not None and np.issubdtype(np.dtype(dtype), np.floating)


def _bias_key_for(weight_key: str) -> str:
    if weight_key.endswith("weight"):
        return weight_key[: -len("weight")] + "bias"
    raise ValueError(
        f"cannot derive the bias key from weight key {weight_key!r} (it does not end in "
        "'weight'); pass bias_key"
    )


def layer_keys(state: Mapping[str, ArrayLike]) -> list[tuple[str, str]]:
    """List the ``(weight_key, bias_key)`` pairs of the linear layers of ``state``, in order.

    A linear layer is a 2-d entry whose key ends in ``weight`` and whose matching ``...bias`` entry
    exists and is 1-d with one value per output row. For ``fl_attack.testbed.models.relu_mlp`` this
    gives ``[("1.weight", "1.bias"), ("3.weight", "3.bias"), ...]`` (index 0 is ``nn.Flatten``).
    Layers without a bias are left out: the SPEAR attack needs the bias update to fix the scales.
    So are integer and other non-float arrays (a quantised layer's codes, a buffer named
    ``...weight``): their differences are no gradient.
    """
    pairs: list[tuple[str, str]] = []
    for key, value in state.items():
        if not key.endswith("weight") or len(tuple(value.shape)) != 2 or not _is_float(value):
            continue
        bias_key = _bias_key_for(key)
        bias = state.get(bias_key)
        if bias is None or tuple(bias.shape) != (tuple(value.shape)[0],) or not _is_float(bias):
            continue
        pairs.append((key, bias_key))
    return pairs


def weight_update_pair(
    global_state: Mapping[str, ArrayLike],
    new_state: Mapping[str, ArrayLike],
    *,
    weight_key: str | None = None,
    bias_key: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return ``(W0 - W_E, b0 - b_E, W0, b0)`` (float64 CPU tensors) for one linear layer.

    ``global_state`` holds the weights the server sent (``W0``), ``new_state`` those the client sent
    back (``W_E``). Both may hold torch tensors or numpy arrays (e.g. a Flower ``ArrayRecord``
    converted to numpy). The difference is formed in float64, after converting each state.

    Args:
        global_state: the global model's state dict at round start.
        new_state: the client's returned state dict.
        weight_key: the layer's weight key; default: the first linear layer in state-dict order
            (see :func:`layer_keys`), e.g. ``"1.weight"`` for ``relu_mlp``.
        bias_key: the layer's bias key; default: ``weight_key`` with ``weight`` replaced by
            ``bias``.

    Raises:
        ValueError: a key is missing from either state, the states' shapes disagree, the layer is
            not ``(m, d)`` weight + ``(m,)`` bias, or a value is non-finite.
        fl_attack.errors.ZeroUpdate: the weight update is identically zero (``part``
            ``"update"``: the client sent back the global model unchanged; ``"weight"``: only the
            bias changed).
    """
    weight_key, bias_key = _resolve_keys(global_state, weight_key, bias_key)
    for name, state in (("global_state", global_state), ("new_state", new_state)):
        for key in (weight_key, bias_key):
            if key not in state:
                raise ValueError(f"{name} has no key {key!r}; keys: {list(state)}")

    w0 = _as_f64(global_state[weight_key], weight_key)
    b0 = _as_f64(global_state[bias_key], bias_key)
    w1 = _as_f64(new_state[weight_key], weight_key)
    b1 = _as_f64(new_state[bias_key], bias_key)

    if w0.ndim != 2:
        raise ValueError(f"{weight_key!r} must be 2-d (out, in), got shape {tuple(w0.shape)}")
    if b0.shape != (w0.shape[0],):
        raise ValueError(
            f"{bias_key!r} must have shape ({w0.shape[0]},) to match {weight_key!r} "
            f"{tuple(w0.shape)}, got {tuple(b0.shape)}"
        )
    for key, a, b in ((weight_key, w0, w1), (bias_key, b0, b1)):
        if a.shape != b.shape:
            raise ValueError(
                f"shape mismatch for {key!r}: global {tuple(a.shape)} vs new {tuple(b.shape)}"
            )
    for name, key, t in (
        ("global_state", weight_key, w0),
        ("global_state", bias_key, b0),
        ("new_state", weight_key, w1),
        ("new_state", bias_key, b1),
    ):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}[{key!r}] contains non-finite values (NaN or inf)")

    dw = w0 - w1
    db = b0 - b1
    _check_nonzero(dw, db, weight_key, bias_key)
    return dw, db, w0, b0


def _resolve_keys(global_state: Mapping[str, ArrayLike], weight_key: str | None,
                  bias_key: str | None) -> tuple[str, str]:
    """The layer's (weight, bias) keys: given, or the first linear layer of the state."""
    if weight_key is None:
        if bias_key is not None:
            raise ValueError("bias_key given without weight_key")
        pairs = layer_keys(global_state)
        if not pairs:
            raise ValueError(
                "global_state has no linear layer (2-d '...weight' with a matching '...bias'); "
                f"keys: {list(global_state)}"
            )
        return pairs[0]
    return weight_key, bias_key if bias_key is not None else _bias_key_for(weight_key)


def _check_nonzero(dw: Tensor, db: Tensor, weight_key: str, bias_key: str) -> None:
    """:class:`~fl_attack.errors.ZeroUpdate` for an update that carries nothing to invert."""
    if not bool(dw.any()):
        if not bool(db.any()):
            raise ZeroUpdate(
                f"update of {weight_key!r}/{bias_key!r} is identically zero: the client sent back "
                "the global model unchanged", part="update"
            )
        raise ZeroUpdate(
            f"weight update of {weight_key!r} is identically zero (only the bias changed): "
            "there is nothing to invert", part="weight"
        )
