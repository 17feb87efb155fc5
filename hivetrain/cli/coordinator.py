"""``hivetrain coordinator --config run.toml``: host the run's bootstrap peer, state copy, checkpoints and dashboard.

``hivetrain coordinator invite PEER_ID --config run.toml``: sign a join token for an invite-only run, and
``hivetrain coordinator revoke PEER_ID``: void that peer's tokens (``hivetrain.cli.invite``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from hivetrain.cli.args import REVOKED_SUFFIX
from hivetrain.cli.args import coordinator_parser as build_parser
from hivetrain.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    Interrupted,
    fail,
    install_signal_handlers,
    node_config,
    run_overrides,
    setup_logging,
)
from hivetrain.config import load_run_config
from hivetrain.coordinator.coordinator import Coordinator, CoordinatorOptions
from hivetrain.model import public_model_name
from hivetrain.peers.node import BootstrapFailed, start_node
from hivetrain.peers.reaper import start_reaper

logger = logging.getLogger("hivetrain.coordinator")
FOLLOWER_DIR = ".follower"  # under --checkpoint-dir: the follower's state files


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "invite":
        from hivetrain.cli.invite import main as invite

        return invite(argv[1:])
    if argv and argv[0] == "revoke":
        from hivetrain.cli.invite import revoke_main

        return revoke_main(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    install_signal_handlers()
    try:
        config = load_run_config(args.config, run_overrides(args))
        ncfg = dataclasses.replace(node_config(args, args.initial_peers), run_ids=(config.run_id,))
        options = CoordinatorOptions(
            refresh_interval_s=args.refresh_interval,
            run_clock_path=_run_clock_path(args),
            revocations_path=_revocations_path(args, config),
        )
        if args.http_port is not None and not 0 <= args.http_port <= 65535:
            raise ValueError(f"--http-port {args.http_port}: must be 0..65535")
        if args.checkpoint_dir and args.no_state:
            raise ValueError("--checkpoint-dir needs the state copy: drop --no-state")
        if config.pipelined and args.checkpoint_dir:
            raise ValueError(
                "--checkpoint-dir: a pipelined run ([swarm]) has no whole-model state for the coordinator to copy "
                "(each stage's servers hold theirs): drop --checkpoint-dir"
            )
        if args.checkpoint_dir and not config.averaging.exact_average:
            raise ValueError(
                f"--checkpoint-dir: with averaging.strategy = {config.averaging.strategy!r} peers hold different "
                "states by design (approximate averaging, momentum kept local), so there is no one state for the "
                'coordinator to copy: drop --checkpoint-dir, or use strategy = "butterfly"'
            )
        if args.checkpoint_dir:  # now, not at the first checkpoint: the run clock is saved there from the start
            _make_checkpoint_dir(Path(args.checkpoint_dir))
        # the model against the tokenizer (vocabulary, positions) and a pretrained start's weights, before any node
        run_model = _meta_run_model(config)  # shapes only: no memory, whatever the model's size
        fingerprint = run_model.fingerprint
        follows = not args.no_state and not config.pipelined and config.averaging.exact_average
        if follows:  # the disk must hold the state the follower keeps, before anything starts
            _check_disk(args, 8 * sum(p.numel() for p in run_model.model.parameters()))
        _warn_missing_data(config)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    node = loop = dashboard = metrics = follower = None
    try:
        if args.metrics_file:
            try:
                metrics = open(args.metrics_file, "a", buffering=1)  # noqa: SIM115 - closed in finally
            except OSError as exc:
                return fail(f"--metrics-file {args.metrics_file}: {exc.strerror or exc}", EXIT_BAD_INPUT)
        start_reaper()
        node = _start_with_known_peers(ncfg, args)
        policy = _guard_admission(node, config)
        observer = None
        from hivetrain.coordinator.dashboard import RunInfo, summarize_config
        from hivetrain.coordinator.observer import SwarmObserver
        from hivetrain.peers.loop import LoopThread

        loop = LoopThread()
        # a pipeline's state lives in its stages' servers; moshpit/gossip peers hold no common state to follow
        if follows:
            on_event = (lambda event: metrics.write(json.dumps(event) + "\n")) if metrics is not None else None
            follower = _make_follower(args, config, node, loop, run_model, on_event)
        num_parameters = sum(t.numel() for t in follower.reference.params.values()) if follower else 0
        observer = SwarmObserver(
            RunInfo(
                config.run_id,
                public_model_name(config.model),
                num_parameters,
                summarize_config({**config.to_dict(), "model": public_model_name(config.model)}),
                time.time(),
            ),
            config.data.seq_len,
            max_samples_per_round=config.averaging.max_samples_per_round,
        )
        _serve_link_checks(node, loop, config.run_id, observer.credit_table)
        if config.pipelined:  # the dashboard's pipeline card and metrics
            from hivetrain.coordinator.pipeline import PipelineObserver

            observer.pipeline = PipelineObserver(config.swarm.num_stages, config.swarm.microbatch_size, fingerprint)
        coordinator = Coordinator(node, config, fingerprint, options, follower=follower, observer=observer)
        if policy is not None and follower is not None:  # serve the verified state to members only
            from hivetrain.peers.membership import MemberRoster

            roster = MemberRoster(policy)
            roster.follow(lambda: coordinator.records)
            follower.server.admits = roster.admits
        coordinator.publish()
        if args.http_port is not None:
            from hivetrain.coordinator.dashboard import DashboardServer

            dashboard = DashboardServer(
                lambda: observer.snapshot(time.time()), host=args.http_host, port=args.http_port
            )
            dashboard.start()
            dashboard.wait_ready(timeout_s=30)
            print(f"dashboard: {dashboard.url}", flush=True)
        addresses = node.visible_maddrs()
        if args.address_file:
            tmp = Path(args.address_file).with_suffix(".tmp")
            tmp.write_text("\n".join(addresses) + "\n")
            tmp.replace(args.address_file)
        public = [a for a in addresses if "/127.0.0.1/" not in a] or addresses
        print(
            f"coordinator of run {config.run_id!r} (model {config.model}) is up. Volunteers join with:\n\n"
            f"    join-swarm {public[0]}{_admission_hint(config)}\n",
            flush=True,
        )

        def on_tick(records):
            trainers = [r for r in records if r.role == "trainer"]
            if trainers:
                logger.info("%d trainer(s), epochs %s", len(trainers), sorted({r.epoch for r in trainers}))
                _save_known_peers(args, [a for r in trainers for a in r.maddrs[:2]])

        coordinator.run(on_tick)
        return 0
    except BootstrapFailed as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Interrupted:
        logger.info("coordinator stopping")
        return EXIT_INTERRUPTED
    finally:
        if dashboard is not None:
            dashboard.shutdown(timeout_s=5)
        if loop is not None:
            loop.stop(timeout_s=2)
        if node is not None:
            node.shutdown()
        if metrics is not None:
            metrics.close()
        _remove_follower_dir(args, follower)


def _serve_link_checks(node, loop, run_id: str, credit_table) -> None:
    """Answer volunteers' ``join-swarm --check`` link probes and ``hivetrain status``'s credit requests
    (``peers.link_probe``); a failure only costs those."""
    from hivetrain.peers.link_probe import LinkProbeServer

    try:
        p2p = loop.run(node.dht.replicate_p2p(), timeout_s=30)
        loop.run(LinkProbeServer(credit_table).register(p2p, run_id), timeout_s=30)
    except Exception as exc:  # noqa: BLE001 - the run goes on without them
        logger.warning("join-swarm --check link probes are not served: %r", exc)


def _revocations_path(args, config) -> Path | None:
    """The token issuer's revocation list of an invite-only run: ``--revocations``, else next to the identity file
    (where ``hivetrain coordinator revoke`` writes by default); None for other runs."""
    if config.admission.mode != "token":
        if args.revocations:
            raise ValueError("--revocations: the run admits no tokens ([admission] mode is not 'token')")
        return None
    return Path(args.revocations or args.identity_path + REVOKED_SUFFIX)


def _make_checkpoint_dir(path: Path) -> None:
    """Create the checkpoint directory. Raises ValueError naming the cause when it cannot be created."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--checkpoint-dir {path}: cannot create it ({exc.strerror or exc}): choose a directory this user can write"
        ) from None


