"""Compute utilization of heterogeneous volunteers on slow links, one of them behind NAT: three schedules side by side.

Real ``join-swarm`` peers and a coordinator, each in its own network namespace (root; ``ip``/``tc`` from iproute2,
``iptables`` installed with apt-get if missing). The peers run at speeds 1x, 0.5x and 0.25x (``--duty-cycle``) on
links limited to ``--mbps`` each way (``tc tbf``), so that one round of averaging takes a good share (the goal: at
least 20%) of the fastest peer's inner phase; peer ``--nat-peer`` sits behind a home router (iptables MASQUERADE, no
port forwarding, ``--client-mode`` as the README advises): nobody can dial its data port, so its links use
hivetrain's dial-back (or a libp2p stream).

Arms, one after another in one invocation (fresh coordinator and peers each, same network):

    fixed-H       diloco.schedule = "steps", overlap = "off": every peer runs H inner steps (today's synchronous DiLoCo)
    swarm         schedule = "swarm", overlap = "off": the epoch ends when the swarm has computed its target samples
    swarm+eager   schedule = "swarm", overlap = "eager": the next inner phase runs while the round is in flight
    swarm+fragments  schedule = "swarm", ``diloco.fragments = --fragments`` (Streaming DiLoCo), overlap "delayed",
                  ``fragment_mix`` 0.5: one fragment's round every H / F inner steps, each overlapping the next ones
                  (not in the default ``--arms``)

Each arm runs once per codec in ``--codecs`` ("fp32", "int8"/"int4" with "-ef" for error feedback, or
"topk<percent>-<bits>b-ef"; the first arm name keeps its plain name for fp32, "swarm+eager/int4-ef" otherwise), so that
the round seconds and bytes each member sends are printed side by side for each wire format. ``--pgrad-mb`` swaps
the tiny model for a Llama whose fp32 pseudo-gradient is at least that many MB (the issue's home-link arms: >= 50).

Every arm trains for the same wall time (``--seconds``, counted from the moment every peer has started training),
then every peer gets SIGINT. Per arm: each peer's utilization (time in inner steps / wall time, over its duty cycle),
idle seconds, the share of computed samples that reached a committed outer step (definitions in
``_utilization_metrics.py``), and the **eval loss of the last outer step committed before the stop** (evaluated by
the peers on the same held-out windows right after the step: the loss at equal wall time, up to one epoch's lag,
whose age is reported). The machine is shared: timings are noisy.

    python scripts/bench/utilization.py                  # 3 arms x 240 s, tiny model, H=400, 2.5 Mbit/s (~14 min)
    python scripts/bench/utilization.py --quick --json   # smoke run: 3 arms x 75 s, H=100
    python scripts/bench/utilization.py --arms swarm+eager --codecs fp32,int4-ef,topk3-2b-ef --mbps 20 \
        --pgrad-mb 50 --inner-steps 40 --seq-len 32 --batch-size 4      # home links: 3 wire formats, a 57 MB model
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _utilization_metrics as metrics  # noqa: E402 - sibling bench module
from _utilization_swarm import (  # noqa: E402 - sibling bench module
    ArmRun,
    PeerSpec,
    build_network,
    ensure_iptables,
    run_arm,
    supports_duty_cycle,
)
from lpb_arms import feedback_decay, without_feedback  # noqa: E402 - sibling bench module

from hivetrain.chaos.network import NetnsTopology  # noqa: E402
from hivetrain.config import load_run_config  # noqa: E402

ARMS = {
    "fixed-H": ("steps", "off"),
    "swarm": ("swarm", "off"),
    "swarm+eager": ("swarm", "eager"),
    "swarm+fragments": ("swarm", "delayed"),
}
DEFAULT_ARMS = ("fixed-H", "swarm", "swarm+eager")
DATA = "/work/shared/data/tinyshakespeare.txt"


def codec_overrides(codec: str) -> dict:
    """Run-config overrides of a ``--codecs`` name, in the learning-per-byte bench's grammar (``lpb_arms.Arm.codec``):
    "fp32", "fp16"/"int8"/"int4" (+ "-ef" for error feedback, "-ef<NN>" decayed by β = NN/100), or
    "topk<percent>-<bits>b-ef" (chunked top-k of that density and value width; topk needs error feedback).

    Raises:
        ValueError: a name of none of these shapes.
    """
    if codec == "fp32":
        return {"averaging.compression": "none"}
    base = without_feedback(codec)
    feedback = {"averaging.error_feedback": base != codec, "averaging.error_feedback_decay": feedback_decay(codec)}
    if base in ("fp16", "int8", "int4"):
        return {"averaging.compression": base, **feedback}
    percent, _, bits = base.removeprefix("topk").partition("-")
    try:
        density, value_bits = float(percent) / 100, int(bits.removesuffix("b"))
    except ValueError:
        density, value_bits = 0.0, 0
    if not base.startswith("topk") or base == codec or not bits.endswith("b") or not 0 < density <= 0.5:
        raise ValueError(f"codec {codec!r}: use fp32, fp16/int8/int4[-ef] or topk<percent>-<bits>b-ef (topk3-2b-ef)")
    return {
        "averaging.compression": "topk",
        "averaging.topk_density": density,
        "averaging.topk_value_bits": value_bits,
        **feedback,
    }


def wide_model_config(pgrad_mb: float, out_dir: Path) -> Path:
    """Write a Llama config.json (byte vocabulary) whose fp32 pseudo-gradient holds at least ``pgrad_mb`` MB (1e6
    bytes) and return its path: 384 wide, 6 heads, as many layers of 1.77M parameters as it takes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate = 384, 1024
    layers = 1
    while True:
        config = LlamaConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=1024, tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device("meta"):
            params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        if params * 4 >= pgrad_mb * 1e6:
            break
        layers += 1
    path = out_dir / "model" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config.to_json_file(path)
    return path


