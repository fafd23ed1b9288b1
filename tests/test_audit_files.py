"""``fl-attack audit SENT RETURNED`` and ``audit_update``: saved weights of an app not written
for the plugin (its own layer names, a nested ``nn.Sequential``) after one SGD step on 16 real
photos, in each format; several clients; bad files and bad options, refused at once, naming
the file and the array or the option; the exit codes of the privacy gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fl_attack.testbed import data
from fl_attack_flwr import audit_update, verdicts
from fl_attack_flwr.app.cli import EXIT_BAD_INPUT, EXIT_GATE, main
from fl_attack_flwr.output.private_files import records_from_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

B = 16
LAYER = "body.1.0.weight"
FAST = ["--max-seconds", "20"]


class PhotoNet(nn.Module):
    """A user's own model: its own names, the first Linear inside a nested Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(3072, 200), nn.ReLU()),
                                  nn.Linear(200, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _one_step(net: nn.Module, seed: int) -> tuple[dict, torch.Tensor]:
    """The state after one SGD step on 16 real photos, and the normalised photos."""
    x, y = data.sample_batch("photos32", B, seed=seed)
    xn = data.normalize(x, "photos32")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.zero_grad()
    nn.functional.cross_entropy(net(xn), y).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, xn


def _save(state: dict, path: Path) -> Path:
    if path.suffix == ".npz":
        np.savez(path, **{k: v.numpy() for k, v in state.items()})
    elif path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SENT and two clients' RETURNED (one step from SENT on different photos), as files."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    net = PhotoNet()
    sent = {k: v.detach().clone() for k, v in net.state_dict().items()}
    back_a, truth_a = _one_step(net, seed=0)
    net.load_state_dict(sent)
    back_b, _ = _one_step(net, seed=1)
    files = {}
    for suffix in (".pt", ".npz", ".safetensors"):
        files[suffix] = (_save(sent, root / f"sent{suffix}"),
                         _save(back_a, root / f"returned{suffix}"))
    clients = root / "clients"
    clients.mkdir()
    _save(back_a, clients / "client-a.pt")
    _save(back_b, clients / "client-b.npz")
    return {"root": root, "files": files, "clients": clients, "sent": sent, "back": back_a,
            "truth": truth_a}


def _lines(run_dir: Path) -> list[dict]:
    return records_from_jsonl(run_dir / "metrics.jsonl")


def _check_record(line: dict, run_dir: Path, truth: torch.Tensor) -> np.ndarray:
    """What the audit promises for a clean one-step update at B = 16 on a 3072 -> 200 layer:
    a reconstruction of 16 samples of the first Linear, stored; exact where certified."""
    assert line["status"] in verdicts.RECONSTRUCTED, line
    assert line["batch_size"] == B and line["num_examples"] == B
    assert line["layer"] == LAYER and line["layer_shape"] == [200, 3072]
    assert {"inputs.npz", "reconstruction.png"} <= set(line["files"])
    inputs = np.load(run_dir / line["dir"] / "inputs.npz")["inputs"]
    assert inputs.shape == (B, 3072)
    if line["status"] == verdicts.CERTIFIED:  # the certificate: every sample exact
        got = torch.tensor(inputs, dtype=torch.float64)
        dist = torch.cdist(got, truth.reshape(B, -1).double())
        assert float(dist.min(dim=1).values.max()) < 1e-3
    return inputs


def test_the_console_script_audits_a_saved_pair(saved: dict, tmp_path: Path) -> None:
    """The installed command, as a user runs it: exit 0, the verdict printed, the run directory
    with the record, the stored batch, summary.json and report.html."""
    sent, back = saved["files"][".pt"]
    script = Path(sys.executable).parent / "fl-attack"
    command = ([str(script)] if script.is_file()
               else [sys.executable, "-m", "fl_attack_flwr.app.cli"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*command, "audit", str(sent), str(back), "--num-examples", str(B),
                           "--out", str(tmp_path), "--run-name", "pt", *FAST],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: " in proc.stdout and "report: " in proc.stdout
    run_dir = tmp_path / "pt"
    (line,) = _lines(run_dir)
    _check_record(line, run_dir, saved["truth"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"] in proc.stdout
    assert (run_dir / "report.html").is_file()


@pytest.fixture(scope="module")
def reference(saved: dict) -> tuple[dict, np.ndarray]:
    """The ``.pt`` pair's record and reconstruction, through ``audit_update``."""
    result = audit_update(*saved["files"][".pt"], num_examples=B, max_seconds=20,
                          out=saved["root"] / "runs", run_name="pt")
    (line,) = _lines(result.run_dir)
    assert line["status"] == result.records[0].status
    return line, _check_record(line, result.run_dir, saved["truth"])


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_each_format_gives_the_same_result(saved: dict, reference: tuple[dict, np.ndarray],
                                           tmp_path: Path, suffix: str) -> None:
    sent, back = saved["files"][suffix]
    assert main(["audit", str(sent), str(back), "--num-examples", str(B), "--out",
                 str(tmp_path), "--run-name", "other", *FAST]) == 0
    (line,) = _lines(tmp_path / "other")
    got = _check_record(line, tmp_path / "other", saved["truth"])
    ref, want = reference
    assert (line["status"], line["reading"]) == (ref["status"], ref["reading"])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_folder_audits_each_client_against_one_sent(saved: dict, tmp_path: Path) -> None:
    sent, _ = saved["files"][".pt"]
    result = audit_update(sent, saved["clients"], num_examples=B, max_seconds=20,
                          out=tmp_path, run_name="two")
    assert [r.client_label for r in result.records] == ["client-a", "client-b"]
    lines = _lines(result.run_dir)
    assert [ln["dir"] for ln in lines] == ["round-1/client-a", "round-1/client-b"]
    _check_record(lines[0], result.run_dir, saved["truth"])
    assert result.summary["replies"] == 2 and result.failure is None
    rounds = records_from_jsonl(result.run_dir / "rounds.jsonl")
    assert rounds[-1]["audit-replies"] == 2


def test_in_memory_state_dicts_are_audited_too(saved: dict, tmp_path: Path) -> None:
    result = audit_update(saved["sent"], [saved["back"]], num_examples=B, layer="body.1.0",
                          max_seconds=20, out=tmp_path, run_name="mem",
                          reconstructions=False)
    (record,) = result.records
    assert record.layer == LAYER and record.batch_size == B
    assert not list((result.run_dir / "round-1").rglob("*.npz"))  # metrics only


def test_the_privacy_gate_sets_the_exit_status(saved: dict, tmp_path: Path) -> None:
    sent, back = saved["files"][".pt"]
    args = ["audit", str(sent), str(back), "--num-examples", str(B), "--out", str(tmp_path),
            *FAST]
    assert main([*args, "--run-name", "rec", "--fail-on", "reconstructed"]) == EXIT_GATE
    summary = json.loads((tmp_path / "rec" / "summary.json").read_text())
    certified = main([*args, "--run-name", "cert", "--fail-on", "certified"])
    cert_summary = json.loads((tmp_path / "cert" / "summary.json").read_text())
    assert certified == (EXIT_GATE if cert_summary["certified"] else 0)
    assert summary["reconstructions"] == 1
    # nothing moved: no update, nothing attacked, the gate passes
    assert main(["audit", str(sent), str(sent), "--out", str(tmp_path), "--run-name", "same",
                 "--fail-on", "reconstructed"]) == 0
    (line,) = _lines(tmp_path / "same")
    assert line["status"] == verdicts.NO_UPDATE


class Payload:
    """Unpickling this would create a file: a torch.load that executes code would show."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def _bad_files(root: Path, saved: dict) -> dict[str, tuple[list[str], list[str]]]:
    """Name -> (the command's files, words its message must hold)."""
    sent, back = saved["files"][".pt"]
    state = saved["back"]
    missing = {k: v for k, v in state.items() if k != "head.bias"}
    shaped = {**state, "head.weight": torch.zeros(10, 63)}
    nan = {**state, "head.bias": torch.full((10,), float("nan"))}
    torch.save(missing, root / "missing.pt")
    torch.save(shaped, root / "shaped.pt")
    torch.save(nan, root / "nan.pt")
    torch.save(PhotoNet(), root / "module.pt")
    torch.save({"weights": Payload(root / "executed")}, root / "object.pt")
    torch.save({"epoch": 3, "head.weight": state["head.weight"]}, root / "mixed.pt")
    (root / "weights.h5").write_bytes(b"\x89HDF")
    (root / "junk.npz").write_bytes(b"not a zip")
    return {
        "missing file": ([str(sent), str(root / "nowhere.pt")], ["nowhere.pt", "no such file"]),
        "unknown suffix": ([str(sent), str(root / "weights.h5")], ["weights.h5", ".h5"]),
        "missing key": ([str(sent), str(root / "missing.pt")], ["missing.pt", "head.bias"]),
        "shape": ([str(sent), str(root / "shaped.pt")], ["shaped.pt", "head.weight", "(10, 63)"]),
        "nan": ([str(sent), str(root / "nan.pt")], ["nan.pt", "head.bias", "NaN"]),
        "pickled module": ([str(root / "module.pt"), str(back)], ["module.pt", "state dict"]),
        "custom object": ([str(sent), str(root / "object.pt")], ["object.pt", "refused"]),
        "not a tensor": ([str(sent), str(root / "mixed.pt")], ["mixed.pt", "'epoch'"]),
        "broken npz": ([str(sent), str(root / "junk.npz")], ["junk.npz", ".npz"]),
    }


def test_bad_files_are_refused_at_once_naming_the_file_and_array(
        saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    for name, (files, words) in _bad_files(tmp_path, saved).items():
        assert main(["audit", *files, "--out", str(out)]) == EXIT_BAD_INPUT, name
        err = capsys.readouterr().err
        assert all(w in err for w in words), (name, err)
    assert not (tmp_path / "executed").exists()  # the pickle was never run
    assert not out.exists()  # nothing written for a bad input


@pytest.mark.parametrize(("option", "words"), [
    (["--update", "sideways"], ["--update", "sideways"]),
    (["--fail-on", "leaky"], ["--fail-on", "leaky"]),
    (["--num-examples", "0"], ["--num-examples", ">= 1"]),
    (["--input-shape", "3,32"], ["--input-shape", "C,H,W"]),
])
def test_a_wrong_option_fails_at_once_naming_it(saved: dict, tmp_path: Path, option: list[str],
                                                words: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    sent, back = saved["files"][".pt"]
    with pytest.raises(SystemExit) as stop:
        main(["audit", str(sent), str(back), "--out", str(tmp_path), *option])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


@pytest.mark.parametrize(("option", "words"), [
    (["--max-seconds", "-1"], ["max_seconds", "-1"]),
    (["--layer", "nope"], ["sent.pt", "nope.weight", LAYER]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--model", "no_such_module:Net"], ["--model", "no_such_module"]),
])
def test_a_wrong_setting_fails_before_any_attack(saved: dict, tmp_path: Path, option: list[str],
                                                 words: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    sent, back = saved["files"][".pt"]
    code = main(["audit", str(sent), str(back), "--out", str(tmp_path / "runs"), *option])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and all(w in err for w in words), err
    assert not (tmp_path / "runs").exists()


def test_the_audit_of_saved_weights_imports_no_flower() -> None:
    """Auditing files needs no federation: the function and its intake import no ``flwr``."""
    code = ("import sys, fl_attack_flwr.saved_audit, fl_attack_flwr.intake.files\n"
            "flower = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.'))\n"
            "assert not flower, flower\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
