"""``join-swarm --check ADDRESS``: will this machine be useful to the run? Every check a volunteer needs before it
joins, with its measured figure, and a predicted contribution; then exit without joining.

Checks, in order (each "ok", "warn" or "fail", with a figure and a line saying what it means):

- **run**: the coordinator answers and signed a run config this hivetrain can read; its model, epoch, live trainers
  and their speed in all (``hivetrain status``'s poll).
- **device**: a CUDA smoke op (a matmul, synchronized) on a GPU; the memory preflight for the run's model
  (``preflight.run_preflight``): "fail" if it does not fit.
- **speed**: samples/s of real inner steps (``diloco.inner.InnerOptimizer``: the run's model, precision, batch and
  microbatches, on random tokens), one warm-up step and ``CHECK_STEPS`` timed ones.
- **data port**: the coordinator dials a port we listen on, at the address our libp2p stream comes from
  (``peers.link_probe``): "warn" if it cannot (NAT or a firewall: links to us then go through dial-backs or libp2p
  relays, slower).
- **upload** / **download**: ``CHECK_BYTES`` each way to the coordinator over libp2p: our link's rates.
- **forecast**: ``diloco.forecast``: phase and round times, compute utilization and our share of the swarm's samples.

Output: one line per check, or ``--json``: ``{"checks": [{name, status, value, unit, detail}], "forecast": {...}}``.
Exit codes: 0 every check ok or warn; 2 the run cannot be found (one ``error:`` line); 3 this hivetrain cannot join
it; 4 a check failed.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from hivetrain.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INCOMPATIBLE, EXIT_OK, fail

CHECK_STEPS = 3
CHECK_BYTES = 4 * 2**20
PROBE_TIMEOUT_S = 40.0


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``value`` in ``unit`` (None when nothing was measured)."""

    name: str
    status: Literal["ok", "warn", "fail"]
    value: float | None
    unit: str
    detail: str


def run_check(args: argparse.Namespace, node, device: torch.device) -> int:
    """Run every check against the run at ``args.addresses`` and print them (module docstring). Returns the exit
    code; never raises for a failed check."""
    from hivetrain.cli.status import find_run, read_status

    try:
        record, config, compatible = find_run(node, args.addresses, args.config_timeout)
        body = read_status(node, args.addresses, args.config_timeout, found=(record, config, compatible), credit=False)
    except ValueError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    trainers = [p for p in body["peers"] if p["role"] == "trainer"]
    swarm_speed = float(sum(p["throughput_samples_per_s"] for p in trainers))
    checks = [
        Check("run", "ok" if compatible[0] else "fail", float(len(trainers)), "trainers",
              f"run {config.run_id!r}: model {body['run']['model_preset']}, epoch {body['epoch']}, "
              f"{swarm_speed:.1f} samples/s in all" + ("" if compatible[0] else f"; {compatible[1]}")),
    ]  # fmt: skip
    if not compatible[0]:
        return _report(args, checks, None, EXIT_INCOMPATIBLE)
    checks += _device_checks(args, config, device)
    speed = next((c.value for c in checks if c.name == "speed" and c.status == "ok"), None)
    checks += _link_checks(args, node, record.coordinator_id, config.run_id)
    rates = {c.name: c.value for c in checks if c.name in ("upload", "download") and c.status == "ok"}
    predicted = None
    if speed and len(rates) == 2:
        predicted = _forecast(config, speed, swarm_speed, len(trainers), rates["upload"], rates["download"])
        checks.append(Check("forecast", "ok", predicted.utilization, "utilization", predicted.reason))
    failed = any(c.status == "fail" for c in checks)
    return _report(args, checks, predicted, EXIT_FAILED if failed else EXIT_OK)


def _device_checks(args, config, device: torch.device) -> list[Check]:
    from hivetrain.data import vocab_size_of
    from hivetrain.model import build_run_model, describe_run_model
    from hivetrain.preflight import InsufficientMemory, run_preflight

    checks = []
    if device.type == "cuda":
        try:
            x = torch.randn(512, 512, device=device)
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            (x @ x).sum().item()
            checks.append(Check("cuda", "ok", time.perf_counter() - started, "s",
                                f"{torch.cuda.get_device_name(device)}: a 512x512 matmul ran"))  # fmt: skip
        except RuntimeError as exc:
            return [Check("cuda", "fail", None, "", f"a CUDA op failed: {exc} (drivers? try --device cpu)")]
    vocab = vocab_size_of(config.data)
    try:
        model_config, num_parameters = describe_run_model(config, vocab, args.model_path)
        decision = run_preflight(config, model_config, num_parameters, device)
        checks.append(Check("memory", "ok", float(num_parameters), "parameters", decision.reason))
    except (InsufficientMemory, ValueError, FileNotFoundError) as exc:
        return [*checks, Check("memory", "fail", None, "", str(exc))]
    try:
        samples_per_s, step_s = _measure_speed(config, build_run_model(config, vocab, model_path=args.model_path).model,
                                               device, vocab)  # fmt: skip
    except (RuntimeError, FloatingPointError, ValueError) as exc:
        return [*checks, Check("speed", "fail", None, "", f"inner steps failed here: {exc}")]
    per_step = config.data.batch_size * config.diloco.grad_accum_steps
    checks.append(Check("speed", "ok", samples_per_s, "samples/s",
                        f"{CHECK_STEPS} inner steps of {per_step} x {config.data.seq_len} tokens on {device}: "
                        f"{step_s:.2f} s each"))  # fmt: skip
    return checks


