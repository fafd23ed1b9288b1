"""fl_attack: exact gradient inversion of ReLU layers (SPEAR, SPEAR++), torch + numpy only.

The one-call entry point is :func:`invert`; each step of the attack lives in its own module
(``decompose`` -> ``search`` / ``sampling`` -> ``polish`` / ``refine`` -> ``filtering``
-> ``select`` -> ``scale``).
"""

from fl_attack.attack import Reconstruction, invert
from fl_attack.config import AttackConfig

__all__ = ["AttackConfig", "Reconstruction", "invert"]
__version__ = "0.1.0"
