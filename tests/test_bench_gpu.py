"""The GPU benchmark's contract (``python -m experiments.bench_gpu``), and the attack's
device-dependent paths.

The benchmark needs CUDA; its ``--smoke`` run is the same code on two tiny settings on the CPU,
run here in a subprocess so that the command keeps working. The table's columns, its rows and
the device it names are checked, not what the attack found. A failing batch and a passed
``--deadline`` end up in the table, and ``--device cuda`` without CUDA is a clear usage error.

The GPU-oriented steps are checked on the CPU: the batched face bases give the faces the
one-direction-at-a-time code gave, and the factorisations that replace loops of SVDs on CUDA
(``kernels.slow_batched_solves``), forced here, span what the SVDs span.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from experiments import bench_gpu
from fl_attack.core import kernels
from fl_attack.core.columns import zero_mask
from fl_attack.steps import completion, faces
from fl_attack.steps.decompose import decompose
from fl_attack.testbed import data, models

ROOT = Path(__file__).resolve().parents[1]
SMOKE_ROWS = ["(8, 100)", "(12, 200) + next layer"]


def _last_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the last Markdown table in ``text``."""
    blocks, block = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip("|").split("|")])
        elif block:
            blocks.append(block)
            block = []
    if block:
        blocks.append(block)
    assert blocks, "no table written"
    header, _rule, *rows = blocks[-1]
    return header, rows


def test_smoke_run_writes_its_table(tmp_path: Path) -> None:
    """``--smoke`` runs on the CPU in a subprocess, exits 0 and appends one line per batch and
    a table with one row per smoke setting, on the device named "cpu"."""
    out = tmp_path / "smoke.md"
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_gpu", "--smoke", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text(encoding="utf-8")
    header, rows = _last_table(text)
    assert header == list(bench_gpu.COLUMNS)
    assert [r[0] for r in rows] == SMOKE_ROWS
    assert all(r[1] == "cpu" and r[2] == "1 of 1" and r[7] == "—" for r in rows)
    lines = [ln for ln in text.splitlines() if ln.startswith("- (")]
    assert len(lines) == 2 and all(" on cpu, budget " in ln for ln in lines)
    assert "bench_gpu --smoke" in text and "device cpu" in text