def _run_clock_path(args) -> Path | None:
    """Where the run's start is saved: the checkpoint directory, else next to the identity file, else nowhere."""
    from hivetrain.coordinator.run_clock import RUN_CLOCK_FILE

    if args.checkpoint_dir:  # created before the node starts (``_make_checkpoint_dir``)
        return Path(args.checkpoint_dir) / RUN_CLOCK_FILE
    return Path(args.identity_path + ".run.json") if args.identity_path else None


def _guard_admission(node, config):
    """In an invite-only run, have our DHT node refuse non-members' peer records (we are the token issuer unless
    ``admission.issuer`` names another peer). Returns the run's admission policy, or None for an open run."""
    from hivetrain.peers.membership import run_policy

    adm = config.admission
    if adm.mode == "open":
        return None
    if adm.issuer and adm.issuer != node.peer_id:
        logger.warning(
            "admission.issuer is %s, not this coordinator (%s): tokens from `hivetrain coordinator invite` with this "
            "identity will not count",
            adm.issuer,
            node.peer_id,
        )
    policy = run_policy(config.run_id, adm.mode, adm.allowlist, adm.issuer, node.peer_id)
    node.guard_run(config.run_id, admission=policy)
    logger.info("run %r admits only %s", config.run_id, "invited peers" if adm.mode == "token" else "its allowlist")
    return policy