def arm_name(arm: str, codec: str) -> str:
    """The arm's name in the table: the schedule arm, with "/codec" unless fp32."""
    return arm if codec == "fp32" else f"{arm}/{codec}"


def arm_dir_name(name: str) -> str:
    return name.replace("+", "-").replace("/", "-")


def run_config(arm: str, codec: str, args: argparse.Namespace, out_dir: Path) -> Path:
    """Write the arm's run config (the bench's model, trains until stopped) and return its path."""
    schedule, overlap = ARMS[arm]
    config = load_run_config(
        None,
        {
            "run_id": f"util-{arm_dir_name(arm_name(arm, codec))}",
            "model": args.model,
            "data.paths": [args.data],
            "data.seq_len": args.seq_len,
            "data.batch_size": args.batch_size,
            "data.num_eval_windows": 32,
            "diloco.inner_steps": args.inner_steps,
            "diloco.inner_lr": 3e-3,
            "diloco.warmup_steps": 20,
            "diloco.outer_steps": 0,
            "diloco.eval_every": 1,
            "diloco.schedule": schedule,
            "diloco.overlap": overlap,
            "averaging.matchmaking_time_s": 2.0,
            "averaging.round_timeout_s": 240.0,  # fixed-H: the fastest peer waits for a 4x slower one, not discard
            **codec_overrides(codec),
            **({"diloco.fragments": args.fragments, "diloco.fragment_mix": 0.5} if arm == "swarm+fragments" else {}),
        },
    )
    path = out_dir / f"{arm_dir_name(arm_name(arm, codec))}.toml"
    path.write_text(tomli_w.dumps(config.to_dict()))
    return path


def eval_curve(commits: dict[str, list[metrics.Commit]], t_start: float) -> list[list]:
    """[seconds after the start, epoch, eval loss] of each committed epoch up to the stop, first report per epoch."""
    first: dict[int, metrics.Commit] = {}
    for c in sorted((c for cs in commits.values() for c in cs if c.eval_loss is not None), key=lambda c: c.time_s):
        first.setdefault(c.epoch, c)
    return [[round(c.time_s - t_start, 1), epoch, c.eval_loss] for epoch, c in sorted(first.items())]