def test_failed_batches_and_the_deadline_are_in_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose attack raises is a failed batch of the table and the run goes on; past
    ``--deadline`` no batch starts, and the table and its note say so. Exit status 0."""
    def boom(*args: object, **kw: object) -> None:
        raise MemoryError("no memory left for this batch")

    monkeypatch.setattr(bench_gpu.fl_attack, "invert", boom)
    out = tmp_path / "failed.md"
    assert bench_gpu.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    _, rows = _last_table(text)
    assert [r[2] for r in rows] == ["0 of 1 (1 failed)"] * 2
    assert text.count("failed, MemoryError: no memory left for this batch") == 2
    late = tmp_path / "late.md"
    assert bench_gpu.main(["--smoke", "--deadline", "1e-9", "--out", str(late)]) == 0
    text = late.read_text(encoding="utf-8")
    _, rows = _last_table(text)
    assert [r[2] for r in rows] == ["0 of 1 (1 not started: deadline)"] * 2
    assert "passed: 2 batch(es) not started" in text


def test_cuda_without_cuda_is_a_usage_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as stop:
        bench_gpu.main(["--device", "cuda", "--out", str(tmp_path / "x.md")])
    assert stop.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()


# ---------------------------------------------------------------------------------------------
# the batched and device-dependent steps, on the CPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer() -> dict[str, torch.Tensor]:
    """A real (20, 200) photo batch: L, the true unit columns Q (L Q = ∂L/∂Z up to scale)."""
    x, y = data.sample_batch("photos32", 20, seed=1)
    xn = data.normalize(x, "photos32")
    model = models.relu_mlp(xn[0].numel(), 200, 3, seed=1)
    G, _ = models.first_layer_gradients(model, xn, y)
    lin = models.linear_layers(model)[0]
    outs: list[torch.Tensor] = []
    hook = lin.register_forward_hook(lambda _m, _a, out: outs.append(out))
    loss = nn.functional.cross_entropy(model(xn), y)
    (D,) = torch.autograd.grad(loss, outs[0])
    hook.remove()
    L = decompose(G).L
    Q = L.T @ D.detach().double().T
    return {"L": L, "Q": Q / Q.norm(dim=0)}


def _old_face_basis(L: torch.Tensor, q: torch.Tensor, n_rows: int, rtol: float
                    ) -> torch.Tensor:
    """The one-direction face basis as the attack computed it before the batches."""
    idx = (L @ q).abs().topk(n_rows, largest=False).indices
    Ls = L[idx]
    tol = n_rows * rtol**2 / L.shape[0]
    for _ in range(2):
        vals, vecs = torch.linalg.eigh(Ls.T @ Ls)
        k = max(int((vals <= tol).sum()), 1)
        lev = ((Ls @ vecs[:, k:]) ** 2 / vals[k:]).sum(dim=1)
        keep = lev < 0.99
        if bool(keep.all()) or int(keep.sum()) < L.shape[1]:
            break
        Ls = Ls[keep]
    return vecs[:, :k]


def _same_span(A: torch.Tensor, B: torch.Tensor, tol: float = 1e-8) -> bool:
    return A.shape == B.shape and bool(((A @ A.T) - (B @ B.T)).abs().max() < tol)


def test_batched_face_bases_are_the_faces_one_at_a_time(layer: dict[str, torch.Tensor]) -> None:
    """Mixtures of the pairs of samples sharing most zero rows, and vertices of those faces
    (one more zero by cancellation): the batched bases have the dimensions and spans of the
    one-direction code, and ``candidate_faces`` yields the faces in column order."""
    L, Qt, rtol = layer["L"], layer["Q"], 1e-4
    zero = zero_mask(L @ Qt, rtol).double()
    shared = zero.T @ zero
    shared.fill_diagonal_(-1)
    pairs = [divmod(int(i), 20) for i in shared.flatten().topk(12).indices[::2]]
    mixes = torch.stack([Qt[:, i] + Qt[:, j] for i, j in pairs], dim=1)
    mixes = mixes / mixes.norm(dim=0)
    n_rows = int(min(shared[i, j] for i, j in pairs))
    vecs, dims = faces.face_bases(L, mixes, n_rows, rtol)
    for j in range(mixes.shape[1]):
        old = _old_face_basis(L, mixes[:, j], n_rows, rtol)
        assert _same_span(vecs[j, :, : int(dims[j])], old)
    assert int((dims == 2).sum()) >= 3
    got = list(faces.candidate_faces(L, mixes, n_rows=n_rows, zero_rtol=rtol, chunk_elems=1))
    want = [j for j in range(mixes.shape[1]) if 2 <= int(dims[j]) <= 8]
    assert len(got) == len(want)
    assert all(_same_span(N, vecs[j, :, : int(dims[j])]) for (N, _), j in zip(got, want,
                                                                               strict=True))
    # a vertex of each face: the mixture that vanishes on one more row
    verts = []
    for i, j in pairs:
        a, b = L @ Qt[:, i], L @ Qt[:, j]
        r = int(torch.argmax(a.abs() * b.abs()))
        verts.append(Qt[:, i] * b[r] - Qt[:, j] * a[r])
    V = torch.stack(verts, dim=1)
    V = V / V.norm(dim=0)
    vvecs, vdims = faces.vertex_face_bases(L, V, rtol)
    for j in range(V.shape[1]):
        one = faces.vertex_face_basis(L, V[:, j], rtol)
        assert _same_span(vvecs[j, :, : int(vdims[j])], one)
        if int(vdims[j]) == 2:  # the face is the pair's span
            i, k = pairs[j]
            assert _same_span(one, torch.linalg.qr(Qt[:, [i, k]]).Q, 1e-6)
    assert int((vdims == 2).sum()) >= 3


def test_restricted_ranges_by_cholesky_span_the_svd_ranges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The neighbour search's restricted problems, by SVD (CPU) and by Cholesky factors (the
    CUDA path, forced): orthonormal bases of the same ranges, maps back orthogonal to q."""
    gen = torch.Generator().manual_seed(0)
    Lz = torch.randn(5, 300, 40, generator=gen, dtype=torch.float64)
    Lz[:, 250:] = 0  # padding rows
    q = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    U1, V1, s1 = faces._restricted_ranges(Lz, q)
    monkeypatch.setattr(kernels, "slow_batched_solves", lambda t: True)
    U2, V2, s2 = faces._restricted_ranges(Lz, q)
    eye = torch.eye(39, dtype=torch.float64)
    for U, V, s in ((U1, V1, s1), (U2, V2, s2)):
        assert torch.allclose(U.transpose(1, 2) @ U, eye, atol=1e-9)
        assert torch.allclose(Lz @ V * s[:, None, :], U, atol=1e-12)
        assert float((q[:, None, :] @ V).abs().max()) < 1e-12
    assert torch.allclose(U1 @ U1.transpose(1, 2), U2 @ U2.transpose(1, 2), atol=1e-9)