def _admission_hint(config) -> str:
    if config.admission.mode == "token":
        return (
            " --identity-path ID_FILE --join-token TOKEN\n\n(invite-only: a volunteer prints its peer ID with "
            "`hivetrain identity show --identity-path ID_FILE`; you sign its token with `hivetrain coordinator invite "
            "PEER_ID --config ...`)"
        )
    if config.admission.mode == "allowlist":
        return " --identity-path ID_FILE\n\n(allowlist only: list each volunteer's peer ID in [admission] allowlist)"
    return ""


def _known_peers_path(args) -> Path | None:
    return Path(args.identity_path + ".peers") if args.identity_path else None


def _save_known_peers(args, maddrs: list[str]) -> None:
    """Remember where peers are, so that a restarted coordinator can rejoin the running swarm."""
    path = _known_peers_path(args)
    if path is None or not maddrs:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(dict.fromkeys(maddrs[:32])) + "\n")
    tmp.replace(path)


def _warn_missing_data(config) -> None:
    """Warn about data paths missing on this machine: the coordinator reads no data, and volunteers may hold the
    corpus at those paths on their own disks, so this is not a refusal (join-swarm refuses a missing path)."""
    import glob

    missing = [p for p in config.data.paths if not glob.has_magic(p) and not Path(p).expanduser().exists()]
    missing += [p for p in config.data.paths if glob.has_magic(p) and not glob.glob(str(Path(p).expanduser()))]
    if missing:
        logger.warning(
            "data.paths %s: not on this machine. Every volunteer needs them at these paths (or its own "
            "--config); a volunteer without them is refused at join-swarm",
            ", ".join(missing),
        )


def _start_with_known_peers(ncfg, args):
    """Start the DHT node; after a restart, bootstrap from the peers seen before so that the swarm finds us again
    (peers do not re-dial a node that restarted). If none of them answers, start as a new swarm's first node."""
    path = _known_peers_path(args)
    known = [line for line in path.read_text().split() if "/p2p/" in line] if path and path.exists() else []
    if known and not args.initial_peers:
        try:
            return start_node(dataclasses.replace(ncfg, initial_peers=tuple(known), startup_timeout_s=15.0))
        except (BootstrapFailed, ValueError) as exc:
            logger.warning("none of the %d peers seen before answered (%s); starting alone", len(known), exc)
    return start_node(ncfg)


INITIAL_STATE_MAX_BYTES = 2**30
"""The coordinator builds θ₀ itself (and measures the run's first step from it) only when building it takes at most
this much memory (12 bytes per parameter: the fp32 model, θ and zero momentum: ~89M parameters) and half of what
the machine has free; a bigger run's coordinator takes its first state from the trainers' quorum."""


def _meta_run_model(config):
    """The run's model on the meta device (``hivetrain.model.RunModel``): fingerprint, names and shapes; a
    pretrained start's weights are read once to hash them."""
    from hivetrain.data import vocab_size_of
    from hivetrain.model import build_run_model

    return build_run_model(config, vocab_size_of(config.data), meta=True)


