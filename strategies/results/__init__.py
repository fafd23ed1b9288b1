"""Records and scores: from an attack's outcome to the record the store writes.

=========================  ====================================================================
``results.records``        ``ClientAudit``, built from the reply's facts, the outcome and its
                           pictures; the round's numbers and log lines
``results.pictures``       reconstructed inputs as pictures, and scored against the truth
                           (``InputView``, ``GroundTruth``)
``results.text``           the sentences read off a language model's update, scored against
                           the truth (``TextTruth``, ROUGE, exact by token ids)
=========================  ====================================================================
"""
