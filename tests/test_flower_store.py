"""Audit storage: owner-only permissions, atomic and append-only writes, no overwrite, summary,
the verdict and the report."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from fl_attack_flwr.output.png import MARK_RGB, image_grid
from fl_attack_flwr.output.private_files import atomic_write_bytes, jsonable, records_from_jsonl
from fl_attack_flwr.output.report import render_report
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.results.records import ClientAudit


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _record(rnd: int, pid: int | None, *, gt: bool, rng: np.random.Generator,
            **kw: object) -> ClientAudit:
    images = rng.random((4, 1, 28, 28))
    return ClientAudit(
        server_round=rnd, node_id=1000 + (pid or 0), partition_id=pid, status="certified",
        protocol="fedsgd", num_examples=4, batch_size=4, sparsity_match=1.0, exact=True,
        n_directions=4, attack_seconds=0.5, inputs=rng.standard_normal((4, 784)),
        recon_images=images, original_images=images if gt else None,
        psnr=[120.0] * 4 if gt else None, psnr_mean=120.0 if gt else None,
        sample_indices=[1, 2, 3, 4] if gt else None, **kw,
    )


@pytest.fixture
def umask_open():
    """Run with a permissive umask: the store must still produce 0600/0700."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_permissions_are_owner_only_even_with_umask_0(tmp_path: Path, umask_open: None) -> None:
    rng = np.random.default_rng(0)
    store = AuditStore(tmp_path / "runs", "run-a", config={"protocol": "fedsgd"})
    store.add(_record(1, 0, gt=True, rng=rng))
    store.add(_record(1, 1, gt=False, rng=rng))
    store.finalize()
    assert _mode(tmp_path / "runs") == 0o700  # created by the store
    dirs = [p for p in store.run_dir.rglob("*") if p.is_dir()] + [store.run_dir]
    files = [p for p in store.run_dir.rglob("*") if p.is_file()]
    assert len(dirs) >= 4 and len(files) >= 9
    for d in dirs:
        assert _mode(d) == 0o700, d
    for f in files:
        assert _mode(f) == 0o600, f
    names = {str(p.relative_to(store.run_dir)) for p in files}
    for want in ("config.json", "metrics.jsonl", "summary.json", "report.html",
                 "round-1/client-0/reconstruction.png", "round-1/client-0/original.png",
                 "round-1/client-0/inputs.npz", "round-1/client-0/metrics.json",
                 "round-1/client-1/reconstruction.png", "round-1/client-1/metrics.json"):
        assert want in names, (want, sorted(names))
    assert "round-1/client-1/original.png" not in names  # no ground truth for that client
    assert not [n for n in names if n.endswith(".tmp") or "/." in n or n.startswith(".")]