def _make_follower(args, config, node, loop, run_model, on_event=None):
    """The state follower: states on disk (``state_file``) under ``--checkpoint-dir``/.follower or a temporary
    directory, so the coordinator never needs the model's memory (issue 24). ``run_model``: ``_meta_run_model``."""
    from hivetrain.coordinator.checkpoint import CheckpointStore
    from hivetrain.coordinator.follower import FollowerOptions, StateFollower
    from hivetrain.data import vocab_size_of
    from hivetrain.diloco.state import TrainingState
    from hivetrain.diloco.state_file import meta_reference
    from hivetrain.model import build_run_model
    from hivetrain.preflight import _available_host_bytes

    fingerprint = run_model.fingerprint
    reference = meta_reference(run_model.model)
    num_params = sum(t.numel() for t in reference.params.values())
    work_dir = _follower_dir(args)
    initial, build_bytes = None, 12 * num_params
    if build_bytes <= min(INITIAL_STATE_MAX_BYTES, _available_host_bytes() // 2):
        model = build_run_model(config, vocab_size_of(config.data)).model
        initial = TrainingState.from_model(model)
        del model
    else:
        logger.info(
            "θ₀ of this model (%.2fB parameters) is not built here (%.1f GB of memory): the coordinator takes its "
            "first state from the trainers' quorum and holds states on disk in %s",
            num_params / 1e9, build_bytes / 1e9, work_dir,
        )  # fmt: skip
    store = CheckpointStore(Path(args.checkpoint_dir), keep_last=args.keep_checkpoints) if args.checkpoint_dir else None
    follower = StateFollower(
        node,
        loop,
        config.run_id,
        initial,
        store,
        config.to_dict(),
        fingerprint,
        FollowerOptions(
            checkpoint_every=args.checkpoint_every,
            keep_checkpoints=args.keep_checkpoints,
            max_step_ratio=config.averaging.max_update_ratio,
            step_window=config.averaging.update_norm_window,
            step_min_history=config.averaging.update_norm_min_history,
        ),
        on_event=on_event,
        reference=reference,
        work_dir=work_dir,
    )
    del initial
    restored = follower.restore()
    if restored is not None:
        print(f"restored checkpoint of epoch {restored}", flush=True)
    follower.register()
    return follower


def _follower_dir(args) -> Path:
    """Where the follower keeps its state files: ``--checkpoint-dir``/.follower (checkpoints are hard links to them),
    else a new temporary directory ``hivetrain-follower-<pid>-*`` (removed by ``_remove_follower_dir``; one left by a
    coordinator that was killed is removed here once no process has its pid: it may hold gigabytes)."""
    import shutil
    import tempfile

    if args.checkpoint_dir:
        path = Path(args.checkpoint_dir) / FOLLOWER_DIR
        path.mkdir(exist_ok=True)
        return path
    for stale in Path(tempfile.gettempdir()).glob("hivetrain-follower-*-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"hivetrain-follower-{os.getpid()}-"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_disk(args, state_bytes: int) -> None:
    """Whether the follower's disk (``--checkpoint-dir``, created by now, else the temporary directory) holds what the
    follower keeps: the 2 epochs its state server serves and the next state downloading, 3 x ``state_bytes`` (θ and
    outer momentum, 8 bytes per parameter); each kept checkpoint adds one more (warned, not refused: a run may end
    before it keeps them all, and pruning frees the oldest).

    Raises:
        ValueError: less than 3 states fit; names the need, the free space and the fixes.
    """
    import shutil
    import tempfile

    if args.checkpoint_dir:
        path = Path(args.checkpoint_dir)
        where, fix = f"--checkpoint-dir {args.checkpoint_dir}", "free space there or choose another --checkpoint-dir"
    else:
        path = Path(tempfile.gettempdir())
        where, fix = f"the temporary directory {path}", "point TMPDIR at a larger disk"
    free, need = shutil.disk_usage(path).free, 3 * state_bytes
    if free < need:
        raise ValueError(
            f"{where}: {free / 1e9:.1f} GB free, the coordinator's copy of this run's state needs {need / 1e9:.1f} GB "
            f"(θ and outer momentum, {state_bytes / 1e9:.1f} GB a state: two served, one downloading; each checkpoint "
            f"kept adds one): {fix}, or run with --no-state (no state copy, no checkpoints)"
        )
    with_checkpoints = need + (args.keep_checkpoints * state_bytes if args.checkpoint_dir else 0)
    if free < with_checkpoints:
        logger.warning(
            "%s: %.1f GB free; %d checkpoints kept of %.1f GB each will need %.1f GB in all: lower "
            "--keep-checkpoints or free space before they fill the disk",
            where, free / 1e9, args.keep_checkpoints, state_bytes / 1e9, with_checkpoints / 1e9,
        )  # fmt: skip


def _remove_follower_dir(args, follower) -> None:
    """Remove the follower's temporary directory (kept under ``--checkpoint-dir``: its files are the checkpoints')."""
    import shutil

    if follower is not None and follower.work_dir is not None and not args.checkpoint_dir:
        shutil.rmtree(follower.work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
