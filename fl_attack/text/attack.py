"""``invert_text``: the sentences behind a transformer's update (DAGER), in one call."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fl_attack.core.clock import Clock
from fl_attack.errors import NotIdentifiable
from fl_attack.text import certify, encoder, relaxed
from fl_attack.text.families import Family, Reader, family_of
from fl_attack.text.last_token import INTEGER_TOL, Endings, read_endings
from fl_attack.text.result import SequenceEvidence, TextReconstruction
from fl_attack.text.sequences import Growth, grow
from fl_attack.text.span import Span, read_span, storage_rounding
from fl_attack.text.tokens import TokenFilter, filter_tokens


def invert_text(model: nn.Module, gradients: Mapping[str, Any], *, batch_size: int | None = None,
                max_seconds: float | None = 120.0, seed: int = 0,
                device: str | torch.device | None = None,
                weights_dtype: str | None = None) -> TextReconstruction:
    """Recover the token sequences behind one FedSGD step of next-token fine-tuning (decoders)
    or of sequence classification (encoders, whose labels are read too).

    Parameters
    ----------
    model
        The model the client started from (a ``transformers`` model of a covered family:
        LLaMA/Mistral/Qwen2 with rotary positions, GPT-2 with learned positions, both causal
        LMs; BERT/MiniLM encoders, with a sequence-classification head). Not modified.
    gradients
        Parameter name (as in ``model.named_parameters()``) → its gradient, torch or NumPy.
        Needed: block 0's attention projections (``q_proj``/``k_proj``/``v_proj``; GPT-2
        ``c_attn``; BERT ``query``/``key``/``value``), and block 0's MLP input projections
        and/or block 1's attention projections (encoders: block 0's ``intermediate.dense``);
        the output layer's weight (the tied embedding where tied) gives the last tokens, a
        classifier's ``classifier.weight`` its labels. Others are ignored.
    batch_size
        The number of sentences, if known: a recovery of another count is not certified.
    max_seconds
        Time budget of the call (None: none); the token filter and the assembly stop there.
    seed
        Accepted for symmetry with :func:`fl_attack.invert`; the attack is deterministic.
    device
        Where to compute (default: the model's device). The model is copied there if needed.
    weights_dtype
        ``None``: ``gradients`` are gradients. ``"float32"``, ``"bfloat16"`` or ``"float16"``:
        they are weight differences ``W₀ − W₁`` of one local step (FedSGD as Flower clients send
        it: the weights after the step), with ``W₁`` stored in that dtype. Its rounding, known
        entry by entry from ``W₀`` (the model) and the difference, sets the spans' floor and
        is allowed in the certificate's residual, and nothing more.

    Returns
    -------
    TextReconstruction

    Raises
    ------
    fl_attack.text.families.UnsupportedModel
        The model's family has no adapter.
    ValueError
        A needed gradient is missing, has the wrong shape or dtype, or holds NaN/Inf.

    Examples
    --------
    >>> rec = invert_text(model, {n: p.grad for n, p in model.named_parameters()})  # doctest: +SKIP
    >>> [tokenizer.decode(ids) for ids in rec.token_ids]                           # doctest: +SKIP
    """
    del seed
    clock = Clock(max_seconds)
    if device is not None and next(model.parameters()).device != torch.device(device):
        import copy

        model = copy.deepcopy(model).to(device)
    family = family_of(model)
    with _eval(model):
        grads = _validated(family, gradients)
        return _run(family, grads, _storage(family, grads, weights_dtype), batch_size, clock)


def _storage(family: Family, grads: dict[str, torch.Tensor], weights_dtype: str | None
             ) -> dict[str, torch.Tensor] | None:
    """Per parameter read, the storage rounding of a weight difference (None for gradients)."""
    if weights_dtype is None:
        return None
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if weights_dtype not in dtypes:
        raise ValueError(f"weights_dtype must be one of {sorted(dtypes)} or None, got "
                         f"{weights_dtype!r}")
    params = dict(family.model.named_parameters())
    return {n: storage_rounding(params[n], g, dtypes[weights_dtype]).float()
            for n, g in grads.items()}


def _run(family: Family, grads: dict[str, torch.Tensor],
         storage: dict[str, torch.Tensor] | None, batch_size: int | None, clock: Clock
         ) -> TextReconstruction:
    t0 = time.perf_counter()
    try:
        spans, used = _spans(family, grads, storage)
    except NotIdentifiable as err:
        stopped = "not-applicable" if err.reason == "adapter-rank" else "not-identifiable"
        return TextReconstruction([], [], False, stopped, str(err), limit=err.reason,
                                  family=family.name, seconds=clock.elapsed())
    clock.tick("spans", t0)
    t0 = time.perf_counter()
    bag = filter_tokens(family, spans["attn0"], deadline=clock.deadline)
    clock.tick("tokens", t0)
    if family.bidirectional:
        return _run_encoder(family, grads, storage, spans, used, bag, batch_size, clock)
    t0 = time.perf_counter()
    limit = (spans["attn1"] or spans["mlp"]).rank
    growth = grow(family, bag.candidates, spans, max_prefixes=limit, deadline=clock.deadline)
    clock.tick("sequences", t0)
    leaves = [(list(map(int, row)), [tuple(map(float, d)) for d in dist])
              for leaf in growth.leaves for row, dist in zip(leaf.tokens.tolist(),
                                                             leaf.distances.tolist(),
                                                             strict=True)]
    t0 = time.perf_counter()
    nodes = _with_inner(leaves)
    out_name = family.output_weight()
    endings = None
    if out_name in grads and leaves:
        weight = dict(family.model.named_parameters())[out_name]
        with _grad_on(weight):
            endings = read_endings(family.model, weight, grads[out_name],
                                   [t for t, _ in nodes], len(leaves))
    clock.tick("last_token", t0)
    sequences = _relative_counts(_sequences(nodes, len(leaves), endings), batch_size)
    rec = _verdict(family, grads, storage, spans, used, bag, growth, sequences, endings,
                   batch_size, clock)
    rec.bag = _bag(bag)
    rec.seconds = clock.elapsed()
    return rec


def _bag(bag: TokenFilter) -> list[int]:
    return sorted({int(t) for c in bag.candidates for t in c.tolist()})


def _run_encoder(family: Family, grads: dict[str, torch.Tensor],
                 storage: dict[str, torch.Tensor] | None, spans: dict[str, Span | None],
                 used: list[str], bag: TokenFilter, batch_size: int | None, clock: Clock
                 ) -> TextReconstruction:
    """An encoder's sentences (:mod:`fl_attack.text.encoder`), then its labels and certificate."""
    common = dict(family=family.name, bag=_bag(bag),
                  ranks={k: s.rank for k, s in spans.items() if s is not None})
    cands = bag.candidates
    if spans.get("mlp") is None:
        raise ValueError("an encoder's sentences are searched at block 0's MLP input: the "
                         f"gradients lack {', '.join(r.name for r in family.readers(0, 'mlp'))}")
    if bag.stopped == "budget" or not cands:
        return TextReconstruction([], [], False, "budget" if cands else "complete",
                                  "the token filter " + ("ran out of time" if cands else
                                                         "found no token"),
                                  seconds=clock.elapsed(), **common)
    found_pairs = encoder.pairs(family, cands, spans["attn0"].rank)
    t0 = time.perf_counter()
    options = ([] if found_pairs is None else
               encoder.layouts(found_pairs, spans["mlp"].rank, batch_size))
    whole = not options   # positions not separated, or no layout of lengths fits the pairs
    found = (relaxed.read(family, cands, spans, deadline=clock.deadline) if whole else
             encoder.assemble(family, found_pairs, spans, options, deadline=clock.deadline))
    clock.tick("sequences", t0)
    t0 = time.perf_counter()
    labels, unproven, residuals = _encoder_certificate(family, grads, storage, used, found)
    if batch_size is not None and found.tokens and len(found.tokens) != batch_size:
        unproven.append(f"{len(found.tokens)} sentence(s) read where the batch holds "
                        f"{batch_size}")
    clock.tick("certify", t0)
    sequences = [SequenceEvidence(t, d, None, None) for t, d in zip(found.tokens,
                                                                    found.distances,
                                                                    strict=True)]
    certified = not unproven
    n = len(found.tokens)
    reason = (f"read {n} sentence(s) exactly (certified): every position lies in block 0's "
              "MLP-input span, the labels are read from the head's update and the batch "
              "with them reproduces the update" if certified else
              f"read {n} sentence(s), not certified: " + "; ".join(unproven))
    limit = None
    if whole and found.stopped != "complete":
        limit = "positions"
        reason = (f"read the batch's {len(common['bag'])} distinct tokens; the first block does "
                  f"not say where they stand ({sum(int(c.numel()) for c in cands)} (token, "
                  f"position) pairs lie in block 0's span of rank {spans['attn0'].rank} and "
                  "no layout of sentence lengths places them), and the search over "
                  f"whole sentences filled {sum(map(len, found.tokens))} of the "
                  f"{spans['mlp'].rank} positions; " + reason)
    return TextReconstruction(found.tokens, sequences, certified, found.stopped, reason,
                              labels=labels, residuals=residuals, limit=limit,
                              margins={"tokens_accepted_max": bag.accepted_max,
                                       "tokens_rejected_min": bag.rejected_min,
                                       "positions_worst": found.worst},
                              timings=dict(clock.timings), seconds=clock.elapsed(), **common)


def _encoder_certificate(family: Family, grads: dict[str, torch.Tensor],
                         storage: dict[str, torch.Tensor] | None, used: list[str],
                         found: encoder.Found
                         ) -> tuple[list[int] | None, list[str], dict[str, float]]:
    """The labels read from the head's update, and what keeps the batch from being proven:
    the search not complete, the labels unread, or the update recomputed with the batch and
    its labels not matching (``certify.recompute``). The token filter's margin is not asked
    for: an encoder's filter keeps pairs the span cannot tell from the batch's by design
    (:mod:`fl_attack.text.encoder`), and a token missed or misplaced leaves the recomputed
    update 0.2-0.65 off (MiniLM), where rounding explains 1e-3."""
    unproven = []
    if found.stopped != "complete":
        unproven.append(f"the search ended {found.stopped!r} with a position at score "
                        f"{found.worst:.2g}")
    head = family.classifier()
    name = None if head is None else family.name_of(head.weight)
    if name is None or name not in grads:
        unproven.append("the update has no gradient for the classification head, whose "
                        "update gives the labels the certificate recomputes the update with")
    if unproven or not found.tokens:
        return None, unproven or ["no sentence was read"], {}
    read = certify.read_labels(family.model, head, found.tokens, grads[name])
    if read is None:
        return None, ["the labels could not be read from the head's update (the sentences' "
                      "head inputs are dependent, or no class has a negative coefficient)"], {}
    names = used + [name]
    check = certify.recompute(family.model, found.tokens, {n: grads[n] for n in names},
                              storage, labels=read.labels)
    for n, value in check.unexplained.items():
        unproven.append(f"the recovered batch reproduces the update of {n} only to "
                        f"{value:.2g} relative error (rounding explains {check.allowed[n]:.2g})")
    return read.labels, unproven, check.residuals


def _with_inner(leaves: list[tuple[list[int], list[tuple[float, float]]]]
                ) -> list[tuple[list[int], list[tuple[float, float]]]]:
    """The leaves, then every shorter prefix of them (where a sentence may end too)."""
    seen = {tuple(t) for t, _ in leaves}
    inner = []
    for tokens, dist in leaves:
        for k in range(1, len(tokens)):
            if tuple(tokens[:k]) not in seen:
                seen.add(tuple(tokens[:k]))
                inner.append((tokens[:k], dist[:k]))
    return leaves + inner


def _sequences(nodes: list[tuple[list[int], list[tuple[float, float]]]], leaves: int,
               endings: Endings | None) -> list[SequenceEvidence]:
    """Sentences: each prefix with each token read after it; a leaf with none read is kept
    without its last token (an inner prefix with none ends no sentence)."""
    out = []
    for j, (prefix, dist) in enumerate(nodes):
        labels = endings.labels[j] if endings else []
        if not labels:
            if j < leaves:
                out.append(SequenceEvidence(prefix, dist, None, None))
            continue
        for (tok, count), coef in zip(labels, endings.coefficients[j], strict=True):
            out.append(SequenceEvidence(prefix + [tok], dist, tok, coef, count))
    return out


def _relative_counts(sequences: list[SequenceEvidence], batch_size: int | None
                     ) -> list[SequenceEvidence]:
    """Counts divided by their common factor, then scaled to ``batch_size`` where it is a
    multiple: the update's scale is unknown (learning rate, sum or mean), so repeating the
    whole batch k times gives the same update and only the counts' ratios are read."""
    common = math.gcd(*(s.count for s in sequences)) if sequences else 1
    total = sum(s.count for s in sequences) // max(common, 1)
    factor = batch_size // total if batch_size and total and batch_size % total == 0 else 1
    for s in sequences:
        s.count = s.count // common * factor
        if s.last_coefficient is not None:
            s.last_coefficient = s.last_coefficient / common * factor
    return sequences


def _verdict(family: Family, grads: dict[str, torch.Tensor],
             storage: dict[str, torch.Tensor] | None, spans: dict[str, Span | None],
             used: list[str], bag: TokenFilter, growth: Growth, sequences: list[SequenceEvidence],
             endings: Endings | None, batch_size: int | None, clock: Clock
             ) -> TextReconstruction:
    """Assemble the result, recompute the update and decide the certificate."""
    token_ids = [s.token_ids for s in sequences for _ in range(s.count)]
    out_name = family.output_weight()
    not_carried = [] if endings is not None or not sequences else [
        "the last token of each sentence: under next-token loss it reaches no span and is "
        f"only the label of the position before, and the update has no gradient for {out_name}"]
    stopped, unproven = _stop_state(bag, growth)
    unproven += _margin_faults(bag, growth) + _rank_faults(family, spans, sequences)
    unproven += [f"tokens {', '.join(map(str, g))} have identical embeddings: the update "
                 "cannot tell them apart" for g in bag.twins]
    unproven += _ending_faults(sequences, len(token_ids), batch_size)
    t0 = time.perf_counter()
    residuals: dict[str, float] = {}
    # recomputed only where it decides: a batch already unproven is not run through the model
    # (an unsettled reading can hold thousands of sentences)
    if not unproven and not not_carried and token_ids and all(len(t) > 1 for t in token_ids):
        names = used + ([out_name] if out_name in grads else [])
        check = certify.recompute(family.model, token_ids, {n: grads[n] for n in names},
                                  storage)
        residuals = check.residuals
        for name, value in check.unexplained.items():
            unproven.append(f"the recovered batch reproduces the update of {name} only to "
                            f"{value:.2g} relative error (rounding explains "
                            f"{check.allowed[name]:.2g})")
    clock.tick("certify", t0)
    certified = not unproven and not not_carried
    n = len(token_ids)
    reason = (f"read {n} sentence(s) exactly (certified): every token passed the span checks "
              "with margin, the spans are fully explained and the batch reproduces the update"
              if certified else f"read {n} sentence(s), not certified: " +
              "; ".join(unproven + not_carried))
    return TextReconstruction(
        token_ids, sequences, certified, stopped, reason, not_carried=not_carried,
        family=family.name, ranks={k: s.rank for k, s in spans.items() if s is not None},
        margins={"tokens_accepted_max": bag.accepted_max, "tokens_rejected_min": bag.rejected_min,
                 "prefixes_accepted_max": growth.accepted_max,
                 "prefixes_rejected_min": growth.rejected_min,
                 "prefixes_confirm_max": growth.confirm_max},
        residuals=residuals, timings=dict(clock.timings))


def _stop_state(bag: TokenFilter, growth: Growth) -> tuple[str, list[str]]:
    """How the search ended, and the fault that is when it did not end on its own."""
    if bag.stopped == "budget" or growth.stopped == "budget":
        return "budget", ["the time budget ended the search"]
    if growth.stopped == "ambiguous":
        return "ambiguous", ["more prefixes passed the span checks at one position than the "
                             "span holds vectors: the checks do not separate (noise?)"]
    return "complete", []


def _ending_faults(sequences: list[SequenceEvidence], count: int, batch_size: int | None
                   ) -> list[str]:
    """Sentences without a last token or with one read off an integer, a wrong count."""
    out = []
    if not count:
        out.append("no sentence was read")
    missing = sum(s.last_token is None for s in sequences)
    if missing:
        out.append(f"{missing} sentence(s) without their last token")
    off = [s for s in sequences if s.last_coefficient is not None
           and abs(s.last_coefficient / s.count - 1.0) > INTEGER_TOL]
    if off:
        out.append(f"{len(off)} last token(s) read with a coefficient far from an integer")
    if batch_size is not None and count != batch_size:
        out.append(f"{count} sentences read, batch_size={batch_size} given")
    return out


def _margin_faults(bag: TokenFilter, growth: Growth) -> list[str]:
    out = []
    for what, acc, rej in (("tokens", bag.accepted_max, bag.rejected_min),
                           ("prefixes", growth.accepted_max, growth.rejected_min)):
        if acc * certify.MARGIN > rej:
            out.append(f"the {what} kept (score up to {acc:.2g}) and rejected (from "
                       f"{rej:.2g}) lie less than {certify.MARGIN:g}x apart")
    return out


def _rank_faults(family: Family, spans: dict[str, Span | None],
                 sequences: list[SequenceEvidence]) -> list[str]:
    """Spans with more directions than the recovered batch has distinct inputs there: some
    position of the update was not read. (Fewer is allowed: near-dependent inputs, such as one
    token at several learned positions of a fresh GPT-2, share directions below the rounding;
    the recomputed update judges those.)"""
    prefixes = {tuple(s.token_ids[: len(s.span_distances)]) for s in sequences}
    nodes = {p[:i] for p in prefixes for i in range(1, len(p) + 1)}
    inputs = ({(n[-1], len(n) - 1) for n in nodes} if family.positional_inputs
              else {n[-1] for n in nodes})
    expected = {"attn0": len(inputs), "mlp": len(nodes), "attn1": len(nodes)}
    return [f"{k}: the span has rank {s.rank}, the recovered batch explains {expected[k]}"
            for k, s in spans.items() if s is not None and s.rank > expected[k]]


def _spans(family: Family, grads: dict[str, torch.Tensor],
           storage: dict[str, torch.Tensor] | None = None
           ) -> tuple[dict[str, Span | None], list[str]]:
    """The three spans (None where no reader's gradient was given) and the names read."""
    out: dict[str, Span | None] = {}
    used: list[str] = []
    for key, block, part in (("attn0", 0, "attn"), ("mlp", 0, "mlp"), ("attn1", 1, "attn")):
        found = [r for r in (_rows(x, grads, storage) for x in family.readers(block, part))
                 if r]
        if not found:
            out[key] = None
            continue
        what = f"block {block} {part} ({found[0][0]})"
        for name, mat, rank, std in found:
            if rank and read_span(mat.double(), what=what, unit_roundoff=_roundoff(mat),
                                  stored=std).rank >= rank:
                raise NotIdentifiable(
                    f"not applicable: the LoRA adapter {name} has rank {rank}, and its gradient "
                    f"uses all {rank} directions: an adapter of rank {rank} cannot show more "
                    f"token positions than {rank}, so its span proves nothing about the tokens",
                    reason="adapter-rank", rank=rank, limit=rank)
        used += [name for name, *_ in found]
        stds = None if storage is None else torch.cat([std for *_, std in found])
        out[key] = read_span(torch.cat([m.double() for _, m, _, _ in found]), what=what,
                             unit_roundoff=max(_roundoff(m) for _, m, _, _ in found),
                             stored=stds)
    return out, used


def _rows(reader: Reader, grads: dict[str, torch.Tensor],
          storage: dict[str, torch.Tensor] | None = None
          ) -> tuple[str, torch.Tensor, int, torch.Tensor | None] | None:
    """The reader's gradient rows (the base weight's, else its LoRA adapter's), the adapter's
    rank (0 for a base weight) and, for a weight difference, the rows' storage rounding."""
    for name, transpose, rank in ((reader.name, reader.transpose, 0),
                                  (reader.adapter, False, reader.adapter_rank)):
        if name is not None and name in grads:
            g, std = grads[name], None if storage is None else storage[name]
            if transpose:
                g, std = g.T, None if std is None else std.T
            return name, g, rank, std
    return None


def _roundoff(m: torch.Tensor) -> float:
    return float(torch.finfo(m.dtype).eps) / 2


def _validated(family: Family, gradients: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The gradients the attack reads, on the model's device in their own float dtype (its
    rounding sets the spans' noise floor), checked."""
    if not isinstance(gradients, Mapping):
        raise ValueError(f"gradients must map parameter names to tensors, got "
                         f"{type(gradients).__name__}")
    params = dict(family.model.named_parameters())

    def names(readers: list[Reader]) -> list[str]:
        return [n for r in readers for n in (r.name, r.adapter) if n is not None]

    need = names(family.readers(0, "attn"))
    later = names(family.readers(0, "mlp") + family.readers(1, "attn"))
    head = family.classifier()
    wanted = need + later + [n for n in [family.output_weight()] if n is not None] + (
        [] if head is None else [family.name_of(head.weight)])
    if not any(n in gradients for n in need):
        raise ValueError(f"gradients lack {', '.join(need)}: block 0's attention projections "
                         "give the token filter")
    if not any(n in gradients for n in later):
        raise ValueError(f"gradients lack block 0's MLP and block 1's attention projections "
                         f"({', '.join(later)}): one of them orders the tokens into sentences")
    out = {}
    for name in wanted:
        if name not in gradients:
            continue
        g = torch.as_tensor(gradients[name])
        ref = params[name]
        if tuple(g.shape) != tuple(ref.shape):
            raise ValueError(f"gradient of {name} has shape {tuple(g.shape)}, the parameter "
                             f"{tuple(ref.shape)}")
        if not g.is_floating_point():
            raise ValueError(f"gradient of {name} has dtype {g.dtype}, not a float")
        if not torch.isfinite(g).all():
            raise ValueError(f"gradient of {name} holds NaN or Inf")
        out[name] = g.detach().to(device=ref.device)
    return out


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@contextlib.contextmanager
def _grad_on(param: nn.Parameter) -> Iterator[None]:
    was = param.requires_grad
    param.requires_grad_(True)
    try:
        yield
    finally:
        param.requires_grad_(was)
