"""The attack's steps, one module each, in the order of the step table of ``docs/algorithm.md``
(the papers' sections in each module's docstring). A step is a function of tensors; the order
in which steps run, and what they are run on, is the solver's (:mod:`fl_attack.solver`).

=========================  ====================================================================
``steps.decompose``        1: ``G = L R`` and the batch size read off the spectrum
``steps.batch_size``       1: the batch size of a noisy update, chosen between two readings
``steps.tolerances``       2: the zero test and the noise test from the precision and the noise
``steps.search``           3: sparse directions as minima of φ(L q) on the sphere (SPEAR++)
``steps.sampling``         3: kernels of random row subsets (SPEAR)
``steps.polish``           4: rounding a direction to the exact kernel of its zero rows
``steps.filtering``        5: the sparsity a true column shows (τ), and under noise
``steps.faces``            6: splitting a face that several similar samples share
``steps.select``           7, 12: stage 1 (sparsest independent) and stage 2 (greedy swaps)
``steps.match``            8: the sparsity-matching coefficient λ
``steps.feasibility``      8: a partial basis's columns, one LP each
``steps.completion``       9: the missing columns from W and b
``steps.peel``             10: samples verified through the next layer and peeled off
``steps.scale``            13: the scales from the bias gradient, and the inputs
=========================  ====================================================================
"""
