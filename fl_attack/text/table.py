"""Block 0 of an encoder precomputed for the tokens seen at each position.

The encoder's whole-sentence searches (:mod:`fl_attack.text.relaxed`,
:mod:`fl_attack.text.polish`) evaluate block 0 on many sentences drawn from the same few
candidate tokens per position. A token's residual stream entering block 0 and the query, key
and value block 0 computes from it depend only on the token and its position, so they are
computed once per (position, candidate) here; a sentence's MLP inputs then need only the
attention and what follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_attack.text.families import Family


@dataclass(frozen=True)
class Table:
    """Per position, the candidate tokens (padded to K): their residual streams entering
    block 0 and the queries, keys and values block 0 computes from them.

    Attributes
    ----------
    stream : torch.Tensor
        (L, K, d) residual streams.
    qkv : tuple[torch.Tensor, ...]
        Queries, keys and values, each (L, K, heads, head_dim).
    ids : torch.Tensor
        (L, K) the token ids (0 where padded).
    valid : torch.Tensor
        (L, K) bool, which entries are candidates.
    """

    stream: torch.Tensor
    qkv: tuple[torch.Tensor, ...]
    ids: torch.Tensor
    valid: torch.Tensor


@torch.no_grad()
def build(family: Family, candidates: list[torch.Tensor]) -> Table:
    """The :class:`Table` of the candidate tokens at each position."""
    length, k = len(candidates), max(int(c.numel()) for c in candidates)
    rows = [family.embeddings(c, p) for p, c in enumerate(candidates)]
    stream = rows[0].new_zeros(length, k, rows[0].shape[-1])
    ids = torch.zeros(length, k, dtype=torch.long, device=stream.device)
    valid = torch.zeros(length, k, dtype=torch.bool, device=stream.device)
    for p, (c, row) in enumerate(zip(candidates, rows, strict=True)):
        stream[p, :c.numel()], ids[p, :c.numel()], valid[p, :c.numel()] = row, c, True
    flat = family.qkv(family.attn_input(0, stream.flatten(0, 1)), 0)
    return Table(stream, tuple(t.unflatten(0, (length, k)) for t in flat), ids, valid)


def _attend(family: Family, h: torch.Tensor, qkv: tuple[torch.Tensor, ...],
            alive: torch.Tensor) -> torch.Tensor:
    """Block 0's MLP inputs (N, L, d) from streams ``h`` and their queries, keys and values,
    each position attending to the positions ``alive`` (N, L) of its sentence."""
    q, k, v = qkv
    s = torch.einsum("nphd,nqhd->nhpq", q, k) * family.scaling
    s = s.masked_fill(~alive[:, None, None, :], float("-inf"))
    att = torch.einsum("nhpq,nqhd->nphd", torch.softmax(s, dim=-1), v).flatten(2)
    return family.mlp_input(family.after_attention(h, att))


def mixed(family: Family, table: Table, pi: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """Block 0's MLP inputs (N, L, d) of relaxed sentences ``pi`` (N, L, K): each position's
    stream, query, key and value are its candidates' mixed by ``pi`` (block 0 itself for
    one-hot ``pi``); a position attends to the positions ``alive`` (N, L) in its sentence."""
    w = pi.shape[1]
    h = torch.einsum("nlk,lkd->nld", pi, table.stream[:w])
    qkv = tuple(torch.einsum("nlk,lkhe->nlhe", pi, t[:w]) for t in table.qkv)
    return _attend(family, h, qkv, alive)


def chosen(family: Family, table: Table, choice: torch.Tensor, alive: torch.Tensor
           ) -> torch.Tensor:
    """Block 0's MLP inputs (N, L, d) of the sentences whose position ``p`` holds candidate
    ``choice[:, p]`` (N, L, indices into K), attending to the positions ``alive`` (N, L)."""
    at = torch.arange(choice.shape[1], device=choice.device)
    h = table.stream[at, choice]
    qkv = tuple(t[at, choice] for t in table.qkv)
    return _attend(family, h, qkv, alive)