def figures(run: ArmRun, specs: list[PeerSpec], duty_supported: bool, args: argparse.Namespace) -> dict:
    """The arm's JSON object: the issue's keys first, then per-peer detail."""
    duty = {s.name: (s.duty_cycle if duty_supported else 1.0) for s in specs}
    phases = {n: metrics.phases(ev, args.seq_len, args.batch_size, duty[n], run.t_stop) for n, ev in run.events.items()}
    commits = {n: metrics.commits(ev, run.t_stop, phases[n]) for n, ev in run.events.items()}
    last_key = max((c.round_key for cs in commits.values() for c in cs), default=-1)
    usages = [metrics.peer_usage(n, phases[n], commits[n], duty[n], last_key, run.t_stop) for n in run.events]
    fastest = max(specs, key=lambda s: s.duty_cycle).name
    round_s, phase_s, ratio = metrics.round_vs_phase(commits, phases[fastest])
    last = metrics.last_eval([c for cs in commits.values() for c in cs])
    sent = [c.bytes_sent for cs in commits.values() for c in cs if c.bytes_sent]
    summaries = [s for s in run.summaries.values() if s]
    trainer = {
        key: sum(s[key] for s in summaries) if all(key in s for s in summaries) and summaries else None
        for key in ("samples_computed", "samples_total", "samples_discarded", "state_downloads", "rounds_failed")
    }
    return {
        "arm": run.arm,
        **metrics.arm_figures(usages),
        "eval_loss": last.eval_loss if last else None,
        "wall_s": run.t_stop - run.t_start,
        "eval_epoch": last.epoch if last else 0,
        "eval_age_s": run.t_stop - last.time_s if last else None,
        "rounds_committed": last_key + 1,
        "round_s_median": round_s,
        "fastest_phase_s_median": phase_s,
        "round_to_fastest_phase": ratio,
        "bytes_sent_median": statistics.median(sent) if sent else 0,
        "link_floor_s": max(sent) * 8 / (args.mbps * 1e6) if sent else 0.0,
        "eval_curve": eval_curve(commits, run.t_start),
        "peers": [
            {
                "name": u.name,
                "duty_cycle": u.duty_cycle,
                "utilization": u.utilization,
                "idle_s": u.idle_s,
                "window_s": u.window_s,
                "compute_s": u.compute_s,
                "phases": u.num_phases,
                "samples_resolved": u.samples_resolved,
                "samples_committed": u.samples_committed,
                "exit_code": run.exit_codes.get(u.name),
                "exited_early_at_s": run.exited_early.get(u.name),
                "nat_fallback_log_lines": run.nat_log_lines.get(u.name, 0),
            }
            for u in usages
        ],
        "trainer_summaries": trainer,
    }


