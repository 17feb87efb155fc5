"""``hivetrain coordinator --config run.toml``: host the run's bootstrap peer and publish its signed config."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hivetrain.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    Interrupted,
    add_node_arguments,
    add_run_override_arguments,
    fail,
    install_signal_handlers,
    node_config,
    run_overrides,
    setup_logging,
)
from hivetrain.config import load_run_config
from hivetrain.coordinator.coordinator import Coordinator, CoordinatorOptions, run_fingerprint
from hivetrain.peers.node import BootstrapFailed, start_node
from hivetrain.peers.reaper import start_reaper

logger = logging.getLogger("hivetrain.coordinator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain coordinator", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run config TOML (default: built-in defaults)")
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        help="other peers of an existing run to bootstrap from (e.g. after a restart)",
    )
    parser.add_argument(
        "--address-file", default=None, help="write the multiaddrs volunteers should use here, one per line, once ready"
    )
    parser.add_argument(
        "--refresh-interval",
        type=float,
        default=10.0,
        help="seconds between re-publishing the config and reading the swarm",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_node_arguments(parser)
    add_run_override_arguments(parser)
    parser.set_defaults(identity_path="coordinator.key")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    install_signal_handlers()
    try:
        config = load_run_config(args.config, run_overrides(args))
        ncfg = node_config(args, args.initial_peers)
        options = CoordinatorOptions(refresh_interval_s=args.refresh_interval)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    node = None
    try:
        start_reaper()
        node = start_node(ncfg)
        coordinator = Coordinator(node, config, run_fingerprint(config), options)
        coordinator.publish()
        addresses = node.visible_maddrs()
        if args.address_file:
            tmp = Path(args.address_file).with_suffix(".tmp")
            tmp.write_text("\n".join(addresses) + "\n")
            tmp.replace(args.address_file)
        public = [a for a in addresses if "/127.0.0.1/" not in a] or addresses
        print(
            f"coordinator of run {config.run_id!r} (model {config.model}) is up. Volunteers join with:\n\n"
            f"    join-swarm {public[0]}\n",
            flush=True,
        )

        def on_tick(records):
            trainers = [r for r in records if r.role == "trainer"]
            if trainers:
                epochs = sorted({r.epoch for r in trainers})
                logger.info("%d trainer(s), epochs %s", len(trainers), epochs)

        coordinator.run(on_tick)
        return 0
    except BootstrapFailed as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Interrupted:
        logger.info("coordinator stopping")
        return EXIT_INTERRUPTED
    finally:
        if node is not None:
            node.shutdown()


if __name__ == "__main__":
    sys.exit(main())