def _measure_speed(config, model, device: torch.device, vocab: int) -> tuple[float, float]:
    """(samples/s, s per inner step) of ``CHECK_STEPS`` inner steps after one warm-up, on random tokens."""
    from hivetrain.diloco.inner import InnerOptimizer

    model.to(device)
    optimizer = InnerOptimizer(model, config.diloco)
    shape = (config.data.batch_size, config.data.seq_len + 1)
    batches = iter(lambda: torch.randint(0, vocab, shape), None)
    optimizer.run(batches, first_step=0, num_steps=1)  # warm-up: allocations, kernels
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = optimizer.run(batches, first_step=1, num_steps=CHECK_STEPS)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result.samples_per_s, result.duration_s / max(result.num_steps, 1)


def _link_checks(args, node, coordinator_id: str, run_id: str) -> list[Check]:
    from hivetrain.cli.common import data_plane_hosts
    from hivetrain.peers.link_probe import probe_dial, probe_rate
    from hivetrain.peers.loop import LoopThread

    listen_host, _ = data_plane_hosts(args)
    loop = LoopThread(name="hivetrain-check")
    checks: list[Check] = []
    try:
        p2p = loop.run(node.dht.replicate_p2p(), PROBE_TIMEOUT_S)
        with socket.create_server((listen_host, 0)) as server:
            port = server.getsockname()[1]
            try:
                ok, detail = loop.run(probe_dial(p2p, coordinator_id, run_id, port), PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any daemon or stream error: the check says so
                ok, detail = False, f"the coordinator did not answer the check: {exc!r}"
        checks.append(Check("data port", "ok" if ok else "warn", float(port), "port",
                            f"the coordinator {detail}: other peers can link to us directly" if ok else
                            f"{detail}: NAT or a firewall; links to us will go through dial-backs or libp2p relays "
                            "(slower); forward a port, or pass --host-maddrs with a reachable address"))  # fmt: skip
        for direction, name in (("up", "upload"), ("down", "download")):
            try:
                rate = loop.run(probe_rate(p2p, coordinator_id, run_id, direction, CHECK_BYTES), PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - as above
                checks.append(Check(name, "fail", None, "", f"no rate measured to the coordinator: {exc!r}"))
                continue
            way = "to" if direction == "up" else "from"
            checks.append(Check(name, "ok", rate, "bytes/s", f"{rate * 8 / 1e6:.1f} Mbit/s ({CHECK_BYTES / 2**20:.0f} "
                                f"MiB {way} the coordinator over libp2p)"))  # fmt: skip
    finally:
        loop.stop(timeout_s=2)
    return checks


def _forecast(config, speed: float, swarm_speed: float, num_trainers: int, up: float, down: float):
    from hivetrain.averaging.reduce import part_codec
    from hivetrain.data import vocab_size_of
    from hivetrain.diloco.forecast import forecast
    from hivetrain.model import describe_run_model

    _, num_parameters = describe_run_model(config, vocab_size_of(config.data))
    avg = config.averaging
    # what we upload per round (one fragment's with diloco.fragments); results are as big or bigger (topk)
    wire = part_codec(avg).frame_num_bytes(num_parameters // config.diloco.fragments)
    d = config.diloco
    return forecast(
        samples_per_s=speed, swarm_samples_per_s=swarm_speed, num_trainers=num_trainers, schedule=d.schedule,
        inner_steps=d.phase_steps, samples_per_step=config.data.batch_size * d.grad_accum_steps,
        target_samples_per_epoch=d.target_samples_per_epoch, strategy=avg.strategy,
        target_group_size=avg.target_group_size, moshpit_rounds=avg.moshpit_rounds, wire_bytes=wire,
        upload_bytes_per_s=up, download_bytes_per_s=down, overlap=d.overlap != "off",
    )  # fmt: skip


def _report(args, checks: list[Check], predicted, code: int) -> int:
    if args.json:
        body = {"checks": [asdict(c) for c in checks], "forecast": asdict(predicted) if predicted else None}
        print(json.dumps(body, indent=2), flush=True)
    else:
        for c in checks:
            mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[c.status]
            print(f"{mark} {c.name:<10} {c.detail}", flush=True)
    return code
