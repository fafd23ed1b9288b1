"""Language models in the federation: clients fine-tune a 2-block LLaMA (SmolLM2's tokenizer,
real WordNet sentences) on Flower's simulation engine, and the audit reads their sentences.

Contracts: every FedSGD update of a few short sentences is read and certified, and certified
only when every sentence is the client's token for token; the sentences are stored owner-only
and never in ``metrics.jsonl``; the report shows them beside the clients' own; a FedAvg or LoRA
update gets an honest verdict; bad text settings stop the run before it starts.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.demo_runs import run_demo

ROOT = Path(__file__).resolve().parents[1]
BASE = {"task": "text", "text-model": "tiny-llama", "num-server-rounds": 1, "num-clients": 3,
        "batch-size": 3, "max-tokens": 16, "lr": 0.05, "max-seconds": 60.0,
        "fraction-evaluate": 0.0, "audit-executor": "inline"}


def _simulate(tmp_path: Path, name: str, **config: object) -> tuple[dict, list[dict], Path]:
    summary, lines, run_dir, _ = run_demo(tmp_path, name, {**BASE, **config})
    return summary, lines, run_dir


def _certified_only_when_exact(lines: list[dict]) -> None:
    for line in lines:
        text = line["text"] or {}
        if line["status"] == "certified":
            assert text["sentences_exact"] == text["sentences_true"], line


def test_fedsgd_sentences_are_read_certified_and_kept_private(tmp_path: Path) -> None:
    summary, lines, run_dir = _simulate(tmp_path, "fedsgd", **{"num-server-rounds": 2})
    assert summary["status"] == "completed" and len(lines) == 6
    assert {line["status"] for line in lines} == {"certified"}, [l["reason"] for l in lines]
    _certified_only_when_exact(lines)
    assert summary["sentences_exact"] == summary["sentences_true"] == 18
    assert summary["verdict_level"] == "leak" and "18 sentence(s)" in summary["verdict"]
    read = [json.loads(x) for f in sorted(run_dir.glob("round-*/client-*/text.jsonl"))
            for x in f.read_text().splitlines()]
    assert len(read) == 18 and all(r["exact"] and r["text"] == r["original"] for r in read)
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert not any(r["text"] in metrics for r in read)  # sentences never in the metrics
    for p in [run_dir, *run_dir.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    report = (run_dir / "report.html").read_text()
    assert "Sentences read" in report and "PSNR" not in report
    assert all(r["original"].replace("'", "&#x27;") in report for r in read)


def test_fedavg_is_never_certified_with_a_wrong_token() -> None:
    """Several local steps over mini-batches: whatever is read, a certificate means every
    sentence is the client's, token for token."""
    import torch

    from fl_attack.testbed import text as tt
    from fl_attack_flwr.jobs.run import run_job
    from fl_attack_flwr.jobs.text import text_job

    model = tt.tiny_llama(seed=4)
    batch = [[5, 9, 13, 17, 21, 25], [30, 34, 38, 42, 46], [50, 7, 61, 70]]
    sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for steps, mini in ((2, 1), (3, None)):
        update = tt.fedavg_update(model, batch, steps=steps, lr=0.01, minibatch=mini)
        returned = {k: (torch.from_numpy(sent[k]) - update[k]).numpy() if k in update
                    else sent[k] for k in sent}
        outcome = run_job(text_job(sent, returned, model=model, tokenizer=None,
                                   server_round=1, node_id=1, label="c", num_examples=3,
                                   protocol="fedavg", max_seconds=30.0))
        assert outcome.reason, outcome
        if outcome.status == "certified":
            assert sorted(outcome.text["token_ids"]) == sorted(batch)


def test_an_encoder_classifier_update_is_read_with_its_labels() -> None:
    """A BERT sequence classifier's weights after one step: the plugin recognises it by its
    layer names, rebuilds it from its config and the sent arrays, and reads sentences and
    labels; certified only when both are the client's."""
    from transformers import BertConfig

    from fl_attack.testbed import text as tt
    from fl_attack_flwr.jobs.run import run_job
    from fl_attack_flwr.jobs.text import text_job, text_layer

    model = tt.tiny_bert(seed=3)
    batch = [[1, 40, 41, 42, 43, 44, 2], [1, 50, 51, 52, 53, 54, 2]]
    sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    grads = tt.classification_gradients(model, batch, [1, 0])
    returned = {k: (sent[k] - 0.05 * grads[k].numpy()).astype(np.float32) if k in grads
                else sent[k] for k in sent}
    assert text_layer(returned) == "bert.encoder.layer.0.attention.self.query.weight"
    config = BertConfig(**{k: v for k, v in model.config.to_dict().items()
                           if k not in ("architectures", "model_type")})
    outcome = run_job(text_job(sent, returned, model=config, tokenizer=None, server_round=1,
                               node_id=1, label="c", num_examples=2, protocol="fedsgd",
                               max_seconds=30.0))
    text = outcome.text
    assert outcome.status == "certified", outcome.reason
    pairs = sorted(zip(text["token_ids"], text["labels"], strict=True))
    assert pairs == sorted(zip(batch, [1, 0], strict=True))
    assert "labels" not in outcome.reconstruction and "bag" not in outcome.reconstruction


