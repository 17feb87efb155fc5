"""A ``join-swarm`` peer the chaos harness makes misbehave: ``python -m hivetrain.testing.hostile_peer [HARNESS FLAGS]
JOIN-SWARM ARGS``.

The harness flags never reach the user's command (``join-swarm --help`` has no hidden flags); this entry point parses
them, then runs the product's ``join_swarm.main`` with the rest:

    --fault SPEC         arm a fault at a hook point of production code (``hivetrain.faults.parse_fault_spec``);
                         repeatable
    --byzantine MODE     misbehave as MODE (``hivetrain.testing.byzantine``: armed as ``call`` faults); ``uninvited``
                         also ignores our own refusal in an invite-only run and joins anyway, as a modified client
                         would (no roster: it groups with, connects to and serves anyone)
    --data-announce-host HOST
                         announce this data-plane address instead of our own (a volunteer behind NAT:
                         ``chaos.fault_models.UNREACHABLE_HOST``)

Exit codes are ``join-swarm``'s; 2 for a bad harness flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger("hivetrain.hostile_peer")

ENTRY = "hivetrain.testing.hostile_peer"
"""The module a harness launches (``LocalSwarm.add_peer(entry=ENTRY)``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hivetrain.testing.hostile_peer", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC")
    parser.add_argument("--byzantine", default="", metavar="MODE")
    parser.add_argument("--data-announce-host", default="", metavar="HOST")
    return parser


def main(argv: list[str] | None = None) -> int:
    from hivetrain.cli import join_swarm
    from hivetrain.cli.common import EXIT_BAD_INPUT, fail
    from hivetrain.faults import FaultInjector, parse_fault_spec
    from hivetrain.testing.byzantine import arm_byzantine

    harness, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    faults = FaultInjector()
    try:
        for spec in harness.fault:
            faults.arm(parse_fault_spec(spec))
        arm_byzantine(harness.byzantine, faults)
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    if harness.byzantine == "uninvited":
        join_swarm.join_admission = _ignoring_refusal(join_swarm.join_admission)
    if harness.data_announce_host:
        join_swarm.data_plane_hosts = _announcing(join_swarm.data_plane_hosts, harness.data_announce_host)
    return join_swarm.main(rest, faults=faults)


def _ignoring_refusal(join_admission):
    """``join_admission`` of a modified client: it reads its own refusal, logs it and joins without a roster."""
    from hivetrain.cli.join_swarm import read_join_token
    from hivetrain.peers.membership import decide_membership, run_policy

    def joining_anyway(args, node, config, coordinator):
        token, adm = read_join_token(args.join_token), config.admission
        if adm.mode == "open":
            return join_admission(args, node, config, coordinator)
        policy = run_policy(config.run_id, adm.mode, adm.allowlist, adm.issuer, coordinator)
        refusal = decide_membership(node.peer_id, token, policy, time.time())
        logger.warning("byzantine uninvited: ignoring our admission (%s) and joining anyway", refusal.reason)
        return token, None

    return joining_anyway


def _announcing(data_plane_hosts, host: str):
    """``data_plane_hosts`` that listens where the peer's flags say and announces ``host``."""

    def hosts(args):
        listen, _ = data_plane_hosts(args)
        return listen, host

    return hosts


if __name__ == "__main__":
    sys.exit(main())
