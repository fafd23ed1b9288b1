"""``fl-attack audit`` on a language model's saved checkpoints (``transformers``
``save_pretrained`` folders: ``.safetensors``, sharded with an index, the tokenizer beside).

A tiny LLaMA with SmolLM2's tokenizer; each client takes one SGD step on real sentences and
saves its weights. The audit reads every client's sentences and certifies them, takes the
architecture and the tokenizer from SENT's folder, and gates and fails as for images.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fl_attack.testbed import text as tt
from fl_attack_flwr.app.cli import main
from fl_attack_flwr.clients.text_task import text_tokenizer

SENTENCES = [["The bear pawed the door", "incite a riot"],
             ["Fear clogged her mind", "The line of men fall forward", "He was a good man"]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("ckpt")
    tok = text_tokenizer()
    model = tt.tiny_llama(vocab=len(tok), width=128, seed=3)
    model.save_pretrained(root / "sent")
    tok.save_pretrained(root / "sent")
    clients = []
    for i, batch in enumerate(SENTENCES):
        update = tt.fedavg_update(model, [tok(s).input_ids for s in batch], steps=1, lr=0.05)
        local = tt.tiny_llama(vocab=len(tok), width=128, seed=3)
        with torch.no_grad():
            for name, p in local.named_parameters():
                p -= update[name]
        # the second client's checkpoint is sharded (an index and two files)
        local.save_pretrained(root / f"client-{i}", max_shard_size="2MB" if i else "10GB")
        clients.append(root / f"client-{i}")
    assert (clients[1] / "model.safetensors.index.json").is_file()
    return root / "sent", clients


def test_sentences_of_saved_checkpoints_are_read_and_certified(
        checkpoints: tuple[Path, list[Path]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    sent, clients = checkpoints
    code = main(["audit", str(sent), *map(str, clients), "--out", str(tmp_path),
                 "--run-name", "r", "--fail-on", "certified"])
    out = capsys.readouterr()
    assert code == 3, out.err  # every client certified: the gate trips
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["certified", "certified"], out.out
    read = [sorted(json.loads(x)["text"] for x in (tmp_path / "r" / d / "text.jsonl")
                   .read_text().splitlines()) for d in ("round-1/client-0", "round-1/client-1")]
    assert read == [sorted(b) for b in SENTENCES]
    assert "2 sentence(s) read" in out.out and "3 sentence(s) read" in out.out


def test_a_language_model_without_its_architecture_is_refused(
        checkpoints: tuple[Path, list[Path]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    sent, clients = checkpoints
    bare = tmp_path / "sent.safetensors"
    shutil.copy(sent / "model.safetensors", bare)
    code = main(["audit", str(bare), str(clients[0]), "--out", str(tmp_path / "runs")])
    assert code == 2
    assert "give its architecture" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