def test_conditional_directions_by_cholesky(layer: dict[str, torch.Tensor],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The neighbour search on the CUDA path (forced): one unit seed per start and column."""
    monkeypatch.setattr(kernels, "slow_batched_solves", lambda t: True)
    L, found = layer["L"], layer["Q"][:, :6]
    out = faces.conditional_directions(L, found, zero_rtol=1e-4, n_init=4, steps=20,
                                       generator=torch.Generator().manual_seed(0))
    assert out.shape == (20, 24) and bool(torch.isfinite(out).all())
    assert torch.allclose(out.norm(dim=0), torch.ones(24, dtype=out.dtype))


def test_dual_slice_by_qr_is_the_svd_slice(layer: dict[str, torch.Tensor],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The slice left for the missing samples, from the SVD (CPU) and from the complete QR
    factor (the CUDA path, forced): the same closest point and the same directions."""
    Qt = layer["Q"]
    found, t = Qt[:, :15], Qt @ torch.linspace(1.0, 2.0, 20, dtype=torch.float64)
    N1, v1, U1 = completion.dual_slice(found, t)
    monkeypatch.setattr(kernels, "slow_batched_solves", lambda t: True)
    N2, v2, U2 = completion.dual_slice(found, t)
    assert float((found.T @ N2).abs().max()) < 1e-12
    assert torch.allclose(N1 @ v1, N2 @ v2, atol=1e-10)
    assert _same_span(N1 @ U1, N2 @ U2, 1e-10)


def test_full_plan_table_with_a_stand_in_device(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The full plan as on a GPU, with the attacks stood in for (no CUDA needed): the device
    runs every setting first, then the CPU the two small ones; the rows name the device and
    give the CPU's median and the ratio where the CPU ran."""
    order: list[tuple[str, str]] = []

    def fake(setting: bench_gpu.Setting, seed: int, device: str, budget: float, dataset: str,
             capped: bool = False) -> bench_gpu.Outcome:
        order.append((setting.label, device))
        secs = (4.0 if device == "cpu" else 1.0) * (seed + 1)
        return bench_gpu.Outcome(setting, seed, device, budget, capped, seconds=secs,
                                 psnr=120.0, certified=True, found=setting.B,
                                 batch_size=setting.B, lam=1.0)

    monkeypatch.setattr(bench_gpu, "run_batch", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    out = tmp_path / "full.md"
    assert bench_gpu.main(["--out", str(out)]) == 0
    cuda_runs = [label for label, dev in order if dev == "cuda"]
    assert cuda_runs[0] == "(8, 100)"  # the warm-up
    assert cuda_runs[1:] == ["(20, 200)"] * 3 + ["(100, 1000)"] * 2 + ["(150, 4000)"] * 2 + [
        "(210, 4000) + next layer"]
    assert [label for label, dev in order if dev == "cpu"] == ["(20, 200)"] * 3 + [
        "(100, 1000)"] * 2
    assert order.index(("(20, 200)", "cpu")) > order.index(("(210, 4000) + next layer", "cuda"))
    _, rows = _last_table(out.read_text(encoding="utf-8"))
    assert [r[0] for r in rows] == [s.label for s in bench_gpu.PLAN]
    assert all(r[1] == "Stand-in GPU" for r in rows)
    assert [r[2] for r in rows] == ["3 of 3", "2 of 2", "2 of 2", "1 of 1"]
    assert [r[6:] for r in rows] == [["2.00", "8.00", "4.00"], ["1.50", "6.00", "4.00"],
                                     ["1.50", "—", "—"], ["1.00", "—", "—"]]
