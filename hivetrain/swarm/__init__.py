"""SWARM pipeline parallelism: stage servers, stochastic wiring, rerouting, rebalancing, per-stage DiLoCo."""
