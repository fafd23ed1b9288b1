"""Pixels from features: after SPEAR recovers a CNN's first linear layer's inputs exactly,
recover the images behind them (SPEAR §6.4; Kariyappa et al. 2023; Geiping et al. 2020).

=========================  ====================================================================
``pixels.invert``          :func:`invert_features`: the optimisation, its schedule and result
``pixels.terms``           the objective's terms: feature match, TV, gradient consistency
``pixels.upstream``        each sample's ∂L/∂Z and ∂L/∂features from the exact reconstruction
=========================  ====================================================================

The model is cut at the attacked layer by :func:`fl_attack.model.split.feature_extractor`.
"""

from fl_attack.pixels.invert import PixelConfig, PixelReconstruction, invert_features
from fl_attack.pixels.upstream import feature_gradients, output_gradients

__all__ = [
    "PixelConfig",
    "PixelReconstruction",
    "feature_gradients",
    "invert_features",
    "output_gradients",
]
