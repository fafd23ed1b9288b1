"""Sentences read off a language model's update, and scored against the truth.

* :class:`TextTruth` is the audit mode's text: the sentences the plugin's text clients draw
  from, indexed by the sample ids they report, tokenized as the clients tokenize them;
* :func:`sentences_of` turns one text attack's outcome into :class:`Sentences`: each sentence
  read, token by token, beside the client's own where the truth is known (matched by optimal
  assignment on ROUGE-1 + ROUGE-2), with the scores an auditor reads (ROUGE-1/2, exact).

A sentence with one wrong token is not read exactly: ``exact`` compares token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fl_attack_flwr.intake.facts import ReplyFacts
from fl_attack_flwr.jobs.outcome import AttackOutcome


class TextTruth:
    """The sentences the clients train on, indexed by the sample ids they report.

    Parameters
    ----------
    sentences : sequence of str, or str
        The sentences, or the name of a source ``fl_attack.testbed.text.sentences`` reads
        (``"wordnet"``, ``"fortunes"``), loaded on first use.
    tokenizer : tokenizer or str
        The clients' tokenizer (or a path to load it from): a sentence's token ids are
        ``tokenizer(sentence).input_ids``, as the clients compute them.
    """

    def __init__(self, sentences: Sequence[str] | str, tokenizer: Any) -> None:
        self._source = sentences
        self._tokenizer = tokenizer
        self._sentences: list[str] | None = None if isinstance(sentences, str) else list(
            sentences)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded on first use when given as a path)."""
        if isinstance(self._tokenizer, str):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer)
        return self._tokenizer

    def sentences(self, indices: Iterable[int]) -> list[str]:
        """The sentences of the given ids (``ValueError`` for ids out of range)."""
        if self._sentences is None:
            from fl_attack.testbed.text import sentences

            self._sentences = sentences(str(self._source))
        idx = [int(i) for i in indices]
        if not idx:
            raise ValueError("no sample indices")
        if min(idx) < 0 or max(idx) >= len(self._sentences):
            raise ValueError(f"sample index out of range [0, {len(self._sentences)})")
        return [self._sentences[i] for i in idx]

    def token_ids(self, indices: Iterable[int]) -> list[list[int]]:
        """The token ids of the given sentences, as the clients tokenize them."""
        return [list(self.tokenizer(s).input_ids) for s in self.sentences(indices)]


@dataclass
class Sentences:
    """A text attack's sentences for the reply's record.

    Attributes
    ----------
    read : list of dict
        One per sentence read: ``text`` (decoded, or None without a tokenizer), ``token_ids``,
        ``pieces`` (each token decoded alone, for the report), and with the truth ``original``,
        ``original_pieces`` and ``exact`` (token for token).
    missed : list of str
        The client's sentences no sentence read was matched to (with the truth).
    scores : dict or None
        With the truth: ``rouge1``, ``rouge2``, ``exact`` (share of the client's sentences read
        token for token), ``sentences_true``, ``batch_exact``.
    error : str or None
        Why the sentences could not be scored.
    """

    read: list[dict[str, Any]] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    scores: dict[str, Any] | None = None
    error: str | None = None


def sentences_of(outcome: AttackOutcome, facts: ReplyFacts,
                 truth: TextTruth | None) -> Sentences:
    """The sentences of a text attack's ``outcome``, scored against ``truth`` when the reply
    reports its sample ids (audit mode)."""
    text = outcome.text or {}
    ids = [list(map(int, t)) for t in text.get("token_ids") or []]
    texts = text.get("sentences") or [None] * len(ids)
    pieces = text.get("pieces") or [None] * len(ids)
    labels = text.get("labels") or [None] * len(ids)
    read = [{"text": t, "token_ids": i, "pieces": p, **({} if y is None else {"label": y})}
            for t, i, p, y in zip(texts, ids, pieces, labels, strict=True)]
    out = Sentences(read=read)
    if truth is None or not facts.sample_indices:
        return out
    try:
        originals = truth.sentences(facts.sample_indices)
        original_ids = truth.token_ids(facts.sample_indices)
        decode = truth.tokenizer.decode
        from fl_attack.testbed.text import match_text

        score, matched = match_text(ids, original_ids, decode)
    except (ValueError, ImportError) as exc:
        out.error = f"the sentences could not be scored: {exc}"
        return out
    for i, j in enumerate(matched):
        if j is None:
            out.missed.append(originals[i])
            continue
        read[j].update(original=originals[i], original_ids=original_ids[i],
                       original_pieces=[decode([t]) for t in original_ids[i]],
                       exact=read[j]["token_ids"] == original_ids[i])
    out.scores = {"rouge1": score.rouge1, "rouge2": score.rouge2, "exact": score.exact,
                  "sentences_exact": round(score.exact * len(originals)),
                  "sentences_true": len(originals), "batch_exact": score.batch_exact}
    return out
