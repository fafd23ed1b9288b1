"""The building blocks the attack's steps and its solver share; none is a step itself.

=========================  ====================================================================
``core.clock``             the time budget of one call and the seconds each step took
``core.tuning``            the search's tuning constants (``Tuning``, defaults in ``TUNING``)
``core.columns``           candidate columns: numerical zeros, unit columns, duplicates, patterns
``core.kernels``           kernels of L on row sets: batched Gram algebra, the pattern-kernel test
``core.batched_lu``        batched LU solves on the CPU that cannot hang
=========================  ====================================================================
"""
