"""Discrete-event simulation of a volunteer swarm driven by hivetrain's own decision functions (``hivetrain sim``).

Roles: ``config`` (scenario TOML), ``peers`` (draws), ``network`` (link costs), ``dht`` (record board, sizes),
``schedule_model`` (phase ends), ``swarm_state`` (per-peer columns), ``rounds`` (matchmaking and averaging),
``dataparallel`` (the SimPy processes), ``partition`` (network split and heal), ``consensus`` (group averaging),
``metrics`` and ``report``.
Importing this package does nothing.
"""
