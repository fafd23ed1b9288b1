"""Where attack jobs run; every executor turns a job into a future of its outcome that never
fails (a timeout, a dead worker, a memory cap are outcomes).

=========================  ====================================================================
``executors.processes``    a thread of the server (inline) or spawned worker processes; and
                           ``make_executor``, which builds the one the settings name
``executors.ray_actors``   long-lived Ray actors, on the simulation's Ray or a cluster
``executors.base``         the interface, the workers' set-up, a finished future's outcome
=========================  ====================================================================
"""
