"""The bundled Flower app's server side (its client side is ``fl_attack_flwr.clients``).

=========================  ====================================================================
``app.server_app``         the ``ServerApp`` (``fl_attack_flwr.app.server_app:app``): FedAvg
                           wrapped in the audit, configured from the run config
``app.run_config``         every run-config key with its default, checked before round 1
                           (``python -m fl_attack_flwr.app.run_config`` checks overrides)
``app.cli``                the ``fl-attack`` command: ``fl-attack audit SENT RETURNED`` audits
                           saved weights (``saved_audit.audit_update``)
=========================  ====================================================================
"""
