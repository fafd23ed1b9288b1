"""Text: exact recovery of what clients fine-tune a language model on (DAGER).

The one-call entry point is :func:`invert_text`; it returns a :class:`TextReconstruction`.
Behind it, one module per step of the attack (``docs/algorithm.md``, "The text attack"):

==================  =========================================================================
``families``        adapters: where a model keeps embeddings, norms and projections
``span``            the span a linear layer's gradient holds, and distances to it
``tokens``          step 1, the token filter over the vocabulary (block 0)
``sequences``       step 2, sentences grown position by position (block 0's MLP, block 1)
``encoder``         step 2 for encoders: sentences searched as wholes, lengths, labels
``last_token``      step 3, each sentence's last token from the output layer
``certify``         step 4, the recovered batch recomputes the update
==================  =========================================================================

Only torch is imported: the model (a ``transformers`` module) is the caller's, so the library
imports without the ``text`` extra.
"""

from fl_attack.text.attack import invert_text
from fl_attack.text.families import UnsupportedModel
from fl_attack.text.result import SequenceEvidence, TextReconstruction

__all__ = ["SequenceEvidence", "TextReconstruction", "UnsupportedModel", "invert_text"]
