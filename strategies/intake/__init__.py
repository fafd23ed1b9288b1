"""A reply's way in: the one place the server reads the Flower ``Message`` s clients send.

=========================  ====================================================================
``intake.reply``           can the reply be aggregated, what does it say, what is attacked
                           (a job from ``jobs``, or the outcome that says why there is none)
``intake.update``          the Flower-free half both readers share: can two state dicts be an
                           update, and its attack job with the facts it adds
``intake.files``           a reply read from files: saved weights (``.pt``, ``.npz``,
                           ``.safetensors``) loaded safely and checked against SENT
``intake.facts``           ``ReplyFacts``: what the server read off a reply before any attack
=========================  ====================================================================
"""
