"""``hivetrain coordinator invite PEER_ID``: sign a join token that admits one peer to an invite-only run.

The token is signed with the coordinator's identity key (``--identity-path``, the coordinator's default
``coordinator.key``), so run it where that file is, with the run's ``--config`` (or ``--run-id``). It prints the token
alone on stdout (``> token.txt`` saves it) and how to use it on stderr. The run must set ``[admission] mode =
"token"`` for tokens to count; ``admission.issuer``, if set, must be this identity's peer ID.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from hivetrain.cli.args import REVOKED_SUFFIX
from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_OK, fail

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def duration_s(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w ("30d", "12h", "3600").

    Raises:
        ValueError: anything else, or a duration that is not positive.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--expires-in {text!r}: give a positive duration such as 30d, 12h, 90m or 3600 (seconds)")
    return float(match.group(1)) * _UNITS_S[match.group(2) or "s"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain coordinator invite", description=__doc__.splitlines()[0])
    parser.add_argument("peer_id", metavar="PEER_ID", help="the volunteer's peer ID (`hivetrain identity show`)")
    parser.add_argument("--config", default=None, help="the run config TOML (gives the run id)")
    parser.add_argument("--run-id", default=None, help="the run id (instead of --config)")
    parser.add_argument(
        "--expires-in", default="30d", help="how long the token admits the peer: 30d (default), 12h, 90m, 3600 (s)"
    )
    parser.add_argument(
        "--identity-path", default="coordinator.key", help="the coordinator's identity file (it must exist)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hivetrain.config import load_run_config
    from hivetrain.peers.identity import load_or_create_identity
    from hivetrain.peers.membership import make_token, peer_id_problem

    try:
        problem = peer_id_problem(args.peer_id)
        if problem:
            raise ValueError(f"{problem}; the volunteer prints theirs with `hivetrain identity show --identity-path P`")
        lifetime_s = duration_s(args.expires_in)
        if args.run_id and args.config:
            raise ValueError("give --config or --run-id, not both")
        config = load_run_config(args.config, {"run_id": args.run_id})
        if not args.config and not args.run_id:
            raise ValueError("give the run: --config run.toml (as the coordinator uses) or --run-id ID")
        if not Path(args.identity_path).expanduser().exists():
            raise ValueError(
                f"no identity file at {args.identity_path}: tokens must be signed by the coordinator's identity; pass "
                "the --identity-path the coordinator runs with"
            )
        identity = load_or_create_identity(args.identity_path)
        adm = config.admission
        if adm.issuer and adm.issuer != identity.peer_id:
            raise ValueError(
                f"run {config.run_id!r} accepts tokens signed by {adm.issuer} (admission.issuer), but "
                f"{args.identity_path} is {identity.peer_id}: use that issuer's identity file"
            )
        now = time.time()
        token = make_token(identity.private_key, config.run_id, args.peer_id, now, now + lifetime_s)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now + lifetime_s))
    print(token, flush=True)
    note = (
        f"\nJoin token for {args.peer_id} in run {config.run_id!r}, valid until {expires}. Send it to the volunteer, "
        "who joins with:\n\n"
        "    join-swarm COORDINATOR_ADDRESS --identity-path THEIR_IDENTITY_FILE --join-token TOKEN\n\n"
        "(or saves it to a file and passes --join-token @FILE). It admits only that peer ID."
    )
    if adm.mode != "token":
        note += (
            f"\nNote: run {config.run_id!r} has admission.mode = {adm.mode!r}: tokens count only with "
            '[admission] mode = "token" in the run config.'
        )
    print(note, file=sys.stderr, flush=True)
    return EXIT_OK


def build_revoke_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hivetrain coordinator revoke",
        description="Void a peer's join tokens (a leaked or lost token): the running coordinator publishes the list at "
        "its next refresh, and every honest peer refuses the peer from its next record read.",
    )
    parser.add_argument("peer_id", metavar="PEER_ID", help="the peer ID the token was issued to")
    parser.add_argument(
        "--identity-path", default="coordinator.key", help="the coordinator's identity file (locates the default list)"
    )
    parser.add_argument(
        "--revocations",
        default=None,
        help=f"the revocation list the coordinator publishes (default: the identity file + {REVOKED_SUFFIX!r})",
    )
    return parser


def revoke_main(argv: list[str] | None = None) -> int:
    """``hivetrain coordinator revoke PEER_ID``: add the peer to the coordinator's revocation list."""
    args = build_revoke_parser().parse_args(argv)
    from hivetrain.coordinator.revocations import RevocationsError, revoke

    path = Path(args.revocations or args.identity_path + REVOKED_SUFFIX)
    now = time.time()
    try:
        revoked = revoke(path, args.peer_id, now)
    except (RevocationsError, OSError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    print(
        f"revoked the join tokens of {args.peer_id} issued until now ({len(revoked)} peer(s) in {path}). The "
        "coordinator publishes the list at its next refresh (start it with --revocations "
        f"{path} if it does not use this default); a new token (`hivetrain coordinator invite`) admits the peer again.",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
