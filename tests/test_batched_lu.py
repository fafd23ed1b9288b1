"""fl_attack.core.batched_lu: large CPU batches of LU solves finish and give torch's answers."""

import subprocess
import sys

import pytest
import torch

from fl_attack.core import batched_lu


def _spd(batch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    A = torch.randn(batch, n, n + 5, generator=g, dtype=torch.float64)
    return A @ A.transpose(1, 2)


@pytest.mark.parametrize("n", [8, batched_lu.ONE_THREAD_FROM + 2])
def test_same_answers_as_torch_and_the_thread_count_comes_back(n):
    A, B = _spd(3, n), torch.ones(3, n, 2, dtype=torch.float64)
    before = torch.get_num_threads()
    X, info = batched_lu.solve_ex(A, B)
    assert torch.allclose(A @ X, B, atol=1e-8) and not bool(info.any())
    assert torch.allclose(batched_lu.inv(A) @ A, torch.eye(n, dtype=torch.float64), atol=1e-8)
    assert torch.get_num_threads() == before


def test_a_singular_matrix_is_reported_and_the_thread_count_still_comes_back():
    n = batched_lu.ONE_THREAD_FROM
    A = _spd(2, n)
    A[1] = 0.0
    before = torch.get_num_threads()
    _, info = batched_lu.solve_ex(A, torch.ones(2, n, 1, dtype=torch.float64))
    assert int(info[0]) == 0 and int(info[1]) != 0
    with pytest.raises(torch.linalg.LinAlgError):
        batched_lu.inv(A)
    assert torch.get_num_threads() == before


def test_rank_deficient_batch_of_210_rows_finishes_with_two_threads():
    # torch.linalg.solve_ex on this batch with two torch threads hung in MKL's getrf on the
    # 2-core machines this project runs on ("Parameter 6 was incorrect on entry to DLASWP")
    code = (
        "import torch\n"
        "from fl_attack.core import batched_lu\n"
        "torch.set_num_threads(2)\n"
        "A = torch.randn(3, 210, 210, dtype=torch.float64)\n"
        "A[1] = A[1][:, :5] @ A[1][:5, :]\n"
        "A[2] = 0.0\n"
        "for _ in range(3):\n"
        "    X, info = batched_lu.solve_ex(A, torch.ones(3, 210, 210, dtype=torch.float64))\n"
        "assert int(info[2]) != 0 and torch.get_num_threads() == 2\n"
        "print('finished')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished" in done.stdout
