"""What a run writes and decides: the run directory, the summary and its verdict, the report,
the privacy gate.

=========================  ====================================================================
``output.store``           ``AuditStore``: the run's directory, one writer for every file
``output.private_files``   owner-only, atomic files; ``metrics.jsonl`` read back
``output.summary``         ``summary.json``: the run's totals and the verdict in plain words
``output.progress``        leakage per round beside the model's accuracy
``output.report``          ``report.html``: one self-contained page
``output.text_report``     the report's words, tables and sentences for language models
``output.png``             image grids as PNG
``output.privacy_gate``    ``fail-on``: fail a run whose clients leak (``PrivacyGateError``)
=========================  ====================================================================
"""
