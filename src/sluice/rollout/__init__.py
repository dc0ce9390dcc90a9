"""Canary releases of model versions: aliases, sticky weights, analysis and decisions.

Pure logic, no I/O besides the state file: the server wires it in through an alias's
backend (:mod:`sluice.rollout.backend`).

- :mod:`~sluice.rollout.config`: the ``--models-config`` TOML file, checked;
- :mod:`~sluice.rollout.assignment`: sticky assignment by a stable hash of a routing key;
- :mod:`~sluice.rollout.analysis`: the sequential test of the canary against stable;
- :mod:`~sluice.rollout.state`: one alias's rollout, its state table and decisions;
- :mod:`~sluice.rollout.store`: the state file, written atomically;
- :mod:`~sluice.rollout.controller`: every alias's rollout in one place.
"""
