"""fl_attack: exact gradient inversion of ReLU layers (SPEAR, SPEAR++), torch + numpy only.

The one-call entry point is :func:`invert` (``attack``), with its options (``config``), the
checks of its arguments (``validation``), its result (``result``) and the errors that say why an
update cannot be inverted (``errors``). Behind it:

=========================  ====================================================================
``fl_attack.steps``        the papers' steps, one module each (decompose, search, polish, ...)
``fl_attack.solver``       the search that runs the steps: rounds, stop rule, certificate, and
                           the output side, the input side and ``sparse="auto"``
``fl_attack.core``         what steps and solver share: the time budget, the tuning constants,
                           column and kernel algebra
``fl_attack.model``        state dicts and models around the attacked layer: the update pair
                           ``W0 - W_E``, the forward pass up to the layer
``fl_attack.pixels``       pictures behind a later layer's exact input features (SPEAR §6.4)
``fl_attack.text``         the text attack (DAGER): sentences behind a transformer's update,
                           ``fl_attack.text.invert_text``
``fl_attack.testbed``      data, models, local training and scores for experiments and tests
                           (the attack never imports it)
=========================  ====================================================================

``docs/algorithm.md`` walks through the pipeline step by step with the papers' section numbers
and the module of each step.
"""

from fl_attack.attack import invert
from fl_attack.config import AttackConfig
from fl_attack.result import Reconstruction

__all__ = ["AttackConfig", "Reconstruction", "invert"]
__version__ = "0.1.0"
