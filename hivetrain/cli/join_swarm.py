"""``join-swarm ADDRESS [ADDRESS ...]``: join a run and train with DiLoCo until the run ends or Ctrl+C.

A pipelined run (its config has a ``[swarm]`` table) is joined with the same command: the peer serves a stage or
trains through the pipeline (``--role``; ``hivetrain.cli.swarm_roles``).

Sharing the machine: ``--duty-cycle F`` trains at most F of wall time; SIGUSR1 (``kill -USR1 PID``) pauses and
resumes inner steps, as does ``--pause-file PATH`` (paused while the file exists); a paused peer stays in the swarm.

Invite-only runs (``[admission]`` in the run config): pass ``--join-token TOKEN`` (or ``@FILE``) from the run's
operator and keep ``--identity-path``; a peer that is not a member exits at once saying why and what to do.

Exit codes: 0 finished, 2 bad input or no reachable initial peer, 3 incompatible with the run or not admitted, 4 failed,
130 interrupted (SIGINT/SIGTERM: leaves within a few seconds, p2pd included).
On every exit the ``--summary-file`` is written with ``exit_code`` and ``exit_reason`` ("finished", "interrupted", or
what ended the peer), and a peer that trained publishes a last record with ``left_reason`` for the coordinator.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from hivetrain import __version__
from hivetrain.cli.args import join_swarm_parser as build_parser
from hivetrain.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INCOMPATIBLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Interrupted,
    data_plane_hosts,
    fail,
    install_pause_handler,
    install_signal_handlers,
    node_config,
    run_overrides,
    setup_logging,
)
from hivetrain.cli.progress import ProgressReporter
from hivetrain.cli.swarm_roles import check_role_arguments, run_swarm_role
from hivetrain.config import RunConfig, load_run_config
from hivetrain.diloco.drift import sketch_to_text
from hivetrain.diloco.duty import DutyCycle
from hivetrain.diloco.node_ranks import NodeRanks
from hivetrain.diloco.options import TrainerOptions
from hivetrain.faults import FaultInjector
from hivetrain.peers.membership import MemberRoster, NotAdmitted, admit_self, run_policy
from hivetrain.peers.node import BootstrapFailed, PeerNode, start_node, trusted_ids
from hivetrain.peers.reaper import start_reaper
from hivetrain.peers.records import IncompatibleRun, fetch_run_config, refuse_other_models, versions_compatible
from hivetrain.preflight import resolve_device

logger = logging.getLogger("hivetrain.join_swarm")


def resolve_config(args: argparse.Namespace, node: PeerNode) -> RunConfig:
    """The run config: the local --config (plus overrides) or the coordinator's signed one.

    Raises:
        ValueError: invalid config (the message names the field) or no config found in time.
    """
    if args.config:
        return load_run_config(args.config, run_overrides(args))
    if any(v is not None for v in run_overrides(args).values()):
        raise ValueError("run config overrides need --config; without it the coordinator's config is used as is")
    trusted = trusted_ids(tuple(args.addresses))
    deadline = time.monotonic() + args.config_timeout
    while True:
        record = fetch_run_config(node.dht, trusted)
        if record is not None:
            ok, reason = versions_compatible(__version__, record.version)
            if not ok:
                raise IncompatibleRun(f"the coordinator runs {reason}; install hivetrain {record.version}")
            return RunConfig.from_dict(record.run_config)
        if time.monotonic() > deadline:
            raise ValueError(
                f"no run config signed by {', '.join(sorted(trusted))} appeared within {args.config_timeout:.0f}s; "
                "is the first address the coordinator's? (or pass --config run.toml)"
            )
        time.sleep(1.0)


def run_authority(node: PeerNode, addresses: list[str]) -> tuple[str, float | None]:
    """The run's coordinator and start: the signer of a run config record signed by one of our bootstrap peers (its
    records then count as evidence of the state at its epoch) and the run start it publishes (the run-age bound),
    or ("", None) if none is published. A start more than a minute in our future is ignored (logged)."""
    try:
        record = fetch_run_config(node.dht, trusted_ids(tuple(addresses)))
    except Exception as exc:  # noqa: BLE001 - a bad address was reported at bootstrap; no coordinator then
        logger.warning("could not read the run config record: %r", exc)
        return "", None
    if record is None:
        return "", None
    started = record.run_started_at
    if started is not None and started > get_dht_time() + 60.0:
        logger.warning("the coordinator's run start is in our future (clock skew?): no run-age bound")
        started = None
    return record.coordinator_id, started


def main(
    argv: list[str] | None = None, *, node_ranks: NodeRanks | None = None, faults: FaultInjector | None = None
) -> int:
    """Run ``join-swarm`` with ``argv`` (default ``sys.argv[1:]``) and return its exit code (module docstring).

    Args:
        node_ranks: this process is rank 0 of a multi-rank node (``cli.node_launch`` passes it): the peer trains for
            all of the node's ranks. Without it, a process started by torchrun with WORLD_SIZE > 1 becomes one of the
            node's ranks first (``cli.node_launch.run_node``).
        faults: a fault injector with faults already armed (the chaos harness's ``testing.hostile_peer``); default
            none armed.
    """
    if node_ranks is None:  # torchrun --nproc-per-node N: N local ranks make one peer (hivetrain.diloco.node_ranks)
        from hivetrain.cli.node_launch import launched_by_torchrun, run_node

        if launched_by_torchrun():
            return run_node(argv)
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    install_signal_handlers()
    ending = _Ending(args.summary_file)
    try:
        faults = faults if faults is not None else FaultInjector()
        device = resolve_device(args.device or "auto")
        if args.threads:
            torch.set_num_threads(args.threads)
        if len(args.public_name) > 64:
            raise ValueError("--public-name must be at most 64 characters")
        if args.check and not args.addresses:
            raise ValueError("--check needs the run's coordinator address: join-swarm --check /ip4/.../p2p/...")
        if not args.addresses and not args.config:
            raise ValueError("give the coordinator's address (join-swarm /ip4/.../p2p/...) or --config to start alone")
        if args.json and not args.check:
            raise ValueError("--json goes with --check")
        ncfg = node_config(args, args.addresses)
        duty = DutyCycle(args.duty_cycle, pause_file=args.pause_file)
    except ValueError as exc:
        return ending.leave(fail(str(exc), EXIT_BAD_INPUT), str(exc))
    install_pause_handler(duty.toggle)
    node = None
    try:
        start_reaper()
        node = start_node(ncfg)
        if args.check:
            from hivetrain.cli.join_check import run_check

            return run_check(args, node, device)
        ending.node = node
        return _train(args, node, device, faults, duty, ending, node_ranks)
    except BootstrapFailed as exc:
        return ending.leave(fail(str(exc), EXIT_BAD_INPUT), str(exc))
    except (ValueError, FileNotFoundError) as exc:
        return ending.leave(fail(str(exc), EXIT_BAD_INPUT), str(exc))
    except (IncompatibleRun, NotAdmitted) as exc:
        return ending.leave(fail(str(exc), EXIT_INCOMPATIBLE), str(exc))
    except Interrupted:
        logger.info("interrupted, leaving the swarm")
        return ending.leave(EXIT_INTERRUPTED, "interrupted")
    except Exception as exc:  # noqa: BLE001 - an unexpected failure still leaves a summary saying why
        logger.exception("join-swarm failed")
        return ending.leave(EXIT_FAILED, f"{type(exc).__name__}: {exc}")
    finally:
        if node is not None:
            node.shutdown()


def _train(
    args: argparse.Namespace,
    node: PeerNode,
    device: torch.device,
    faults: FaultInjector,
    duty: DutyCycle,
    ending: _Ending,
    node_ranks: NodeRanks | None = None,
) -> int:
    """Join the run on ``node`` and take part until it ends: a DiLoCo peer, or the ``--role`` of a pipelined run.
    Returns the exit code once ``ending`` wrote the summary. Raises what joining raises (``NotAdmitted``,
    ``IncompatibleRun``, ``ValueError``, ``Interrupted``, ...): ``main`` turns it into an exit code."""
    from hivetrain.diloco import builder

    config, authority, token, roster = _enter_run(args, node)
    if config.pipelined:  # a SWARM pipeline: serve a stage or train through the stages
        return _pipeline_role(args, node, config, faults, ending)
    reporter = ProgressReporter(args.metrics_file, interactive=sys.stderr.isatty(), config=config)
    listen_host, announce_host = data_plane_hosts(args)
    options = TrainerOptions(
        public_name=args.public_name,
        dht_lost_after_s=args.dht_lost_timeout,
        duty_cycle=args.duty_cycle,
        pause_file=args.pause_file,
        coordinator_id=authority[0],
        run_started_at=authority[1],
        join_token=token,
    )
    try:
        peer = builder.build_peer(
            config,
            node,
            device=device,
            options=options,
            cursor_path=builder.data_cursor_path(args.identity_path, config.run_id),
            model_path=args.model_path,
            check_memory=not args.skip_memory_check,
            faults=faults,
            on_event=reporter.event,
            duty=duty,  # the SIGUSR1 handler toggles this same object
            membership=roster,
            node_ranks=node_ranks,
            listen_host=listen_host,
            announce_host=announce_host,
        )
    except BaseException:
        reporter.close()
        raise
    return _run_peer(peer, node, roster, reporter, ending)


def _enter_run(
    args: argparse.Namespace, node: PeerNode
) -> tuple[RunConfig, tuple[str, float | None], str, MemberRoster | None]:
    """The run we join, once we may: (its config, its authority (coordinator ID, run start), our join token, an
    invite-only run's roster or None). From then on our DHT node refuses out-of-bounds records of the run (and, if
    invite-only, non-members' records).

    Raises:
        ValueError: an invalid or missing config, a flag the run's roles do not take, an unreadable join token.
        NotAdmitted: we are not a member of an invite-only run (before any work).
    """
    config = resolve_config(args, node)
    check_role_arguments(args, config)
    authority = run_authority(node, args.addresses)
    token, roster = join_admission(args, node, config, authority[0])  # raises NotAdmitted before any work
    if roster is None:
        node.guard_run(config.run_id)
    else:
        node.guard_run(config.run_id, admission=roster.policy)
    return config, authority, token, roster


def _pipeline_role(
    args: argparse.Namespace, node: PeerNode, config: RunConfig, faults: FaultInjector, ending: _Ending
) -> int:
    """Serve a stage of a pipelined run, or train through its stages (``--role``); returns the exit code.

    Raises:
        IncompatibleRun: the swarm trains another model.
    """
    from hivetrain.swarm.process import describe_model

    model_config, fingerprint = describe_model(config)  # meta device: no memory
    refuse_other_models(node.dht, config.run_id, node.peer_id, fingerprint, config.model)
    code = run_swarm_role(args, node, config, model_config, fingerprint, faults, ending, data_plane_hosts(args))
    return ending.leave(code, "finished" if code == EXIT_OK else "the pipeline trainer did not complete its steps")


def _run_peer(peer, node: PeerNode, roster: MemberRoster | None, reporter: ProgressReporter, ending: _Ending) -> int:
    """Train the built DiLoCo ``peer`` (``builder.DilocoPeer``) to the run's end; returns the exit code. Whatever ends
    it, the summary is written first, then our last record says why we left, then the peer and ``reporter`` close.

    Raises:
        Interrupted: Ctrl+C or SIGTERM (after the summary says "interrupted").
    """
    from hivetrain.diloco.swarm_view import DhtLost

    trainer = peer.trainer
    ending.trainer = trainer
    code, reason = EXIT_FAILED, "training did not start"
    try:
        peer.run()
        reporter.close()
        code, reason = EXIT_OK, "finished"
    except Interrupted:
        code, reason = EXIT_INTERRUPTED, "interrupted"
        raise
    except DhtLost as exc:
        logger.error("%s; leaving", exc)
        code, reason = EXIT_FAILED, str(exc)
        ours = roster.check(node.peer_id) if roster is not None else None
        if ours is not None and not ours.ok:  # our token expired: peers drop our record
            reason = f"{reason}; {ours.reason}: ask the run's operator for a new join token"
    except Exception as exc:  # noqa: BLE001 - any failure of training ends this peer, saying why
        logger.exception("training failed")
        code, reason = EXIT_FAILED, f"training failed: {type(exc).__name__}: {exc}"
    finally:  # the summary first: announcing may wait on a DHT that no longer answers
        ending.leave(code, reason)
        _announce_leaving(trainer, reason)
        peer.close()
        reporter.close()
    return ending.leave(code, reason)


def read_join_token(text: str) -> str:
    """The token given to --join-token: the text itself, or the contents of FILE for ``@FILE``.

    Raises:
        ValueError: ``@FILE`` does not exist or cannot be read.
    """
    if not text.startswith("@"):
        return text.strip()
    try:
        return Path(text[1:]).expanduser().read_text().strip()
    except OSError as exc:
        raise ValueError(f"--join-token {text}: cannot read {text[1:]} ({exc.strerror})") from None


def join_admission(args, node: PeerNode, config: RunConfig, coordinator: str) -> tuple[str, MemberRoster | None]:
    """Our join token and, for an invite-only run, the roster of members (None for an open run).

    Raises:
        NotAdmitted: this peer is not a member (the message says why and what to do).
        ValueError: an unreadable --join-token @FILE, or a token run without a known issuer.
    """
    token = read_join_token(args.join_token)
    adm = config.admission
    if adm.mode == "open":
        return token, None
    policy = run_policy(config.run_id, adm.mode, adm.allowlist, adm.issuer, coordinator)
    hint = f"--identity-path {args.identity_path}" if args.identity_path else ""
    admission = admit_self(policy, node.peer_id, token, time.time(), identity_hint=hint)
    if admission.expires_at is not None:
        logger.info("run %r is invite-only; our join token admits us %s", config.run_id, admission.reason)
    return token, MemberRoster(policy)


def _announce_leaving(trainer, reason: str, timeout_s: float = 3.0) -> None:
    """Stop the trainer and publish its last record with ``left_reason`` (the coordinator shows it), waiting at
    most ``timeout_s`` seconds: after a lost DHT the store may never answer, and leaving must not hang on it."""
    if trainer is None:
        return
    trainer.stop()
    thread = threading.Thread(target=trainer.announce_leaving, args=(reason,), name="announce-leaving", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("could not announce that we leave within %.0f s; leaving anyway", timeout_s)


class _Ending:
    """How this peer ends, for its ``--summary-file``: the first ``leave(code, reason)`` writes the summary (every
    exit path calls it: finished, interrupted, lost DHT, bad input, unexpected exceptions) and returns ``code``.

    Attributes:
        node, trainer: set once they exist; the summary holds what they know (peer id, epoch, counters).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.started_at = time.time()
        self.node: PeerNode | None = None
        self.trainer = None
        self.role_stats = None  # a pipelined run's role: () -> its figures, written instead of the DiLoCo counters
        self.done = False

    def leave(self, code: int, reason: str) -> int:
        if not self.done:
            self.done = True
            try:
                if self.role_stats is not None:
                    _write_role_summary(self.path, self.node, self.role_stats(), code, reason, self.started_at)
                else:
                    _write_summary(self.path, self.node, self.trainer, code, reason, self.started_at)
            except Exception:  # noqa: BLE001 - a summary that cannot be written must not change the exit code
                logger.exception("could not write the summary file %s", self.path)
        return code


def _write_role_summary(
    path: str | None, node: PeerNode | None, stats: dict, exit_code: int, exit_reason: str, started_at: float
) -> None:
    """The summary JSON of a pipelined run's stage server or trainer: ``role``, the exit fields of ``_write_summary``
    and the role's figures (``hivetrain.swarm.process.server_stats`` or ``run_training``'s stats)."""
    if not path:
        return
    summary = {
        "peer_id": node.peer_id if node is not None else "",
        "interrupted": exit_code == EXIT_INTERRUPTED,
        "exit_code": exit_code,
        "exit_reason": exit_reason,
        "started_at": started_at,
        "written_at": time.time(),
        **stats,
    }
    Path(path).write_text(json.dumps(summary, indent=2, default=str))


def _write_summary(
    path: str | None, node: PeerNode | None, trainer, exit_code: int, exit_reason: str, started_at: float
) -> None:
    """Write the peer's summary JSON (README, "local-swarm output"); counters are 0 if training never started.

    ``exit_reason`` is "finished", "interrupted", or what ended the peer (a lost DHT, an exception, bad input).
    """
    if not path:
        return
    stats = trainer.stats if trainer is not None else None

    def stat(name: str, default=0):
        return getattr(stats, name, default) if stats is not None else default

    summary = {
        "peer_id": node.peer_id if node is not None else "",
        "epoch": trainer.state.epoch if trainer is not None else 0,
        "interrupted": exit_code == EXIT_INTERRUPTED,
        "exit_code": exit_code,
        "exit_reason": exit_reason,
        "started_at": started_at,
        "written_at": time.time(),
        "state_hashes": {str(k): v for k, v in sorted(stat("state_hashes", {}).items())},
        "param_sketches": {str(k): sketch_to_text(v) for k, v in sorted(stat("param_sketches", {}).items())},
        "bytes_sent": stat("bytes_sent"),
        "bytes_received": stat("bytes_received"),
        "state_bytes_downloaded": stat("state_bytes_downloaded"),
        "state_downloads": stat("state_downloads"),
        "rounds_committed": stat("rounds_committed"),
        "rounds_failed": stat("rounds_failed"),
        "samples_total": stat("samples_total"),
        "samples_computed": stat("samples_computed"),
        "samples_discarded": stat("samples_discarded"),
        "compute_s": stat("compute_s", 0.0),
        # seconds per committed outer step outside the inner steps and the all-reduce, by part (issue 24)
        "outer_overhead_s": {
            part: seconds / max(stat("rounds_committed"), 1) for part, seconds in stat("outer_overhead_s", {}).items()
        },
        "compile_s": stat("compile_s", 0.0),
        # CUDA: the preflight's estimate of device memory and the peak measured in the first inner phase, bytes
        **_memory_figures(trainer),
        "final_eval_loss": stat("last_eval_loss", None),
        "num_parameters": sum(p.numel() for p in trainer.model.parameters()) if trainer is not None else 0,
    }
    Path(path).write_text(json.dumps(summary, indent=2))


def _memory_figures(trainer) -> dict[str, int]:
    """``peak_rss_bytes`` (this process's peak resident memory: on a CPU peer the training's too), and on a CUDA
    peer ``preflight_device_bytes`` and ``peak_device_bytes`` (``InnerOptimizer.memory``)."""
    import resource

    figures = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    memory = getattr(getattr(getattr(trainer, "phases", None), "inner", None), "memory", None)
    if memory is not None:
        figures |= {"preflight_device_bytes": memory.estimated_bytes, "peak_device_bytes": memory.peak_bytes}
    return figures


if __name__ == "__main__":
    sys.exit(main())