def test_second_run_never_overwrites_the_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    first = AuditStore(tmp_path, "same-name", config={"a": 1})
    first.add(_record(1, 0, gt=False, rng=rng))
    first.finalize()
    before = {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError):
        AuditStore(tmp_path, "same-name", config={"a": 2})
    after = {p: p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    assert after == before
    # generated names are unique even when created in the same second
    names = {AuditStore(tmp_path).run_name for _ in range(5)}
    assert len(names) == 5
    for name in names:
        assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", name)


def test_bad_run_names_are_rejected(tmp_path: Path) -> None:
    for bad in ("../escape", "a/b", ".", "", " x"):
        with pytest.raises(ValueError):
            AuditStore(tmp_path, bad or "..")


def test_duplicate_client_label_gets_its_own_directory(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    store = AuditStore(tmp_path, "dup")
    d1 = store.add(_record(1, 3, gt=False, rng=rng))
    d2 = store.add(_record(1, 3, gt=False, rng=rng))
    assert d1 != d2 and d1.name == "client-3" and d2.name == "client-3-2"
    assert (d1 / "inputs.npz").is_file() and (d2 / "inputs.npz").is_file()
    # each line names the directory actually written
    lines = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert [ln["dir"] for ln in lines] == ["round-1/client-3", "round-1/client-3-2"]
    assert json.loads((d2 / "metrics.json").read_text())["dir"] == "round-1/client-3-2"


def test_metrics_jsonl_is_appended_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    store = AuditStore(tmp_path, "append")
    path = store.run_dir / "metrics.jsonl"
    store.add(_record(1, 0, gt=False, rng=rng))
    first = path.read_bytes()
    store.add(_record(1, 1, gt=False, rng=rng))
    assert path.read_bytes().startswith(first)  # appended, not rewritten
    with open(path, "ab") as fh:  # a crash in the middle of a line
        fh.write(b'{"server_round": 2, "sta')
    assert [ln["client"] for ln in records_from_jsonl(path)] == ["client-0", "client-1"]


def test_metrics_jsonl_summary_and_report(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    store = AuditStore(tmp_path, "full", config={"protocol": "dpsgd", "dataset": "mnist"})
    store.add(_record(1, 0, gt=True, rng=rng, epsilon=3.5, epsilon_cumulative=3.5, delta=1e-5))
    store.add(_record(2, 0, gt=True, rng=rng, epsilon=3.5, epsilon_cumulative=5.0, delta=1e-5))
    store.add(ClientAudit(1, 77, partition_id=1, status="attack-error", error="boom <b>"))
    store.add(ClientAudit(1, 78, label="node-2", status="corrupt",
                          error="array '1.weight' contains NaN or inf"))
    store.add_round(1, {"audit_seconds": 1.0})
    summary = store.finalize({"status": "completed"})

    lines = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert len(lines) == 4
    assert [ln["status"] for ln in lines] == ["certified", "certified", "attack-error",
                                              "corrupt"]
    assert lines[2]["error"] == "boom <b>" and lines[3]["partition_id"] is None
    assert lines[3]["dir"] == "round-1/node-2" and lines[3]["node_id"] == 78
    assert "inputs" not in lines[0] and "sample_indices" not in lines[0]

    on_disk = json.loads((store.run_dir / "summary.json").read_text())
    assert on_disk == summary
    assert summary["reconstructions"] == 2
    assert summary["certified"] == 2 and summary["verdict_level"] == "leak"
    assert summary["psnr_mean"] == pytest.approx(120.0)
    assert summary["epsilon"] == pytest.approx(5.0)  # largest cumulative epsilon
    assert summary["attack_failures"] == 1 and summary["corrupt_replies"] == 1
    assert summary["status"] == "completed"

    report = (store.run_dir / "report.html").read_text()
    assert report.count("data:image/png;base64,") >= 5  # plot + 2 x (recon, original)
    assert "boom &lt;b&gt;" in report and "boom <b>" not in report  # escaped
    assert "ε" in report and "<dt>ε, δ</dt>" in report  # DP column and its explanation
    assert "1.0e-05" in report and "0.00" not in report.split("DP δ")[1][:40]  # δ readable
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", report)  # self-contained

    npz = np.load(store.run_dir / "round-1/client-0/inputs.npz")
    assert npz["inputs"].shape == (4, 784)
    assert list(npz["sample_indices"]) == [1, 2, 3, 4]


def test_summary_without_ground_truth_or_dp(tmp_path: Path) -> None:
    store = AuditStore(tmp_path, "plain")
    store.add(_record(1, 0, gt=False, rng=np.random.default_rng(4)))
    summary = store.finalize()
    assert summary["psnr_mean"] is None and summary["epsilon"] is None
    assert summary["reconstructions"] == 1
    page = (store.run_dir / "report.html").read_text()
    assert "no ground truth" in page and "audit off" not in page
    assert "ε" not in page  # no DP: no ε column, no explanation of it


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two" and _mode(target) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_jsonable_and_image_grid() -> None:
    out = jsonable({"a": float("inf"), "b": float("nan"), "c": np.float32(1.5),
                    "d": np.arange(2), "e": (np.int64(3),)})
    assert out == {"a": "inf", "b": None, "c": 1.5, "d": [0, 1], "e": [3]}
    json.dumps(out, allow_nan=False)
    grid = image_grid(np.random.default_rng(0).random((5, 3, 8, 8)) * 3 - 1)
    assert grid.dtype == np.uint8 and grid.ndim == 3 and grid.shape[2] == 3
    assert grid.shape[1] >= 256
    with pytest.raises(ValueError):
        image_grid(np.zeros((2, 2, 8, 8)))


def test_image_grid_frames_the_marked_tiles() -> None:
    images = np.full((3, 1, 4, 4), 0.5)
    grid = image_grid(images, pad=2, min_side=1, marked=np.array([False, True, False]))
    green = (np.asarray(MARK_RGB) * 255 + 0.5).astype(np.uint8)
    # tile k spans columns 2 + 6k .. 2 + 6k + 3; its frame is the padding around it
    assert (grid[0, 6:14] == green).all() and (grid[7, 6:14] == green).all()
    assert (grid[0, 0:6] == 255).all() and (grid[0, 14:] == 255).all()
    assert (grid[2:6, 8:12] == 128).all()  # the picture itself is untouched
    with pytest.raises(ValueError, match="one flag per image"):
        image_grid(images, marked=np.array([True]))


def test_verified_pictures_follow_the_matching_and_frame_only_unproven_batches() -> None:
    """The verified rows (``Reconstruction.verified``) index the reconstruction; the pictures
    are in the originals' order (``matching[i]`` = the row shown as original i), so the flags
    follow the matching. A certified batch needs no frame; features are never framed."""
    rng = np.random.default_rng(3)
    verified = {"verified": [0, 3]}
    rec = _record(1, 0, gt=True, rng=rng, matching=np.array([3, 2, -1, 0]), attack=verified)
    assert rec.verified_pictures().tolist() == [True, False, False, True]
    blind = _record(1, 0, gt=False, rng=rng, attack=verified)
    assert blind.verified_pictures().tolist() == [True, False, False, True]
    assert _record(1, 0, gt=True, rng=rng, attack=verified,
                   reads="features").verified_pictures() is None
    assert _record(1, 0, gt=True, rng=rng).verified_pictures() is None
    partial = dataclasses.replace(rec, status="partial", exact=False, n_directions=3)
    html = render_report(_summary_of([partial]), [partial], {}, {})
    assert "Framed in green: the 2 of 4 samples verified on their own" in html
    assert "Framed in green" not in render_report(_summary_of([rec]), [rec], {}, {})


def _summary_of(records: list[ClientAudit]) -> dict:
    from fl_attack_flwr.output.summary import summarize

    return summarize(records, {}, {}, run_name="r", run_dir="/x", wall_seconds=1.0)


def test_the_verdict_answers_the_auditors_question() -> None:
    rng = np.random.default_rng(6)
    every = _summary_of([_record(1, k, gt=True, rng=rng) for k in range(6)])
    assert every["verdict_level"] == "leak"
    assert "reconstructed 6 of 6 client batches exactly" in every["verdict"]

    protected = [ClientAudit(1, k, partition_id=k, status="protected",
                             reason="the update mixes at least min(m, n) = 100 samples",
                             protected_by="full-rank")
                 for k in range(3)]
    safe = _summary_of(protected)
    assert safe["verdict_level"] == "safe"
    assert safe["verdict"].startswith("The attack could not read any attacked client's batch")
    assert "mix more samples than the attacked layer can separate" in safe["verdict"]
    assert safe["protected"] == 3 and safe["attack_failures"] == 0

    mixed = _summary_of([_record(1, 0, gt=True, rng=rng), *protected[:2],
                         ClientAudit(1, 9, partition_id=9, status="timeout", error="t")])
    assert mixed["verdict_level"] == "leak"
    assert "1 of 4" in mixed["verdict"] and "2 of 4 updates were protected" in mixed["verdict"]
    assert "1 timeout" in mixed["verdict"]

    uncertified = _summary_of([dataclasses.replace(_record(1, k, gt=True, rng=rng),
                                                   status="not-certified", exact=False)
                               for k in range(2)])
    assert uncertified["verdict"].startswith(
        "The server reconstructed 2 of 2 client batches, without a certificate; 2 of the 2 "
        "scored reconstructions hold recognisable samples")

    nothing = _summary_of([ClientAudit(1, 1, status="client-error", error="x")])
    assert nothing["verdict_level"] == "none" and "No update was attacked" in nothing["verdict"]


def test_one_recognisable_sample_is_a_leak_even_where_the_batch_mean_is_low() -> None:
    """A batch is judged by its samples, not its mean: one photo above 25 dB among poor ones
    is recognisable, in the verdict, its level and the privacy gate; the verdict counts the
    samples as the per-round table does."""
    from fl_attack_flwr.output.privacy_gate import gate_failure

    rng = np.random.default_rng(7)
    psnr = [31.0, 12.0, 11.0, 10.0]  # mean 16 dB
    one = dataclasses.replace(_record(1, 0, gt=True, rng=rng), status="not-certified",
                              exact=False, psnr=psnr, psnr_mean=float(np.mean(psnr)))
    poor = dataclasses.replace(one, node_id=2000, psnr=[12.0] * 4, psnr_mean=12.0)
    got = _summary_of([one, poor])
    assert got["psnr_mean"] < 25.0 and got["readable"] == 1
    assert got["samples_readable"] == 1 and got["samples_scored"] == 8
    assert "1 of the 2 scored reconstructions hold recognisable samples (PSNR > 25 dB: 1 of 8 " \
        "samples)" in got["verdict"]
    assert got["verdict_level"] == "leak"
    assert "1 of 2 attacked client update(s) readable" in gate_failure(got, "readable")
    assert gate_failure(_summary_of([poor]), "readable") is None


def test_the_report_explains_statuses_and_gives_every_uncertified_row_a_reason(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    store = AuditStore(tmp_path, "explain")
    store.add(_record(1, 0, gt=False, rng=rng))
    store.add(ClientAudit(1, 5, partition_id=1, status="not-certified",
                          reason="λ = 0.9900 < 1: some samples' activation patterns do not match",
                          batch_size=4, sparsity_match=0.99, n_directions=4,
                          inputs=rng.standard_normal((4, 784))))
    store.add(ClientAudit(1, 6, partition_id=2, status="protected",
                          reason="noise hides the batch: the update has numerical rank 0"))
    store.add(ClientAudit(1, 7, partition_id=3, status="certified", batch_size=2,
                          sparsity_match=1.0, exact=True, n_directions=2,
                          inputs=rng.standard_normal((2, 14)),
                          inputs_are="The inputs are not images"))
    store.finalize()
    page = (store.run_dir / "report.html").read_text()
    assert "id='verdict'" in page and "How to read this report" in page
    for word in ("certified", "not-certified", "protected", "λ (sparsity match)", "PSNR"):
        assert word in page
    assert "activation patterns do not match" in page
    assert "noise hides the batch" in page and "attack-error" not in page.split("<h2>Clients")[1]
    assert "Showing 2 of 2 rows" in page  # tabular inputs as a table of numbers


def test_the_report_warns_about_setups_that_give_no_privacy(tmp_path: Path) -> None:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    from fl_attack_flwr import AuditingStrategy

    store = AuditStore(tmp_path, "notes", config={"protocol": "dpsgd", "noise-multiplier": 0.0})
    central = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=1.0,
                                                         clipping_norm=1.0,
                                                         num_sampled_clients=2)
    AuditingStrategy(central, store=store)
    summary = store.finalize()
    assert any("Central DP" in n and "still receives every client's update" in n
               for n in summary["notes"])
    assert any("clipping only: ε = ∞" in n for n in summary["notes"])
    page = (store.run_dir / "report.html").read_text()
    assert "Central DP" in page and "clipping only" in page


def test_metrics_only_store_writes_no_reconstruction(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    store = AuditStore(tmp_path, "metrics-only", reconstructions=False)
    cdir = store.add(_record(1, 0, gt=True, rng=rng))
    summary = store.finalize()
    assert sorted(p.name for p in cdir.iterdir()) == ["metrics.json"]
    assert records_from_jsonl(store.run_dir / "metrics.jsonl")[0]["files"] == []
    assert summary["reconstructions_kept"] == "none (metrics only)"
    assert summary["certified"] == 1 and summary["psnr_mean"] == 120.0  # the verdict stays
    page = (store.run_dir / "report.html").read_text()
    assert 'alt="reconstruction"' not in page and 'alt="original"' not in page
    assert "Metrics-only run" in page


def test_retention_keeps_the_last_rounds_reconstructions_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    store = AuditStore(tmp_path, "retain", retain_rounds=2)
    dirs = {rnd: store.add(_record(rnd, 0, gt=True, rng=rng)) for rnd in (1, 2, 3)}
    store.finalize()
    assert sorted(p.name for p in dirs[1].iterdir()) == ["metrics.json"]
    for rnd in (2, 3):
        assert {"reconstruction.png", "original.png", "inputs.npz"} <= {
            p.name for p in dirs[rnd].iterdir()}
    lines = records_from_jsonl(store.run_dir / "metrics.jsonl")
    assert [ln["status"] for ln in lines] == ["certified"] * 3  # metrics of every round stay
    page = (store.run_dir / "report.html").read_text()
    assert page.count('alt="reconstruction"') == 2 and "the last 2 audited round(s)" in page
    with pytest.raises(ValueError, match="retain_rounds"):
        AuditStore(tmp_path, "bad", retain_rounds=0)


@pytest.mark.parametrize(("fail_on", "summary", "trips"), [
    ("", {"certified": 3, "reconstructions": 3, "attacked": 3}, False),
    ("certified", {"certified": 0, "reconstructions": 2, "attacked": 2}, False),
    ("certified", {"certified": 1, "reconstructions": 1, "attacked": 2}, True),
    ("readable", {"certified": 0, "certified_or_readable": 1, "attacked": 2}, True),
    ("readable", {"certified": 0, "certified_or_readable": 0, "reconstructions": 2,
                  "attacked": 2}, False),
    ("reconstructed", {"certified": 0, "reconstructions": 1, "attacked": 4}, True),
])
def test_the_privacy_gate_trips_on_what_it_names(fail_on: str, summary: dict,
                                                 trips: bool) -> None:
    from fl_attack_flwr.output.privacy_gate import gate_failure

    why = gate_failure({**summary, "report": "r.html"}, fail_on)
    assert (why is not None) == trips
    if trips:
        assert f"fail-on={fail_on!r}" in why and f"of {summary['attacked']}" in why
    with pytest.raises(ValueError, match="fail-on must be one of"):
        gate_failure(summary, "leaky")


def test_a_protected_run_with_epsilon_but_no_delta_says_so(tmp_path: Path) -> None:
    """A client that reports its ε without δ: the verdict names the DP protection and says δ is
    not reported (a crash formatting a missing δ would lose the run's summary)."""
    store = AuditStore(tmp_path, "eps-only")
    store.add(ClientAudit(1, 5, partition_id=0, status="protected", protocol="dpsgd",
                          num_examples=16, epsilon=2.0, epsilon_cumulative=2.0,
                          reason="noise detected on the update"))
    summary = store.finalize()
    assert summary["epsilon"] == pytest.approx(2.0)
    assert "δ not reported" in summary["verdict"], summary["verdict"]