def test_bad_text_settings_exit_2_naming_each_before_anything_runs(tmp_path: Path) -> None:
    bad = {"text-model=bert": "text-model must be one of",
           "protocol=dpsgd": "protocol must be one of ['fedsgd', 'fedavg', 'lora'] for task = "
                             "'text'",
           "leak-guard=report": "leak-guard must be empty for task = 'text'",
           "train-blocks=1": "train-blocks must be 0 or >= 2"}
    args = [sys.executable, "-m", "experiments.demo", "--set", f"output-dir={tmp_path}",
            "--set", "task=text"]
    for setting in bad:
        args += ["--set", setting]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    for message in bad.values():
        assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_transformer_reply_without_the_model_is_named_not_covered() -> None:
    from fl_attack.testbed import text as tt
    from fl_attack_flwr.intake.facts import ReplyFacts
    from fl_attack_flwr.intake.update import update_work
    from fl_attack_flwr.settings import AttackSettings

    model = tt.tiny_llama()
    sent = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    returned = {k: v + np.float32(1e-3) for k, v in sent.items()}
    facts, work = update_work(AttackSettings(), None, ReplyFacts(1, 7), sent, returned)
    assert work.status == "not-covered" and "model=" in work.reason
    assert facts.reads == "text" and facts.layer == "model.layers.0.self_attn.q_proj.weight"


def test_lora_updates_get_their_true_reason() -> None:
    """A fresh adapter (B = 0) gives lora_A no gradient: no update to read, said so; once B
    has trained, an adapter whose rank the batch reaches is not applicable, said so."""
    import torch

    from fl_attack.testbed import text as tt
    from fl_attack_flwr.clients.text_task import _with_lora
    from fl_attack_flwr.jobs.run import run_job
    from fl_attack_flwr.jobs.text import text_job

    torch.manual_seed(0)
    model = _with_lora(tt.tiny_llama(), 4)
    batch = [[5, 9, 13, 17, 21, 25], [30, 34, 38, 42, 46]]

    def job():
        sent = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        update = tt.fedavg_update(model, batch, steps=1, lr=0.05)
        returned = {k: (torch.from_numpy(sent[k]) - update[k]).numpy() if k in update
                    else sent[k] for k in sent}
        return text_job(sent, returned, model=model, tokenizer=None, server_round=1,
                        node_id=1, label="c", num_examples=2, protocol="lora",
                        max_seconds=30.0)

    fresh = job()
    assert fresh.status == "no-update" and "lora_A no gradient" in fresh.reason
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    outcome = run_job(job())
    assert outcome.status == "not-covered" and "adapter" in outcome.reason


def test_an_encoder_read_only_as_words_is_partial_never_protected() -> None:
    """Tokens read without their positions are a leak in part: the status is ``partial`` and
    the verdict says the words were read, not their order."""
    from fl_attack.text import TextReconstruction
    from fl_attack_flwr.jobs.text import _status
    from fl_attack_flwr.output.summary import _text_sentences

    rec = TextReconstruction([], [], False, "not-identifiable", "read the batch's tokens",
                             limit="positions", bag=[1, 5, 9])
    assert _status(rec) == ("partial", None)
    full = TextReconstruction([], [], False, "not-identifiable", "full", limit="full-rank")
    assert _status(full) == ("protected", "full-rank")
    words = " ".join(_text_sentences({"text_read": 1, "text_certified": 0, "attacked": 1,
                                      "text_tokens_only": 1, "tokens_only_read": 3,
                                      "sentences_read": 0, "sentences_certified": 0}))
    assert "read the words of 1 client update(s) (3 distinct tokens in all), not their order" \
        in words and "0 sentence(s)" not in words
