"""The fault-injection harness: run a real swarm on this machine, break it on purpose, report what it survived.

``hivetrain chaos run SCENARIO.toml --out DIR`` (see ``hivetrain.chaos.runner``); scenarios are described in
``hivetrain.chaos.scenario``, their faults in ``hivetrain.chaos.fault_models``. Importing this package starts nothing.
"""