def print_table(results: list[dict], bench_s: float, settings: str) -> None:
    print(settings)
    head = f"{'arm':<26} {'util min':>8} {'mean':>6} {'committed':>9} {'eval loss':>9} {'@epoch':>6} {'age s':>6}"
    print(head + f" {'wall s':>7} {'round s':>7} {'/phase':>6} {'MB/round':>8}  per-peer utilization (idle s)")
    for r in results:
        peers = ", ".join(f"{p['name']} {p['utilization']:.2f} ({p['idle_s']:.0f})" for p in r["peers"])
        share = "-" if r["committed_sample_share"] is None else f"{r['committed_sample_share']:.3f}"
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        age = "-" if r["eval_age_s"] is None else f"{r['eval_age_s']:.0f}"
        print(
            f"{r['arm']:<26} {r['utilization_min']:>8.3f} {r['utilization_mean']:>6.3f} {share:>9} {loss:>9} "
            f"{r['eval_epoch']:>6} {age:>6} {r['wall_s']:>7.0f} {r['round_s_median']:>7.1f} "
            f"{r['round_to_fastest_phase']:>6.2f} {r['bytes_sent_median'] / 1e6:>8.2f}  {peers}"
        )
    for r in results:
        t = r["trainer_summaries"]
        early = [f"{p['name']} at {p['exited_early_at_s']:.0f}s" for p in r["peers"] if p["exited_early_at_s"]]
        print(
            f"{r['arm']}: {r['rounds_committed']} rounds, fastest phase {r['fastest_phase_s_median']:.1f}s, "
            f"link floor {r['link_floor_s']:.1f}s/round, trainer summaries {t}, NAT fallback log lines "
            f"{[p['nat_fallback_log_lines'] for p in r['peers']]}" + (f", exited early: {early}" if early else "")
        )
        print(f"  eval loss by epoch: {', '.join(f'{t:.0f}s e{e} {loss:.3f}' for t, e, loss in r['eval_curve'])}")
    print(f"bench wall time {bench_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument("--fragments", type=int, default=4, help="diloco.fragments of the swarm+fragments arm")
    parser.add_argument("--seconds", type=float, default=None, help="training wall time per arm (default 240)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 400; 100 with --quick)")
    parser.add_argument("--mbps", type=float, default=2.5, help="each peer's link, Mbit/s each way")
    parser.add_argument("--speeds", default="1,0.5,0.25", help="duty cycle of each peer (comma-separated)")
    parser.add_argument("--nat-peer", type=int, default=0, help="index of the peer behind NAT (-1 = none)")
    parser.add_argument("--codecs", default="fp32", help="comma-separated wire formats, each arm runs once per codec")
    parser.add_argument("--model", default="tiny", help="model preset or config.json")
    parser.add_argument("--pgrad-mb", type=float, default=0.0, help="use a Llama whose fp32 pseudo-gradient >= MB")
    parser.add_argument("--seq-len", type=int, default=64, help="data.seq_len (tokens per window)")
    parser.add_argument("--batch-size", type=int, default=8, help="data.batch_size (windows per inner step)")
    parser.add_argument("--data", default=DATA, help="training text")
    parser.add_argument("--out", default=None, help="directory for logs and metrics (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 75 s per arm, H=100")
    parser.add_argument("--json", action="store_true", help="last line: a JSON list, one object per arm")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (75.0 if args.quick else 240.0)
    # H = 400: on an idle machine H = 200 made the fastest peer's phase (12-15 s) shorter than a round (15 s at
    # 2.5 Mbit/s), a link no volunteer would pick for this model; 400 gives round / phase ~ 0.35 (issue: >= 0.2)
    args.inner_steps = args.inner_steps or (100 if args.quick else 400)
    arms = [a for a in args.arms.split(",") if a]
    speeds = [float(s) for s in args.speeds.split(",") if s]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms: choose from {', '.join(ARMS)}")
    if not speeds or any(not 0 < s <= 1 for s in speeds) or args.seconds <= 0 or args.mbps <= 0:
        parser.error("--speeds in (0, 1], --seconds and --mbps > 0")
    if args.seq_len <= 0 or args.batch_size <= 0 or args.pgrad_mb < 0:
        parser.error("--seq-len and --batch-size > 0, --pgrad-mb >= 0")
    codecs = [c for c in args.codecs.split(",") if c]
    try:
        for codec in codecs or ["?"]:
            codec_overrides(codec)
    except ValueError as exc:
        parser.error(f"--codecs: {exc}")
    if not -1 <= args.nat_peer < len(speeds):
        parser.error("--nat-peer: a peer index or -1")
    specs = [PeerSpec(f"peer{i}", s, i == args.nat_peer) for i, s in enumerate(speeds)]
    out = Path(args.out or tempfile.mkdtemp(prefix="hivetrain-utilization-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.pgrad_mb:
        args.model = str(wide_model_config(args.pgrad_mb, out))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def on_sigterm(signum, frame):  # run the finally blocks: processes, namespaces
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.time()
    ensure_iptables(log)
    duty_supported = supports_duty_cycle()
    if not duty_supported:
        log("join-swarm has no --duty-cycle here: every peer runs at full speed (speeds reported as 1.0)")
    results = []
    topology = NetnsTopology()
    try:
        topology.create()
        coordinator, members = build_network(topology, specs, args.mbps)
        log(f"network: coordinator {coordinator.ip}; " + ", ".join(
            f"{s.name} {m.ip}" + (f" behind NAT {m.public_ip}" if m.public_ip else "") + f" x{s.duty_cycle:g}"
            for s, m in zip(specs, members, strict=True)
        ))  # fmt: skip
        for arm in arms:
            for codec in codecs:
                name = arm_name(arm, codec)
                arm_dir = out / arm_dir_name(name)
                arm_dir.mkdir(parents=True, exist_ok=True)
                config_path = run_config(arm, codec, args, arm_dir)
                run = run_arm(
                    name, config_path, arm_dir, coordinator, members, specs, args.seconds, duty_supported, log
                )
                results.append(figures(run, specs, duty_supported, args))
                (out / "results.json").write_text(json.dumps(results, indent=2))
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        return 130
    finally:
        topology.close()
    outer = load_run_config(None, {}).diloco
    settings = (
        f"model {args.model}, T={args.seq_len} B={args.batch_size}, H={args.inner_steps}, {args.mbps:g} Mbit/s "
        f"per peer, speeds {args.speeds}"
        f"{'' if duty_supported else ' (duty cycle unsupported: all 1x)'}, NAT peer {args.nat_peer}, "
        f"{args.seconds:.0f}s per arm, outer lr {outer.outer_lr:g} momentum {outer.outer_momentum:g} (run defaults); "
        f"logs in {out}"
    )
    print_table(results, time.time() - started, settings)
    if args.json:
        keys = (
            "arm", "utilization_min", "utilization_mean", "committed_sample_share", "eval_loss", "wall_s",
            "round_s_median", "bytes_sent_median",
        )  # fmt: skip
        print(json.dumps([{k: r[k] for k in keys} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
