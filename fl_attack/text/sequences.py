"""Sentences assembled position by position through the first block (DAGER §4.2, decoders).

A causal decoder's first block sees, at position p, only the tokens at positions 0..p. So a
prefix of length p extended by a candidate token gives one vector at each later layer input,
computable by the server from the weights it sent; the extension is one of the batch's only if
that vector lies in the span the gradient of that layer holds. Two such checks run here, the
cheap one first:

1. **Block 0's MLP input** (beyond the paper): ``post_attention_layernorm(e + attention)`` is
   the input of block 0's ``gate_proj``/``up_proj`` (GPT-2: ``c_fc``), whose gradient spans it.
   It costs the attention and one projection per candidate, not the MLP.
2. **Block 1's attention input** (DAGER's check): block 0's output through block 1's input norm,
   computed only for the candidates the first check kept.

Every kept prefix's keys and values are cached, so one step costs a matrix product over
(prefixes × candidate tokens), never a forward pass over whole sequences. A prefix with no kept
extension has reached the last position that carries a loss gradient: under next-token loss,
its sentence's last token is missing from every span and is read from the output layer
(:mod:`fl_attack.text.last_token`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fl_attack.core.clock import passed
from fl_attack.text.families import Family
from fl_attack.text.span import ACCEPT, Span

#: Elements of one (prefixes × tokens × heads × keys) score block; bounds memory per chunk.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class Prefixes:
    """Kept prefixes of one length, with block 0's cached keys and values.

    Attributes
    ----------
    tokens : torch.Tensor
        (P, p) token ids.
    keys, values : torch.Tensor
        (P, p, kv_heads, head_dim) block 0's keys (positions applied) and values.
    distances : torch.Tensor
        (P, p, 2) each position's relative distance to the MLP-input span and to block 1's
        span (NaN where a check did not run).
    """

    tokens: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    distances: torch.Tensor


@dataclass
class Growth:
    """What the assembly found.

    Attributes
    ----------
    leaves : list[Prefixes]
        Prefixes no candidate extended, one ``Prefixes`` per length.
    accepted_max, rejected_min : float
        The largest score (:meth:`Span.score`) of a kept extension and the smallest of a
        rejected one at the first check that ran (block 0's MLP input where given): the margin
        the certificate asks for.
    confirm_max : float
        The largest score of a kept extension at block 1's check, when both ran.
    stopped : str
        ``"complete"``, ``"budget"`` or ``"ambiguous"`` (more prefixes kept at a position than
        the span holds vectors: the checks do not separate).
    """

    leaves: list[Prefixes] = field(default_factory=list)
    accepted_max: float = 0.0
    rejected_min: float = float("inf")
    confirm_max: float = 0.0
    stopped: str = "complete"


def grow(family: Family, candidates: list[torch.Tensor], spans: dict[str, Span | None], *,
         max_prefixes: int, deadline: float | None) -> Growth:
    """Assemble every sentence prefix the spans hold.

    Parameters
    ----------
    family
        The model's adapter.
    candidates
        Token ids that may stand at each position (index p; the last entry is reused past the
        end: rotary models pass the whole bag once).
    spans
        ``"mlp"``: block 0's MLP-input span, ``"attn1"``: block 1's attention-input span (either
        may be None, not both).
    max_prefixes
        The span's rank: stop as ``"ambiguous"`` when more prefixes are kept at one position,
        or a prefix grows longer, than the span holds vectors.
    deadline
        ``time.perf_counter()`` value after which the assembly stops as ``"budget"``.
    """
    ref = family.embed.weight
    with torch.no_grad():
        probe = family.embeddings(candidates[0][:1], 0)
        _, k0, _ = family.qkv(family.attn_input(0, probe), 0)
    empty = k0.new_zeros(1, 0, *k0.shape[1:])
    live = Prefixes(torch.zeros(1, 0, dtype=torch.long, device=ref.device), empty, empty.clone(),
                    torch.zeros(1, 0, 2, dtype=torch.float64, device=ref.device))
    out = Growth()
    p = 0
    while live.tokens.shape[0]:
        if passed(deadline):
            out.stopped = "budget"
            out.leaves.append(live)
            break
        cand = candidates[min(p, len(candidates) - 1)]
        nxt, extended = _step(family, live, cand, p, spans, out)
        if (~extended).any():
            out.leaves.append(_take(live, ~extended))
        if nxt.tokens.shape[0] > max_prefixes:
            out.stopped = "ambiguous"
            out.leaves.append(nxt)
            break
        live, p = nxt, p + 1
        if p > max_prefixes and live.tokens.shape[0]:
            out.stopped = "ambiguous"       # longer than the span has vectors
            out.leaves.append(live)
            break
    out.leaves = [leaf for leaf in out.leaves if leaf.tokens.shape[1] > 0]
    return out


@torch.no_grad()
def _step(family: Family, live: Prefixes, cand: torch.Tensor, p: int,
          spans: dict[str, Span | None], out: Growth) -> tuple[Prefixes, torch.Tensor]:
    """Extend every live prefix by every candidate token at position ``p``."""
    e = family.embeddings(cand, p)
    q, k, v = family.qkv(family.attn_input(0, e), p)
    n_pre, n_tok = live.tokens.shape[0], cand.shape[0]
    per_tok = max(1, n_pre * q.shape[1] * (p + 1))
    step = max(1, CHUNK_ELEMENTS // per_tok)
    kept_pre, kept_tok, kept_dist = [], [], []
    for lo in range(0, n_tok, step):
        sl = slice(lo, lo + step)
        h = _attend(family, live, q[sl], k[sl], v[sl], e[sl])  # (P, T, d)
        flat, dist = _check(family, h.flatten(0, 1), spans, out)
        kept_pre.append(flat // h.shape[1])
        kept_tok.append(flat % h.shape[1] + lo)
        kept_dist.append(dist)
    pre = torch.cat(kept_pre)
    tok = torch.cat(kept_tok)
    dist = torch.cat(kept_dist)
    if not family.positional_inputs and p > 0:
        # A prefix of one repeated token t extended by t: every value is v_t, so attention
        # gives v_t whatever the positions, and the vector repeats the parent's exactly. The
        # update cannot tell `t t` from `t`: such extensions are dropped (a sentence that
        # starts so is read without its repeats, and the recomputed update refuses it).
        same = (live.tokens[pre] == cand[tok][:, None]).all(dim=1)
        pre, tok, dist = pre[~same], tok[~same], dist[~same]
    extended = torch.zeros(n_pre, dtype=torch.bool, device=pre.device)
    extended[pre] = True
    nxt = Prefixes(
        tokens=torch.cat([live.tokens[pre], cand[tok][:, None]], dim=1),
        keys=torch.cat([live.keys[pre], k[tok][:, None]], dim=1),
        values=torch.cat([live.values[pre], v[tok][:, None]], dim=1),
        distances=torch.cat([live.distances[pre], dist[:, None]], dim=1))
    return nxt, extended


def _attend(family: Family, live: Prefixes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            e: torch.Tensor) -> torch.Tensor:
    """Block 0's residual stream after attention for every (prefix, token) pair: (P, T, d)."""
    g = family.groups
    n_tok, kvh, hd = k.shape
    qg = q.view(n_tok, kvh, g, hd)
    scale = family.scaling
    past = torch.einsum("tkgh,pskh->ptkgs", qg, live.keys) * scale      # (P, T, kvh, g, p)
    own = torch.einsum("tkgh,tkh->tkg", qg, k)[None, ..., None] * scale  # (1, T, kvh, g, 1)
    own = own.expand(past.shape[0], -1, -1, -1, -1)
    w = torch.softmax(torch.cat([past, own], dim=-1), dim=-1)
    att = torch.einsum("ptkgs,pskh->ptkgh", w[..., :-1], live.values)
    att = att + w[..., -1:] * v[None, :, :, None, :]
    att = att.flatten(2)                                                # (P, T, d)
    return family.after_attention(e[None].expand(att.shape[0], -1, -1), att)


def _check(family: Family, h: torch.Tensor, spans: dict[str, Span | None], out: Growth
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the rows of ``h`` both checks keep, and their two distances."""
    idx = torch.arange(h.shape[0], device=h.device)
    dist = torch.full((h.shape[0], 2), float("nan"), dtype=torch.float64, device=h.device)
    first = True
    if spans.get("mlp") is not None:
        d, score = spans["mlp"].score(family.mlp_input(h))
        dist[:, 0] = d
        _margin(out, score)
        idx, first = idx[score < ACCEPT], False
    if spans.get("attn1") is not None and idx.numel():
        d, score = spans["attn1"].score(family.attn_input(1, family.after_mlp(h[idx])))
        dist[idx, 1] = d
        if first:
            _margin(out, score)
        elif (score < ACCEPT).any():
            out.confirm_max = max(out.confirm_max, float(score[score < ACCEPT].max()))
        idx = idx[score < ACCEPT]
    return idx, dist[idx]


def _margin(out: Growth, score: torch.Tensor) -> None:
    ok = score < ACCEPT
    if ok.any():
        out.accepted_max = max(out.accepted_max, float(score[ok].max()))
    if (~ok).any():
        out.rejected_min = min(out.rejected_min, float(score[~ok].min()))


def _take(live: Prefixes, mask: torch.Tensor) -> Prefixes:
    return Prefixes(live.tokens[mask], live.keys[mask], live.values[mask],
                    live.distances[mask])

