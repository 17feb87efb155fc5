"""``hivetrain SUBCOMMAND``: one thin module per subcommand, imported only when used."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "coordinator": ("hivetrain.cli.coordinator:main", "host the run's bootstrap peer and publish its signed config"),
    "local-swarm": ("hivetrain.cli.local_swarm:main", "run a coordinator and N peers on this machine"),
    "join-swarm": ("hivetrain.cli.join_swarm:main", "join a run and train (same as the join-swarm command)"),
    "chaos": ("hivetrain.cli.chaos:main", "run fault-injection scenarios against a local swarm (chaos run/suite/list)"),
    "sim": ("hivetrain.cli.sim:main", "simulate a swarm of N volunteers on this machine (discrete events)"),
    "status": ("hivetrain.cli.status:main", "a run's live view without joining it: epoch, trainers, speeds, failures"),
    "identity": ("hivetrain.cli.identity:main", "print this peer's ID (to be invited to an invite-only run)"),
    "export": ("hivetrain.cli.export:main", "write a checkpoint as a transformers model directory"),
    "generate": ("hivetrain.cli.generate:main", "continue a prompt with an exported model directory"),
}

PARSERS = {
    "join-swarm": "join_swarm_parser",
    "coordinator": "coordinator_parser",
    "local-swarm": "local_swarm_parser",
    "export": "export_parser",
}
"""Subcommands whose module imports torch and hivemind: their arguments are parsed first with the light parser of
``hivetrain.cli.args``, so that ``--help`` and a wrong flag answer in well under a second, before those imports."""


def usage() -> str:
    lines = ["usage: hivetrain SUBCOMMAND [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `hivetrain SUBCOMMAND --help` for its options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from hivetrain import __version__

        print(f"hivetrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "coordinator" and rest and rest[0] in ("invite", "revoke"):  # light: no node is started
        from hivetrain.cli import invite

        return (invite.main if rest[0] == "invite" else invite.revoke_main)(rest[1:])
    if name in PARSERS:
        from hivetrain.cli import args

        getattr(args, PARSERS[name])().parse_args(rest)  # exits 0 on --help, 2 on a wrong flag
    module_name, function = SUBCOMMANDS[name][0].split(":")
    if name in PARSERS and sys.stderr.isatty():  # a person waits: say what the first seconds go to
        from rich.console import Console

        with Console(stderr=True).status(f"hivetrain {name}: loading torch and hivemind"):
            module = importlib.import_module(module_name)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, function)(rest)


def join_swarm(argv: list[str] | None = None) -> int:
    """The ``join-swarm`` command: ``hivetrain join-swarm`` with its arguments checked before the heavy imports."""
    return main(["join-swarm", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
