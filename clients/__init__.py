"""The plugin's client side (``fl_attack_flwr.clients``): what runs on a Flower client.

=========================  ====================================================================
``clients.leak_guard``     ``LeakGuard``: a client mod that runs the server's attack on the
                           client's own update before it leaves (``fl_attack_flwr.LeakGuard``)
``clients.client_app``     the bundled ``ClientApp`` (``fl_attack_flwr.clients.client_app:app``)
``clients.defaults``       the bundled ClientApp's run-config keys and defaults
``clients.partition``      how the bundled clients split a dataset among themselves
=========================  ====================================================================
"""
