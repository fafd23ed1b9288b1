"""A candidate batch as the client's training step saw it: padded ids, the next-token loss and
the output layer's inputs. Used to read the last tokens and to recompute the update."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

#: Label id the loss ignores (``transformers``' convention).
IGNORE = -100


def padded(sentences: Sequence[Sequence[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (pad: the first id of the first sentence) and the attention mask."""
    n = max(len(s) for s in sentences)
    pad = sentences[0][0]
    ids = torch.full((len(sentences), n), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(sentences), n), dtype=torch.long, device=device)
    for i, s in enumerate(sentences):
        ids[i, : len(s)] = torch.as_tensor(list(s), device=device)
        mask[i, : len(s)] = 1
    return ids, mask


def logits_and_head_inputs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                           head: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits and the input of ``head`` (default: the output layer) at every
    position it sees (a forward hook)."""
    seen: list[torch.Tensor] = []
    head = model.get_output_embeddings() if head is None else head
    hook = head.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        hook.remove()
    return logits, seen[0]


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    open_ends: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over the labelled positions, as ``transformers`` computes it.

    Parameters
    ----------
    logits, ids, mask
        (b, n, V), (b, n), (b, n).
    open_ends
        (b,) per sentence, the position whose label is unknown (-1: none): its term is
        ``logsumexp(z)`` alone (the softmax part of the cross-entropy; the label's part is what
        the caller reads), and it counts in the mean.

    Returns
    -------
    loss, count
        The loss and the number of labelled positions it averages over.
    """
    labels = ids.clone()
    labels[mask == 0] = IGNORE
    labels = labels[:, 1:]
    z = logits[:, :-1]
    known = labels != IGNORE
    total = torch.nn.functional.cross_entropy(z[known], labels[known], reduction="sum")
    count = int(known.sum())
    if open_ends is not None and bool((open_ends >= 0).any()):
        rows = torch.nonzero(open_ends >= 0).flatten()
        total = total + torch.logsumexp(logits[rows, open_ends[rows]], dim=-1).sum()
        count += int(rows.numel())
    return total / count, count
