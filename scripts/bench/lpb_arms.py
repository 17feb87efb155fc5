"""The arms of the learning-per-byte bench, each simulated in one process: W workers run one after another.

Every arm trains the same model (``hivetrain.model`` preset, byte vocabulary) from the same initial parameters on
the same per-worker data streams (worker w reads ``stream_seed(seed, f"worker{w}")``), for the same number of samples
(``steps`` optimizer steps of ``batch_size`` windows per worker), and is scored on the same held-out windows:

* ``ddp``: synchronous data parallelism. Every step the W workers' gradients are averaged (an all-reduce) and every
  worker takes the same AdamW step. Simulated exactly as one model taking AdamW steps on the W batches concatenated:
  equal-sized batches make the mean of the W mean losses the mean loss of the concatenation (equal up to float
  summation order to the gloo all-reduce of the former multi-process bench).
* ``diloco``: every worker takes H AdamW steps (hivetrain's ``InnerOptimizer``, its state kept across outer steps)
  from its start point; the W pseudo-gradients are averaged (equal weights) and hivetrain's outer Nesterov step
  (``outer.outer_step``) is applied to the shared state. With ``overlap`` "delayed" or "eager" the round of epoch e
  runs during inner phase e+1: each worker starts phase e+1 from ``overlap.start_params`` (θ_e, or θ_e advanced by
  the eager estimate), measures its pseudo-gradient from that start point, and the average of epoch e is applied
  to the shared state when phase e+1 ends (``hivetrain/diloco/overlap.py``). The last round is applied after the
  last phase, so every arm is scored on its shared state after all samples. An optional codec quantizes every
  contribution (with error feedback for ``-ef``) and the reduced mean, as hivetrain's butterfly round does.
  With ``fragments`` F > 1 (Streaming DiLoCo, ``hivetrain/diloco/fragments.py``) every H / F inner steps one
  fragment's pseudo-gradients are averaged and its outer step applied; the workers never reload the whole model,
  only the fragment that was averaged (at once, or with "delayed" after the next H / F steps, mixed by ``mix``).
* ``async``: asynchronous SGD through a parameter server. Round robin over workers, one gradient per worker step:
  worker ``t mod W`` computes its gradient on the parameters it pulled W−1 server updates ago (staleness W−1, as W
  equal-speed workers that never wait), and the server applies it at once with AdamW (the same betas, weight decay,
  clipping and warmup/cosine schedule, stretched over the W·steps server updates).

Bytes are everything put on the network by all parties, each byte counted once, fp32 unless a codec says otherwise:
a ring all-reduce of n floats puts 2·(W−1)/W·4n bytes on the wire per worker (DDP: every step; DiLoCo: every outer
step); the parameter server moves a push (gradient) and a pull (parameters) of 4n bytes per worker step.

Deterministic: the same (setup, arm, seed) gives the same loss on the same machine (one torch thread).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from hivetrain.data import Corpus, load_corpus, stream_seed
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.diloco.fragments import FragmentPlan, fragment_outer_step, fragment_pseudo_gradient, merge_fragment
from hivetrain.diloco.inner import InnerOptimizer, lr_multiplier
from hivetrain.diloco.outer import load_into_model, outer_step, pseudo_gradient
from hivetrain.diloco.overlap import PreviousRound, start_params
from hivetrain.diloco.state import TrainingState
from hivetrain.model import build_config, build_model, evaluate, lm_loss

ArmKind = Literal["ddp", "diloco", "async"]


@dataclass(frozen=True)
class Setup:
    """What every arm of one comparison shares. Units: steps are optimizer steps per worker, windows of tokens."""

    data: str
    preset: str = "tiny"
    workers: int = 4
    steps: int = 600
    seq_len: int = 64
    batch_size: int = 8
    warmup_steps: int = 20
    eval_windows: int = 64

    def key(self) -> str:
        return f"{self.preset}/W{self.workers}/S{self.steps}/T{self.seq_len}/B{self.batch_size}/wu{self.warmup_steps}"


@dataclass(frozen=True)
class Arm:
    """One algorithm with its hyper-parameters.

    Attributes:
        kind: "ddp", "diloco" or "async".
        lr: peak AdamW learning rate (DDP's, DiLoCo's inner, the parameter server's).
        inner_steps: DiLoCo's H (0 for the other kinds).
        outer_lr, outer_momentum: DiLoCo's outer Nesterov SGD (None for the other kinds).
        overlap: DiLoCo's "off", "delayed" or "eager".
        codec: "" (fp32) or a pseudo-gradient codec name: fp16, int8, int4 (with "-ef" for error feedback), or
            "topk<percent>-<bits>b-ef" (``averaging.compression = "topk"`` at that density and value width, chunks of
            4,096, with error feedback, which topk requires), e.g. "topk2-2b-ef"; "-ef<NN>" decays the residual by
            β = NN/100 per round (SparseLoCo's accumulator, ``ErrorFeedback``), e.g. "topk3-2b-ef95".
        fragments: Streaming DiLoCo's F (``hivetrain/diloco/fragments.py``): one fragment's round every H / F inner
            steps, in turn (1 = DiLoCo's whole-model rounds). With ``overlap`` "delayed" each fragment's round runs
            during the next H / F steps and its average is merged into the local copies then, with mixing factor
            ``mix`` (α: θ_local ← α·θ_local + (1 − α)·θ); "eager" is not defined for fragments.
        mix: α of the merge (0 = the shared θ replaces the local copy).
    """

    kind: ArmKind
    lr: float
    inner_steps: int = 0
    outer_lr: float | None = None
    outer_momentum: float | None = None
    overlap: str = "off"
    codec: str = ""
    fragments: int = 1
    mix: float = 0.0

    def family(self) -> str:
        """Name of the arm without its tuned hyper-parameters (the row of the table)."""
        if self.kind != "diloco":
            return self.kind
        name = f"diloco-H{self.inner_steps}" + (f"-F{self.fragments}" if self.fragments > 1 else "")
        if self.overlap != "off":
            name += f"-{self.overlap}"
        if self.mix:
            name += f"-a{self.mix:g}"
        return name + (f"-{self.codec}" if self.codec else "")

    def key(self) -> str:
        outer = "" if self.kind != "diloco" else f"/olr{self.outer_lr}/mu{self.outer_momentum}"
        return f"{self.family()}/lr{self.lr}{outer}"


@dataclass(frozen=True)
class Result:
    """Outcome of one (setup, arm, seed) run: held-out loss in nats per token, bytes on the network, seconds."""

    eval_loss: float
    bytes: int
    wall_s: float
    num_parameters: int


def ring_bytes(num_floats: int, workers: int, bits_per_float: float = 32.0, result_bits: float | None = None) -> int:
    """Bytes all W workers of a ring (or butterfly) all-reduce put on the wire for one call: W · (W−1)/W · n · bits/8
    for the reduce-scatter and as much for the all-gather, at ``result_bits`` per float if the results travel in
    another encoding than the parts (topk: every element any member sent, at 8 bits)."""
    gather = bits_per_float if result_bits is None else result_bits
    return int((workers - 1) * num_floats * (bits_per_float + gather) / 8)


def codec_config(name: str, members: int = 1):
    """(``averaging.codecs.CodecConfig`` of the parts, of the results for ``members`` workers, error feedback?) for
    an arm's codec name (``Arm.codec``)."""
    from hivetrain.averaging.codecs import CodecConfig
    from hivetrain.averaging.reduce import result_codec

    base = without_feedback(name)
    feedback = base != name
    if base.startswith("topk"):
        percent, _, bits = base.removeprefix("topk").partition("-")
        if not feedback or not bits.endswith("b"):
            raise ValueError(f"codec {name!r}: topk arms are topk<percent>-<bits>b-ef (error feedback is required)")
        k = math.ceil(float(percent) / 100 * 4096)
        part = CodecConfig("topk", 4096, "fp32", k, int(bits.removesuffix("b")))
        return part, result_codec(part, members), True
    if base not in ("fp16", "int8", "int4"):
        raise ValueError(f"unknown codec {name!r} (fp16, int8, int4, optionally with -ef; or topk<pct>-<bits>b-ef)")
    part = CodecConfig(name=base, block_size=64)
    return part, part, feedback


def without_feedback(name: str) -> str:
    """The codec name without its "-ef" / "-ef<β·100>" suffix (error feedback, decayed by β when given)."""
    match = re.fullmatch(r"(.+)-ef(\d\d)?", name)
    return match.group(1) if match else name


def feedback_decay(name: str) -> float:
    """β of a codec name's error feedback: 0.95 for "...-ef95", 1.0 for "...-ef" (plain EF) or no feedback."""
    match = re.fullmatch(r".+-ef(\d\d)", name)
    return int(match.group(1)) / 100 if match else 1.0


@cache
def _corpus(setup_data: str, seq_len: int, eval_windows: int) -> Corpus:
    cfg = DataConfig(
        paths=(setup_data,), seq_len=seq_len, batch_size=1, num_eval_windows=eval_windows, max_corpus_bytes=0
    )
    return load_corpus(cfg)


def _schedule(lr: float, steps: int, warmup_steps: int) -> DilocoConfig:
    """The warmup + cosine schedule of ``steps`` optimizer steps (``lr_multiplier``), with hivetrain's clip/decay."""
    return DilocoConfig(inner_lr=lr, warmup_steps=warmup_steps, total_inner_steps=steps)


def run_arm(setup: Setup, arm: Arm, seed: int) -> Result:
    """Train one arm from seed ``seed`` and score it; see the module docstring for what each kind does.

    Raises:
        ValueError: ``setup.steps`` is not a multiple of H, or an unknown kind/overlap/codec.
        FloatingPointError: a loss became NaN/Inf (the caller records the run as diverged).
    """
    torch.set_num_threads(1)
    corpus = _corpus(setup.data, setup.seq_len, setup.eval_windows)
    model_cfg = build_config(setup.preset, corpus.vocab_size, setup.seq_len)
    streams = [
        corpus.train_batches(setup.seq_len, setup.batch_size, stream_seed(seed, f"worker{w}"))
        for w in range(setup.workers)
    ]
    started = time.perf_counter()
    if arm.kind == "ddp":
        model, sent = _run_ddp(setup, arm, model_cfg, seed, streams)
    elif arm.kind == "diloco" and arm.fragments > 1:
        model, sent = _run_streaming(setup, arm, model_cfg, seed, streams)
    elif arm.kind == "diloco":
        model, sent = _run_diloco(setup, arm, model_cfg, seed, streams)
    elif arm.kind == "async":
        model, sent = _run_async(setup, arm, model_cfg, seed, streams)
    else:
        raise ValueError(f"unknown arm kind {arm.kind!r}")
    wall_s = time.perf_counter() - started
    loss = evaluate(model, corpus.eval_windows(setup.seq_len, setup.eval_windows))
    num_parameters = sum(p.numel() for p in model.parameters())
    return Result(eval_loss=loss, bytes=sent, wall_s=wall_s, num_parameters=num_parameters)


def _adamw(params, lr: float, cfg: DilocoConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def _check(loss: torch.Tensor, step: int) -> None:
    if not torch.isfinite(loss):
        raise FloatingPointError(f"step {step}: loss is {loss.item()}")


def _run_ddp(setup, arm, model_cfg, seed, streams):
    model = build_model(model_cfg, seed=seed)
    params = list(model.parameters())
    cfg = _schedule(arm.lr, setup.steps, setup.warmup_steps)
    opt = _adamw(params, arm.lr, cfg)
    num_floats = sum(p.numel() for p in params)
    for step in range(setup.steps):
        for group in opt.param_groups:
            group["lr"] = arm.lr * lr_multiplier(step, cfg)
        loss = lm_loss(model, torch.cat([next(s) for s in streams]))  # (W·B, T+1): the mean of the W worker means
        _check(loss, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
    return model, setup.steps * ring_bytes(num_floats, setup.workers)


def _run_async(setup, arm, model_cfg, seed, streams):
    server = build_model(model_cfg, seed=seed)
    worker = build_model(model_cfg, seed=seed)
    params = list(server.parameters())
    num_updates = setup.steps * setup.workers
    cfg = _schedule(arm.lr, num_updates, setup.warmup_steps * setup.workers)
    opt = _adamw(params, arm.lr, cfg)
    num_floats = sum(p.numel() for p in params)
    pulled: deque[list[torch.Tensor]] = deque(maxlen=setup.workers)  # the last W parameter versions, oldest first
    for t in range(num_updates):
        pulled.append([p.detach().clone() for p in params])
        stale = pulled[0]  # pulled W−1 updates ago (fresher during the first W−1 updates)
        with torch.no_grad():
            for p, v in zip(worker.parameters(), stale, strict=True):
                p.copy_(v)
        loss = lm_loss(worker, next(streams[t % setup.workers]))
        _check(loss, t)
        worker.zero_grad(set_to_none=True)
        loss.backward()
        for p, w in zip(params, worker.parameters(), strict=True):
            p.grad = w.grad
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = arm.lr * lr_multiplier(t, cfg)
        opt.step()
    return server, num_updates * 2 * num_floats * 4


class _Quantizer:
    """A worker's codec path: contribution (+ error-feedback residual) → encode → decode, as the butterfly round;
    with ``result`` the reducers' path for the mean of ``members`` contributions (no error feedback)."""

    def __init__(self, name: str, members: int = 1, result: bool = False):
        from hivetrain.averaging.codecs import make_codec
        from hivetrain.averaging.feedback import ErrorFeedback

        part, mean, feedback = codec_config(name, members)
        config = mean if result else part
        self.codec = make_codec(config)
        self.feedback = ErrorFeedback(feedback_decay(name)) if feedback and not result else None
        self.bits_per_float = config.frame_num_bytes(1 << 16) * 8 / (1 << 16)

    def roundtrip(self, flat: torch.Tensor) -> torch.Tensor:
        residual = self.feedback.apply(flat) if self.feedback is not None else None
        quantized = self.codec.decode(self.codec.encode(flat))
        if residual is not None:
            torch.sub(flat, quantized, out=residual)
            self.feedback.commit()
        return quantized


def _run_diloco(setup, arm, model_cfg, seed, streams):
    h = arm.inner_steps
    if h < 1 or setup.steps % h:
        raise ValueError(f"steps ({setup.steps}) must be a multiple of H ({h})")
    if arm.overlap not in ("off", "delayed", "eager"):
        raise ValueError(f"unknown overlap {arm.overlap!r}")
    cfg = DilocoConfig(
        inner_steps=h,
        inner_lr=arm.lr,
        warmup_steps=setup.warmup_steps,
        total_inner_steps=setup.steps,
        outer_lr=arm.outer_lr,
        outer_momentum=arm.outer_momentum,
    )
    lr, mu = float(arm.outer_lr), float(arm.outer_momentum)
    models = [build_model(model_cfg, seed=seed) for _ in range(setup.workers)]
    inners = [InnerOptimizer(m, cfg) for m in models]
    quantizers = [_Quantizer(arm.codec) for _ in models] if arm.codec else None
    mean_codec = _Quantizer(arm.codec, setup.workers, result=True) if arm.codec else None
    state = TrainingState.from_model(models[0])
    num_floats = sum(t.numel() for t in state.params.values())
    starts = [state.params] * setup.workers
    previous: list[PreviousRound | None] = [None] * setup.workers
    pending: tuple[list[torch.Tensor], list[list[torch.Tensor]]] | None = None  # (Δ̄, per-worker Δ) in flight
    sent = 0
    for epoch in range(setup.steps // h):
        deltas = []
        for w, (model, inner) in enumerate(zip(models, inners, strict=True)):
            start = TrainingState(epoch=state.epoch, params=starts[w], momentum=state.momentum)
            load_into_model(start, model)
            inner.run(streams[w], first_step=epoch * h, num_steps=h)
            deltas.append(pseudo_gradient(start, model))  # Δ from this phase's own start point
        avg = _average(deltas, quantizers, mean_codec)
        if quantizers is None:
            sent += ring_bytes(num_floats, setup.workers)
        else:
            sent += ring_bytes(num_floats, setup.workers, quantizers[0].bits_per_float, mean_codec.bits_per_float)
        if arm.overlap == "off":
            state = outer_step(state, avg, lr, mu)
            starts = [state.params] * setup.workers
            continue
        if pending is not None:  # the round of the previous epoch commits when this phase ends
            state = outer_step(state, pending[0], lr, mu)
            previous = [PreviousRound(pending[0], own, 1.0 / setup.workers) for own in pending[1]]
        starts = [start_params(state, d, p, arm.overlap, lr, mu) for d, p in zip(deltas, previous, strict=True)]
        pending = (avg, deltas)
    if pending is not None:
        state = outer_step(state, pending[0], lr, mu)
    load_into_model(state, models[0])
    return models[0], sent


def _run_streaming(setup, arm, model_cfg, seed, streams):
    """Streaming DiLoCo: after every H / F inner steps one fragment's pseudo-gradients are averaged and its outer step
    applied (``fragments.fragment_outer_step``); the local copies take the new θ of that fragment at once ("off"),
    or, with "delayed", when the next H / F steps end, mixed with factor α (the round overlapped those steps). After
    the last phase every other fragment has one more round, so the arm is scored on the shared state after all
    samples, as every other arm (their bytes counted: (F − 1) / F of one whole-model round)."""
    h, f = arm.inner_steps, arm.fragments
    if h % f or setup.steps % (h // f):
        raise ValueError(f"H ({h}) must be a multiple of F ({f}), and steps ({setup.steps}) of H / F")
    if arm.overlap not in ("off", "delayed"):
        raise ValueError(f"fragments run with overlap off or delayed, not {arm.overlap!r}")
    phase = h // f
    cfg = DilocoConfig(inner_steps=h, inner_lr=arm.lr, warmup_steps=setup.warmup_steps, total_inner_steps=setup.steps)
    lr, mu = float(arm.outer_lr), float(arm.outer_momentum)
    models = [build_model(model_cfg, seed=seed) for _ in range(setup.workers)]
    inners = [InnerOptimizer(m, cfg) for m in models]
    shared = TrainingState.from_model(models[0])
    plan = FragmentPlan.of_state(shared, f)
    # error feedback keeps one residual per fragment (its tensors only), as a peer's averager would per round shape
    quantizers = [[_Quantizer(arm.codec) for _ in models] for _ in range(f)] if arm.codec else None
    means = [_Quantizer(arm.codec, setup.workers, result=True) for _ in range(f)] if arm.codec else None
    sent = 0

    def average(p: int) -> list[torch.Tensor]:
        nonlocal sent
        deltas = [fragment_pseudo_gradient(shared, model, plan.fragments[p]) for model in models]
        bits = (quantizers[p][0].bits_per_float, means[p].bits_per_float) if quantizers else (32.0, None)
        sent += ring_bytes(plan.numels[p], setup.workers, *bits)
        return _average(deltas, quantizers[p] if quantizers else None, means[p] if means else None)

    def commit(p: int, avg: list[torch.Tensor], alpha: float | None) -> None:
        nonlocal shared
        shared = fragment_outer_step(shared, plan.fragments[p], avg, lr, mu)
        for model in models if alpha is not None else ():
            merge_fragment(model, shared, plan.fragments[p], alpha)

    pending: tuple[int, list[torch.Tensor]] | None = None  # (fragment, Δ̄) in flight
    for epoch in range(setup.steps // phase):
        for inner, stream in zip(inners, streams, strict=True):
            inner.run(stream, first_step=epoch * phase, num_steps=phase)
        if pending is not None:  # the round sent one phase ago lands now
            commit(*pending, arm.mix)
            pending = None
        p = plan.fragment_of(epoch)
        if arm.overlap == "off":
            commit(p, average(p), 0.0)
        else:
            pending = (p, average(p))
    if pending is not None:
        commit(*pending, None)
    last = plan.fragment_of(setup.steps // phase - 1)
    for p in range(f):
        if p != last:
            commit(p, average(p), None)
    load_into_model(shared, models[0])
    return models[0], sent


def _average(deltas, quantizers, mean_codec) -> list[torch.Tensor]:
    """Equal-weight mean of the workers' Δ, through the codec when there is one (contributions and the mean)."""
    shapes = [d.shape for d in deltas[0]]
    flats = [torch.cat([t.reshape(-1) for t in d]) for d in deltas]
    if quantizers is not None:
        flats = [q.roundtrip(f) for q, f in zip(quantizers, flats, strict=True)]
    mean = torch.stack(flats).sum(0) / len(flats)
    if mean_codec is not None:
        mean = mean_codec.roundtrip(mean)
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(mean[offset : offset + n].view(shape).clone())
        offset += n
    return out
