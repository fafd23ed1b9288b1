"""The search that runs the steps (:mod:`fl_attack.steps`): its state, its candidate pool, its
rounds and stop rule, the certificate, and the three ways ``invert`` attacks a layer.

=========================  ====================================================================
``solver.output_side``     ``sparse="output"``: ∂L/∂Z sparse, level by level (peeling)
``solver.input_side``      ``sparse="input"``: the layer's inputs sparse (a ReLU before it)
``solver.both_sides``      ``sparse="auto"``: the output side, then the input side; the better
``solver.loop``            the search loop and its stop rule
``solver.candidates``      where candidates come from: search rounds, faces, completions
``solver.pool``            the candidate pool, sparsest first; stage 1 of the selection
``solver.certify``         trust after each step, the final selection, the certificate
``solver.violations``      under noise: columns that break the ReLU law, replaced
``solver.untangle``        samples read only up to a mixture, read through the next layer
``solver.state``           what every step reads (``SearchContext``) and what changes
=========================  ====================================================================
"""
