"""The attack job: built from plain arrays, run, its outcome classified. No Flower import: the
server's executors and the client's ``LeakGuard`` run the same code.

=========================  ====================================================================
``jobs.build``             ``attack_job``: the update ``sent -> returned`` as an ``AttackJob``,
                           or the outcome that says why there is none
``jobs.layers``            which linear layer is attacked: the first the attack covers
``jobs.model_plan``        the user's model around the attacked layer, and a job's pixel task
``jobs.run``               ``run_job``: ``fl_attack.invert`` under each reading, the verdict
``jobs.pixels``            pictures from exact features, inside the job (SPEAR §6.4)
``jobs.text``              a language model's update: ``TextJob`` and ``run_text_job``
                           (``fl_attack.text.invert_text``, DAGER)
``jobs.outcome``           ``AttackOutcome``: what every job gives back, plain data
=========================  ====================================================================
"""
