"""Composition: the only code that runs several stages, or builds an engine and a proxy for them.

Stages never call each other (they meet in shards); commands parse options and call one stage or
one flow. A flow is what a Makefile over the stage commands would do, plus what only one process
can: keep one engine loaded across stages and reload it with each new checkpoint.

- :mod:`legorl.flows.policy`: the policy as a proxy (an embedded engine or an external proxy);
- :mod:`legorl.flows.online`: the online loop, rollout → grade → train → reload;
- :mod:`legorl.flows.evaluate`: an eval, rollout → grade in ``RUN/eval`` → report.

Flows print nothing; they report through the callbacks they are given.
"""
