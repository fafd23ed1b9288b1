"""Text updates: a transformer's reply read with the text attack (``fl_attack.text``, DAGER).

A reply is a language model's when its arrays hold block 0's attention projections under the
names ``transformers`` and PEFT give them (:func:`text_layer`). Its job, :class:`TextJob`,
carries what the server already knows and nothing the client must add: the arrays it sent
(the model the client started from), the update of the parameters the attack reads (blocks 0
and 1, the embeddings and the output layer; the rest is released at once), the model's
architecture (the ``model=`` the strategy was given: a ``transformers`` config, a model, its
class or a factory) and the tokenizer that turns token ids back into sentences.

:func:`run_text_job` rebuilds the model from the sent arrays, calls
:func:`fl_attack.text.invert_text` on the update (the weights after one local step:
``weights_dtype`` is the reply's float dtype) and returns the one outcome type every executor
returns, its sentences decoded. Plain arrays in, plain data out: no Flower here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_attack_flwr import verdicts
from fl_attack_flwr.jobs.outcome import AttackOutcome, error_outcome

#: Block 0's first attention projection, as ``transformers`` (LLaMA, Mistral, Qwen2: ``q_proj``;
#: GPT-2: ``c_attn``; BERT: ``attention.self.query``) and PEFT (``base_layer``, ``lora_A``)
#: name it.
_FIRST = re.compile(r"(?:^|\.)(?:(?:layers|h)\.0\.(?:self_attn\.q_proj|attn\.c_attn)|"
                    r"encoder\.layer\.0\.attention\.self\.query)\."
                    r"(?:weight|base_layer\.weight|lora_A\.[^.]+\.weight)$")
#: Block 0's attention projections the token filter reads: base weights or LoRA ``lora_A``.
_ATTN0 = re.compile(r"(?:^|\.)(?:(?:layers|h)\.0\.(?:self_attn|attn)|"
                    r"encoder\.layer\.0\.attention\.self)\.[^.]+\."
                    r"(?:weight|base_layer\.weight|lora_A\.[^.]+\.weight)$")
#: The parameters the attack reads: blocks 0 and 1, the token embeddings, the output layer
#: (a sequence classifier's head: its update gives the labels).
_READ = re.compile(r"(?:^|\.)(?:(?:layers|h|layer)\.[01]\.|embed_tokens\.|wte\.|lm_head\.|"
                   r"classifier\.)")


def text_layer(keys: Any) -> str | None:
    """The name of block 0's first attention projection when ``keys`` are a transformer's
    arrays (the reply is a language model's), else ``None``."""
    return next((k for k in keys if _FIRST.search(str(k))), None)


@dataclass
class TextJob:
    """Everything one text attack needs, as plain picklable data."""

    server_round: int
    node_id: int
    label: str
    model: Any
    """The architecture: a ``transformers`` config, a model instance, or a class / factory
    that builds one with no arguments."""
    tokenizer: Any
    """Decodes token ids (a ``transformers`` tokenizer, a path to load one from, or None)."""
    sent: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    weights_dtype: str | None
    batch_size: int | None = None
    max_seconds: float | None = 120.0
    device: str | None = None
    memory_limit_gb: float | None = None
    num_examples: int | None = None


def text_job(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray], *,
             model: Any, tokenizer: Any, server_round: int, node_id: int, label: str,
             num_examples: int | None, protocol: str | None, max_seconds: float | None,
             device: str | None = None, memory_limit_gb: float | None = None
             ) -> TextJob | AttackOutcome:
    """The text attack's job for ``sent -> returned``, or the outcome that says why none.

    Only the update of the parameters the attack reads is kept (``W₀ − W₁`` in float64 of the
    reply's float32 arrays: the subtraction is exact). A FedSGD client's ``num_examples`` is
    its batch of sentences; other protocols' counts are not a batch size.
    """
    layer = text_layer(returned)
    if model is None:
        return AttackOutcome(verdicts.NOT_COVERED, reason=(
            f"a language model's update ({layer}): the text attack needs the model's "
            "architecture; pass it to the audit (AuditingStrategy(..., model=<a transformers "
            "config, model or factory>, tokenizer=...))"))
    update = {k: np.asarray(sent[k], np.float64) - np.asarray(returned[k], np.float64)
              for k in returned if _READ.search(k) and np.issubdtype(
                  np.asarray(returned[k]).dtype, np.floating)}
    update = {k: v for k, v in update.items() if np.any(v)}  # frozen: no gradient to read
    if not any(_ATTN0.search(k) for k in update):
        return AttackOutcome(verdicts.NO_UPDATE, reason=(
            "block 0's attention projections did not change (frozen, or a fresh LoRA adapter "
            "whose B is still zero, which gives lora_A no gradient): nothing to read there"))
    dtype = str(np.asarray(returned[layer]).dtype)
    return TextJob(server_round, node_id, label, model, tokenizer,
                   {k: np.asarray(v) for k, v in sent.items()}, update,
                   dtype if dtype in ("float32", "float16") else None,
                   batch_size=num_examples if protocol == "fedsgd" else None,
                   max_seconds=max_seconds, device=device, memory_limit_gb=memory_limit_gb,
                   num_examples=num_examples)


