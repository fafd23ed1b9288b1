"""A reply's way in: the one place the server reads the Flower ``Message`` s clients send.

=========================  ====================================================================
``intake.reply``           can the reply be aggregated, what does it say, what is attacked
                           (a job from ``jobs``, or the outcome that says why there is none)
``intake.facts``           ``ReplyFacts``: what the server read off a reply before any attack
=========================  ====================================================================
"""
