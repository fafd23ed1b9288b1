"""fl_attack: exact gradient inversion of ReLU layers (SPEAR, SPEAR++), torch + numpy only.

The one-call entry point is :func:`invert`; each step of the attack lives in its own module
(``decompose`` -> ``rounds`` (``search``, ``sampling``, ``polish``, ``faces``) -> ``pool`` ->
``certify`` (``match``, ``feasibility``) -> ``rounds.complete`` (``completion``) -> ``select``
-> ``scale``), driven by ``loop``; ``docs/algorithm.md`` walks through the pipeline with the
papers' section numbers.

Where the attacked layer is not the model's first (a CNN's ``fc1``), the recovered inputs are
features; :mod:`fl_attack.model.split` cuts a model at the attacked layer and
:mod:`fl_attack.pixels` estimates the pictures behind the features (SPEAR §6.4).

The simulation and evaluation toolkit (data, models, local training, scores) lives in
:mod:`fl_attack.testbed`; its old names (``fl_attack.data``, ``fl_attack.models``, ...) still
import, with a ``DeprecationWarning`` (:mod:`fl_attack._moved`).
"""

from fl_attack._moved import install as _install_moved
from fl_attack.attack import Reconstruction, invert
from fl_attack.config import AttackConfig

__all__ = ["AttackConfig", "Reconstruction", "invert"]
__version__ = "0.1.0"

__getattr__ = _install_moved(__name__)