def build_model(spec: Any, sent: Mapping[str, np.ndarray]) -> Any:
    """The model ``spec`` describes, holding the ``sent`` arrays (``ValueError`` naming the
    arrays that do not fit it)."""
    import copy

    import torch

    if hasattr(spec, "model_type") and hasattr(spec, "to_dict"):  # a transformers config
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        head = sent.get("classifier.weight")
        if head is not None:                  # a sequence classifier, its classes as sent
            spec = copy.deepcopy(spec)
            spec.num_labels = int(np.shape(head)[0])
            model = AutoModelForSequenceClassification.from_config(spec, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(spec, dtype=torch.float32)
    elif isinstance(spec, torch.nn.Module):
        model = copy.deepcopy(spec)
    elif callable(spec):
        model = spec()
    else:
        raise ValueError(f"model must be a transformers config, a model, or a class / factory "
                         f"building one, got {type(spec).__name__}")
    state = model.state_dict()
    given = {state[k].data_ptr() for k in sent if k in state}
    # a tied weight (lm_head beside the embedding) is saved once by save_pretrained
    missing = sorted(k for k in set(state) - set(sent) if state[k].data_ptr() not in given)
    extra = sorted(set(sent) - set(state))
    if missing or extra:
        raise ValueError(f"the audit's model does not take the sent arrays: missing "
                         f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
                         f"{extra[:3]}{'...' if len(extra) > 3 else ''}")
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in sent.items()},
                          strict=False)
    return model.float().eval()


def _tokenizer(spec: Any) -> Any:
    if isinstance(spec, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec)
    return spec


def run_text_job(job: TextJob) -> AttackOutcome:
    """The text attack on ``job``: its verdict, and the sentences read (decoded when the job
    has a tokenizer). Never raises for what the update holds."""
    import torch

    from fl_attack.text import invert_text

    t0 = time.perf_counter()
    try:
        model = build_model(job.model, job.sent)
        names = dict(model.named_parameters())
        update = {k: torch.from_numpy(v) for k, v in job.update.items() if k in names}
        rec = invert_text(model, update, batch_size=job.batch_size,
                          max_seconds=job.max_seconds, device=job.device,
                          weights_dtype=job.weights_dtype)
        tokenizer = _tokenizer(job.tokenizer)
    except MemoryError as exc:
        return error_outcome(verdicts.OUT_OF_MEMORY, f"MemoryError: {exc}",
                             time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - any fault becomes a recorded outcome
        return error_outcome(verdicts.ATTACK_ERROR, f"{type(exc).__name__}: {exc}",
                             time.perf_counter() - t0)
    facts = rec.as_dict()
    ids = facts.pop("token_ids")
    evidence = facts.pop("sequences")
    bag = facts.pop("bag")                 # the batch's tokens: private, as the sentences
    labels = facts.pop("labels")           # a classifier's classes: private too
    facts["sentences_read"] = len(ids)
    facts["tokens_read"] = len(bag)
    facts["peak_rss_gb"] = _peak_rss_gb()
    text = {"token_ids": ids, "evidence": evidence, "bag": bag, "labels": labels,
            "sentences": None if tokenizer is None else [tokenizer.decode(t) for t in ids],
            "pieces": None if tokenizer is None else [[tokenizer.decode([i]) for i in t]
                                                      for t in ids]}
    status, protected_by = _status(rec)
    return AttackOutcome(status, reason=rec.reason, reading="gradient",
                         seconds=time.perf_counter() - t0, reconstruction=facts,
                         protected_by=protected_by, text=text)


def _peak_rss_gb() -> float:
    """The peak resident size of the process the attack ran in, so far (GB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _status(rec: Any) -> tuple[str, str | None]:
    """The plugin's status of a ``TextReconstruction`` (and why it is ``protected``). An
    encoder whose positions did not separate gave the server the batch's tokens (``rec.bag``):
    read in part, never ``protected``."""
    if rec.limit == "positions":
        return verdicts.PARTIAL, None
    if rec.stopped == "not-identifiable":
        return verdicts.PROTECTED, rec.limit
    if rec.stopped == "not-applicable":
        return verdicts.NOT_COVERED, None
    if rec.certified:
        return verdicts.CERTIFIED, None
    if rec.stopped == "complete" or not rec.token_ids:
        return verdicts.NOT_CERTIFIED, None
    return verdicts.PARTIAL, None
