"""Benchmark: the text attack (DAGER, ``fl_attack.text.invert_text``) on real sentences.

One FedSGD step of next-token fine-tuning per batch, as a client computes it with
``transformers`` (right padding, mean loss over the labelled tokens); the server inverts the
update with the model it sent. Per row: mean ROUGE-1 / ROUGE-2 (``rouge-score``, sentences
matched to the originals by optimal assignment), the share of sentences recovered token for
token, token precision / recall, the share of batches certified, false certificates (a
certified batch that is not exact: must be 0) and seconds per batch (the model's load and the
client's step not counted). Appends a section per run to ``experiments/results/text.md``.

Text sources (``fl_attack.testbed.text``): ``wordnet`` (tuning) and ``fortunes`` (never tuned
on). Models: ``smollm2`` (SmolLM2-135M, rotary positions), ``gpt2`` (the GPT-2 small
architecture with random weights, learned positions) and ``minilm`` (all-MiniLM-L6-v2, a BERT
encoder, one step of sequence classification with a fresh two-class head).

    python -m experiments.bench_text --model smollm2 --source fortunes --batch-sizes 1,2,4,8,16
    python -m experiments.bench_text --model gpt2 --source fortunes --batch-sizes 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from experiments import harness
from fl_attack.testbed import text as tt
from fl_attack.text import invert_text

MODULE = "experiments.bench_text"
RESULTS = harness.RESULTS_DIR / "text.md"
TITLE = "The text attack (DAGER) on real sentences"
INTRO = ("One FedSGD step of next-token fine-tuning per batch; the server reads the sentences "
         "back with `fl_attack.text.invert_text`. Produced by `python -m "
         "experiments.bench_text`.")
COLUMNS = ("model", "update", "source", "B", "max tokens", "batches", "ROUGE-1", "ROUGE-2", "exact %",
           "token P / R", "bag P / R", "certified %", "false certs", "median s", "max s",
           "baseline ROUGE-1 / ROUGE-2 / exact %")


def load(name: str):
    """The model and a tokenizer (SmolLM2's for GPT-2 too: GPT-2's own is not shipped
    offline; MiniLM's own)."""
    if name == "minilm":
        model, tok = tt.minilm()
        # the server sent the model and knows its tokenizer: the sentences' ending token
        model.config.sep_token_id = tok.sep_token_id
        return model, tok
    model, tok = tt.smollm2()
    if name == "smollm2":
        return model, tok
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval(), tok


@dataclass
class Client:
    """What one client sends: its model (the model sent, or that model with LoRA adapters), the
    update it computes from a batch of token ids and the batch's index, and a label."""

    label: str
    model: torch.nn.Module
    update: Callable[[list[list[int]], int], dict[str, torch.Tensor]]
    weights_dtype: str | None = None
    """Set where the update is a weight difference (``invert_text(weights_dtype=...)``)."""
    labels: Callable[[int], list[int]] | None = None
    """A sequence classifier's labels for a batch of that size (the baseline is given them)."""


def make_client(args: argparse.Namespace, model: torch.nn.Module) -> Client:
    """The client ``--update`` and its options describe."""
    if args.update == "fedavg":
        return Client(f"FedAvg E={args.steps} lr={args.lr:g}"
                      + (f" mb={args.minibatch}" if args.minibatch else ""), model,
                      lambda ids, i: tt.fedavg_update(model, ids, steps=args.steps, lr=args.lr,
                                                      minibatch=args.minibatch))
    if args.update == "weights":
        return Client(f"FedSGD weights lr={args.lr:g}", model,
                      lambda ids, i: tt.fedavg_update(model, ids, steps=1, lr=args.lr),
                      weights_dtype="float32")
    if args.update == "dpsgd":
        return Client(f"DP-SGD C={args.clip:g} σ={args.sigma:g}", model,
                      lambda ids, i: tt.dpsgd_gradients(model, ids, clip=args.clip,
                                                        noise_multiplier=args.sigma, seed=i))
    if args.update == "lora":
        lora = tt.with_lora(model, args.rank)
        return Client(f"LoRA r={args.rank} (q, v), FedSGD", lora,
                      lambda ids, i: tt.fedsgd_gradients(lora, ids))
    if getattr(model.config, "model_type", "") == "bert":
        labels = lambda b: [j % 2 for j in range(b)]  # noqa: E731
        return Client("FedSGD, sequence classification (labels 0, 1, 0, ...)", model,
                      lambda ids, i: tt.classification_gradients(model, ids, labels(len(ids))),
                      labels=labels)
    return Client("FedSGD", model, lambda ids, i: tt.fedsgd_gradients(model, ids))


def train(model: torch.nn.Module, tok, steps: int, lr: float) -> None:
    """``steps`` SGD steps of next-token fine-tuning on batches of 8 WordNet sentences (the
    tuning source, never the one measured)."""
    if not steps:
        return
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    batches = list(tt.batches("wordnet", 8, steps, seed=7, max_tokens=32, tokenizer=tok))
    for batch in batches:
        grads = tt.fedsgd_gradients(model, [tok(s).input_ids for s in batch])
        opt.zero_grad()
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        opt.step()


def run_row(client: Client, tok, source: str, b: int, max_tokens: int, count: int, seed: int,
            max_seconds: float | None, baseline_seconds: float
            ) -> tuple[list[object], list[str]]:
    """Attack ``count`` batches of ``b`` sentences; the summary row and per-batch notes."""
    scores, secs, certs, false_certs, notes, base, bags = [], [], 0, 0, [], [], []
    for i, batch in enumerate(tt.batches(source, b, count, seed=seed, max_tokens=max_tokens,
                                         tokenizer=tok)):
        ids = [tok(s).input_ids for s in batch]
        grads = client.update(ids, i)
        t0 = time.perf_counter()
        rec = invert_text(client.model, grads, max_seconds=max_seconds,
                          weights_dtype=client.weights_dtype)
        secs.append(time.perf_counter() - t0)
        sc = tt.score_text(rec.token_ids, ids, tok.decode)
        scores.append(sc)
        truth = {t for s in ids for t in s}
        bags.append((len(truth & set(rec.bag)) / max(1, len(rec.bag)),
                     len(truth & set(rec.bag)) / len(truth)))
        certs += rec.certified
        false_certs += rec.certified and not sc.batch_exact
        print(f"  B={b} batch {i}: R1 {sc.rouge1:.3f} R2 {sc.rouge2:.3f} exact {sc.exact:.2f} "
              f"cert {rec.certified} {secs[-1]:.1f}s {rec.timings}", flush=True)
        if not sc.batch_exact or not rec.certified:
            notes.append(f"- B = {b}, batch {i}: {rec.reason}")
        if baseline_seconds > 0:
            labels = client.labels(len(ids)) if client.labels else None
            names = ([n for n in rec.residuals if "layers.0" in n or ".h.0." in n]
                     if labels is None else    # an encoder: block 0's attention, read or not
                     [n for n in grads if "layer.0.attention.self." in n and n.endswith("weight")])
            guess = tt.gradient_matching(client.model, grads, [len(t) for t in ids],
                                         names=names, max_seconds=baseline_seconds, seed=i,
                                         labels=labels)
            base.append(tt.score_text(guess, ids, tok.decode))
    mean = lambda k: statistics.fmean(getattr(s, k) for s in scores)  # noqa: E731
    base_model = getattr(client.model, "get_base_model", lambda: client.model)()
    row = [type(base_model).__name__, client.label, source, b, max_tokens, count,
           f"{mean('rouge1'):.3f}", f"{mean('rouge2'):.3f}", f"{100 * mean('exact'):.0f}",
           f"{mean('token_precision'):.3f} / {mean('token_recall'):.3f}",
           f"{statistics.fmean(p for p, _ in bags):.3f} / {statistics.fmean(r for _, r in bags):.3f}",
           f"{100 * certs / count:.0f}", false_certs, f"{statistics.median(secs):.1f}",
           f"{max(secs):.1f}", _baseline(base, baseline_seconds)]
    return row, notes


def _baseline(scores: list, seconds: float) -> str:
    if not scores:
        return "—"
    r1 = statistics.fmean(s.rouge1 for s in scores)
    r2 = statistics.fmean(s.rouge2 for s in scores)
    ex = statistics.fmean(s.exact for s in scores)
    return f"{r1:.3f} / {r2:.3f} / {100 * ex:.0f} ({seconds:g} s)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "gpt2", "minilm"), default="smollm2")
    parser.add_argument("--source", choices=("wordnet", "fortunes"), default="fortunes")
    parser.add_argument("--batch-sizes", type=harness.list_of(int, "batch size"),
                        default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="longest sentence, in the model's tokens")
    parser.add_argument("--trained", type=int, default=0, metavar="K",
                        help="first train the model K SGD steps (B = 8, lr --train-lr) on "
                             "WordNet's sentences, as a federation that has run for a while")
    parser.add_argument("--train-lr", type=float, default=0.05,
                        help="the learning rate of --trained (0.05 collapses SmolLM2: held-out "
                             "loss 8.3 after 30 steps; 1e-3 keeps it near 3)")
    parser.add_argument("--update", choices=("fedsgd", "fedavg", "dpsgd", "lora", "weights"),
                        default="fedsgd")
    parser.add_argument("--rank", type=int, default=8, help="LoRA adapter rank")
    parser.add_argument("--steps", type=int, default=2, help="FedAvg local steps")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="the client's learning rate (FedAvg, weights)")
    parser.add_argument("--minibatch", type=int, default=None, help="FedAvg mini-batch size")
    parser.add_argument("--sigma", type=float, default=1e-3, help="DP-SGD noise multiplier")
    parser.add_argument("--clip", type=float, default=1.0, help="DP-SGD clipping norm")
    parser.add_argument("--baseline-seconds", type=float, default=0.0,
                        help="run the TAG-style gradient-matching baseline this long per batch "
                             "on the same batches (0: not run)")
    harness.add_run_args(parser, RESULTS, batches=3, max_seconds=120.0)
    args = parser.parse_args(argv)
    harness.check_run_args(parser, args)
    torch.set_grad_enabled(True)
    model, tok = load(args.model)
    train(model, tok, args.trained, args.train_lr)
    client = make_client(args, model)
    if args.trained:
        client.label += f", after {args.trained} steps at lr {args.train_lr:g}"
    harness.start_section(args.out, TITLE, INTRO, [
        harness.section_heading(MODULE, argv), "", harness.machine_line("cpu"), "",
        *harness.table_header(COLUMNS)])
    notes = []
    for b in args.batch_sizes:
        row, why = run_row(client, tok, args.source, b, args.max_tokens, args.batches,
                           args.first_seed, args.max_seconds, args.baseline_seconds)
        notes += why
        harness.append_lines(args.out, harness.table_row(row))
        print(harness.table_row(row), flush=True)
    if notes:
        harness.append_lines(args.out, "", *notes)


if __name__ == "__main__":
    main()
