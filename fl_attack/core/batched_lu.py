"""Batched LU solves on the CPU that cannot hang.

PyTorch's CPU build runs a batch of LU factorisations (``torch.linalg.solve_ex``, ``inv``) in a
parallel loop over the batch, and each one calls MKL's ``getrf``. With more than one torch
thread and matrices of a few hundred rows (B = 210 here), MKL's threaded ``getrf`` inside that
loop was seen to print "Parameter 6 was incorrect on entry to DLASWP" and then never return:
an attack at B = 210 hung in the face bases on a 2-core machine. Run one matrix after the
other (one torch thread) the same factorisations finish, with the same per-matrix arithmetic.
The functions here do that for large CPU batches and call torch directly otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

#: Matrices of at least this many rows are factorised one torch thread at a time on the CPU
#: (the hang was seen at 210 rows, never up to 150).
ONE_THREAD_FROM = 128

_lock = threading.Lock()
_depth = 0
_saved = 1


@contextlib.contextmanager
def _one_torch_thread(A: torch.Tensor) -> Iterator[None]:
    """One torch thread while a large batch of CPU matrices is factorised (nestable, and safe
    for concurrent callers: the thread count is restored when the last one leaves)."""
    global _depth, _saved
    if A.device.type != "cpu" or A.dim() < 3 or A.shape[-1] < ONE_THREAD_FROM:
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.set_num_threads(_saved)


def solve_ex(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.solve_ex(A, B)``, safe for large CPU batches (module docstring).

    Parameters
    ----------
    A : (..., n, n)
        The matrices.
    B : (..., n, k)
        The right-hand sides.

    Returns
    -------
    (X, info)
        As ``torch.linalg.solve_ex``: ``info`` is non-zero where a matrix is singular.
    """
    with _one_torch_thread(A):
        X, info = torch.linalg.solve_ex(A, B)
    return X, info


def inv(A: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.inv(A)``, safe for large CPU batches (module docstring).

    Parameters
    ----------
    A : (..., n, n)
        Invertible matrices (``torch.linalg.inv`` raises on a singular one).

    Returns
    -------
    torch.Tensor
        Their inverses.
    """
    with _one_torch_thread(A):
        return torch.linalg.inv(A)


def inv_ex(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.inv_ex(A)``, safe for large CPU batches (module docstring).

    Parameters
    ----------
    A : (..., n, n)
        Square matrices, some possibly singular.

    Returns
    -------
    (inverse, info)
        As ``torch.linalg.inv_ex``: ``info`` is non-zero where a matrix is singular (its
        "inverse" is then meaningless).
    """
    with _one_torch_thread(A):
        return torch.linalg.inv_ex(A)
