"""``hivetrain status ADDRESS...``: a run's live view without joining it (is the network up, who trains, how fast).

It starts a client-mode DHT node (no incoming connections, nothing published), reads the run config the first
addresses' peers signed (the coordinator's, as ``join-swarm`` does) and every peer record of the run (the level-0 key
and every shard, as the coordinator's dashboard reads them), and prints the figures the dashboard shows from one poll
of those records (``coordinator.observer.SwarmObserver``): run id, model, epoch, live trainers and their speeds,
their recent failed rounds, whether admission is open. ``--json`` prints the dashboard's ``/api/status`` body from
that poll, plus ``admission`` and ``coordinator`` fields.

What one poll cannot show: the loss curve and round history the coordinator folds over time, and its checkpoints (the
dashboard has them; the coordinator's record shows the epoch it holds, which it checkpoints when it has a
``--checkpoint-dir``). The credit each volunteer earned over the run (samples the members of its groups witnessed,
``diloco/credit.py``) is folded the same way: it is asked of the coordinator over libp2p (``peers.link_probe``) and
printed as ``credit`` (``credit_error`` says why not, if it could not be had).

Exit codes: 0; 2 with one ``error:`` line (an address that is not a multiaddr, no peer reachable, no run config
signed by one of the addresses' peers within ``--timeout`` seconds, a run config this version cannot read); 4 with one
``error:`` line if the DHT fails mid-read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, fail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain status", description=__doc__.splitlines()[0])
    parser.add_argument(
        "addresses", nargs="+", help="the run's coordinator address (/ip4/.../tcp/.../p2p/Qm...), as join-swarm takes"
    )
    parser.add_argument("--json", action="store_true", help="print the dashboard's /api/status body instead of text")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to reach a peer and find the run config (default 30)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        return fail(f"--timeout must be positive, got {args.timeout:g}", EXIT_BAD_INPUT)
    from hivetrain.peers.node import BootstrapFailed, NodeConfig, start_node

    try:
        config = NodeConfig(initial_peers=tuple(args.addresses), client_mode=True, startup_timeout_s=args.timeout)
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    try:
        node = start_node(config)
    except BootstrapFailed as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    try:
        body = read_status(node, args.addresses, args.timeout)
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Exception as exc:  # noqa: BLE001 - a DHT failure mid-read: one line, not a traceback
        return fail(f"could not read the run's records: {exc!r} (try again, or another address)", EXIT_FAILED)
    finally:
        node.shutdown()
    print(json.dumps(body, indent=2) if args.json else render(body), flush=True)
    return EXIT_OK


def find_run(node, addresses: list[str], timeout_s: float):
    """The run config signed by one of the ``addresses``' peers (the coordinator's), waiting up to ``timeout_s``.

    Returns:
        (record, config, (compatible, reason)): the signed ``RunConfigRecord``, its ``RunConfig``, and whether this
        hivetrain can join a run of the coordinator's version (``records.versions_compatible``).

    Raises:
        ValueError: no run config signed by one of the addresses' peers appeared within ``timeout_s`` seconds, or it
            is not one this hivetrain can read (another major.minor version).
    """
    from hivetrain import __version__
    from hivetrain.config import RunConfig
    from hivetrain.peers.node import trusted_ids
    from hivetrain.peers.records import fetch_run_config, versions_compatible

    trusted = trusted_ids(tuple(addresses))
    deadline = time.monotonic() + timeout_s
    record = fetch_run_config(node.dht, trusted)
    while record is None and time.monotonic() < deadline:
        time.sleep(1.0)
        record = fetch_run_config(node.dht, trusted)
    if record is None:
        raise ValueError(
            f"no run config signed by {', '.join(sorted(trusted))} appeared within {timeout_s:g}s: is it the run's "
            "coordinator's address? (its log prints it after 'Volunteers join with:')"
        )
    compatible = versions_compatible(__version__, record.version)
    try:
        config = RunConfig.from_dict(record.run_config)
    except ValueError as exc:
        raise ValueError(f"the coordinator's run config does not load here ({compatible[1]}): {exc}") from None
    return record, config, compatible


def read_status(node, addresses: list[str], timeout_s: float, found=None, credit: bool = True) -> dict:
    """The run's status from one poll of its records, as a JSON-able dict (the dashboard's ``/api/status`` body).

    Args:
        found: ``find_run``'s answer, if the caller has it already.
        credit: also ask the coordinator for its credit table (``credit``, ``credit_error``); ``join-swarm --check``
            does not need it.

    Raises:
        ValueError: as ``find_run``.
    """
    from hivetrain.coordinator.dashboard import DashboardConfig
    from hivetrain.coordinator.observer import SwarmObserver
    from hivetrain.coordinator.web.snapshot import RunInfo, summarize_config, to_jsonable
    from hivetrain.model import public_model_name
    from hivetrain.peers.record_shards import fetch_swarm
    from hivetrain.peers.records import fetch_records

    record, config, (ok, _) = found or find_run(node, addresses, timeout_s)
    level0 = fetch_records(node.dht, config.run_id)
    bits = {r.record_shard_bits for r in level0 if r.peer_id == record.coordinator_id} or {0}
    records = fetch_swarm(node.dht, config.run_id, bits)
    now = time.time()
    model = public_model_name(config.model)
    summary = summarize_config({**config.to_dict(), "model": model})
    observer = SwarmObserver(RunInfo(config.run_id, model, 0, summary, record.published_at), config.data.seq_len)
    observer.observe(records, now)
    snap = observer.snapshot(now)
    body = to_jsonable(snap)
    latest = snap.latest_loss()
    body.update(
        num_peers_alive=snap.num_peers_alive(DashboardConfig().peer_alive_within_s),
        samples_contributed_total=snap.samples_contributed_total,
        compute_s_total=snap.compute_s_total,
        latest_eval_loss=None if latest is None else latest.eval_loss,
        admission=config.admission.mode,
        coordinator=record.coordinator_id,
        run_started_at=record.run_started_at,
        coordinator_version=record.version,
        compatible=ok,
    )
    if credit:
        table = _coordinator_credit(node, record.coordinator_id, config.run_id, timeout_s)
        body["credit"], body["credit_error"] = table
    return body


def _coordinator_credit(node, coordinator_id: str, run_id: str, timeout_s: float) -> tuple[list[dict] | None, str]:
    """The coordinator's credit table (``peers.link_probe.fetch_credit``) as JSON rows, or (None, why not): credit is
    folded over the whole run, which one poll of the records cannot show."""
    from hivetrain.peers.link_probe import fetch_credit
    from hivetrain.peers.loop import LoopThread

    loop = LoopThread(name="hivetrain-status")
    try:
        p2p = loop.run(node.dht.replicate_p2p(), timeout_s)
        rows = loop.run(fetch_credit(p2p, coordinator_id, run_id), timeout_s)
    except Exception as exc:  # noqa: BLE001 - the rest of the status stands without it
        return None, f"the coordinator did not give its credit table: {exc!r}"
    finally:
        loop.stop()
    keys = ("peer_id", "public_name", "samples_witnessed", "samples_claimed")
    return [dict(zip(keys, row, strict=True)) for row in rows], ""


def render(body: dict) -> str:
    """The text form of ``read_status``'s body: a few lines a person reads at a glance."""
    run = body["run"]
    trainers = [p for p in body["peers"] if p["role"] == "trainer"]
    speeds = sum(p["throughput_samples_per_s"] for p in trainers)
    lines = [
        f"run {run['run_id']}: model {run['model_preset']}, epoch {body['epoch']}, admission {body['admission']}",
        f"coordinator {body['coordinator']} (hivetrain {body['coordinator_version']})",
        f"{len(trainers)} trainer(s), {speeds:.1f} samples/s in all ({body['tokens_per_s']:.0f} tokens/s)",
    ]
    for p in trainers:
        name = p["public_name"] or p["peer_id"][:12]
        lines.append(
            f"  {name:<20} epoch {p['epoch']:<5} {p['throughput_samples_per_s']:8.1f} samples/s  "
            f"seen {p['last_seen_s_ago']:.0f}s ago  {p['reachability']}"
        )
    failed = [r for r in body["rounds"] if not r["committed"]]
    if failed:
        lines.append(f"recent failed rounds ({len(failed)}):")
        lines += [f"  epoch {r['epoch']}: {r['reason']}" for r in failed[:5]]
    if body["latest_eval_loss"] is not None:
        lines.append(f"eval loss {body['latest_eval_loss']:.3f}")
    if body.get("credit"):
        lines.append("credit (samples witnessed by the members of its groups / claimed by its own record):")
        for row in body["credit"][:10]:
            name = row["public_name"] or row["peer_id"][:12]
            lines.append(f"  {name:<20} {row['samples_witnessed']:>10} / {row['samples_claimed']}")
    elif body.get("credit_error"):
        lines.append(f"credit: {body['credit_error']}")
    if not body["compatible"]:
        lines.append(f"this hivetrain cannot join it: install hivetrain {body['coordinator_version']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
