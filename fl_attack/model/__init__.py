"""The model around the attacked layer: what a server or a client has (state dicts, an
``nn.Module``), turned into what the attack and the pixel step take.

=========================  ====================================================================
``model.updates``          the update pair ``(W0 - W_E, b0 - b_E, W0, b0)`` of two state dicts;
                           the linear layers of a state dict
``model.split``            the forward pass up to the attacked layer, and what surrounds it
=========================  ====================================================================
"""
