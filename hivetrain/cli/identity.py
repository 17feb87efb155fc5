"""``hivetrain identity show [--identity-path PATH]``: print this peer's ID (creating the identity file if missing).

A volunteer of an invite-only run sends this peer ID to the run's operator (who answers with a join token, or adds it
to the run's allowlist) and then joins with the same ``--identity-path``.
"""

from __future__ import annotations

import argparse
import sys

from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_OK, fail

DEFAULT_PATH = "~/.hivetrain/identity.key"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain identity", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["show"], help="show: print the peer ID of the identity file")
    parser.add_argument(
        "--identity-path", default=DEFAULT_PATH, help=f"identity file (created if missing; default {DEFAULT_PATH})"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hivetrain.peers.identity import load_or_create_identity

    try:
        identity = load_or_create_identity(args.identity_path)
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    print(identity.peer_id, flush=True)
    print(
        f"\nThis is the peer ID of {identity.path}. For an invite-only run, send it to the run's operator, then join "
        f"with --identity-path {args.identity_path} (and the --join-token you receive).",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
