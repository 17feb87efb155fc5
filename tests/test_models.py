"""The run's model from a transformers config.json or a pretrained directory; fingerprints; memory preflight."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

from hivetrain import __version__
from hivetrain.config import RunConfig, load_run_config
from hivetrain.data.config import DataConfig
from hivetrain.diloco.config import DilocoConfig
from hivetrain.model import (
    build_config,
    build_model,
    build_run_model,
    describe_run_model,
    model_fingerprint,
    set_activation_checkpointing,
    weights_sha256,
)
from hivetrain.peers.records import PeerRecord, check_compatible
from hivetrain.preflight import (
    GIB,
    PROCESS_BYTES,
    InsufficientMemory,
    estimate_memory,
    resolve_device,
    run_preflight,
)

SEQ_LEN = 32
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def run_with(model: str, seed: int = 0, **diloco) -> RunConfig:
    return RunConfig(model=model, seed=seed, data=DataConfig(seq_len=SEQ_LEN), diloco=DilocoConfig(**diloco))


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    made = {
        "neox": GPTNeoXConfig(vocab_size=300, max_position_embeddings=64, **TINY),
        "qwen2": Qwen2Config(vocab_size=300, max_position_embeddings=64, num_key_value_heads=2, **TINY),
        "llama": LlamaConfig(vocab_size=300, max_position_embeddings=64, **TINY),
    }
    for name, config in made.items():
        config.save_pretrained(root / name)
    return {name: root / name for name in made}


def test_presets_keep_their_fingerprint_and_init() -> None:
    built = build_run_model(run_with("tiny", seed=3), 256)
    config = build_config("tiny", vocab_size=256, max_seq_len=SEQ_LEN)
    model = build_model(config, seed=3)
    assert built.fingerprint == model_fingerprint(config, model)  # the formula peers of earlier versions use
    assert all(torch.equal(a, b) for a, b in zip(built.model.parameters(), model.parameters(), strict=True))
    assert build_run_model(run_with("tiny"), 256, meta=True).fingerprint == built.fingerprint


def test_config_json_of_other_architectures_builds_with_its_own_fingerprint(configs: dict[str, Path]) -> None:
    neox = build_run_model(run_with(str(configs["neox"])), 256)
    assert type(neox.model).__name__ == "GPTNeoXForCausalLM" and neox.config.vocab_size == 300
    again = build_run_model(run_with(str(configs["neox"] / "config.json")), 256)  # the file itself works too
    assert again.fingerprint == neox.fingerprint
    assert all(
        torch.equal(a, b) for a, b in zip(neox.model.parameters(), again.model.parameters(), strict=True)
    )  # seeded θ₀
    other_seed = build_run_model(run_with(str(configs["neox"]), seed=1), 256)
    assert not torch.equal(next(other_seed.model.parameters()), next(neox.model.parameters()))
    assert build_run_model(run_with(str(configs["neox"])), 256, meta=True).fingerprint == neox.fingerprint

    fingerprints = {neox.fingerprint}
    for name in ("qwen2", "llama"):
        built = build_run_model(run_with(str(configs[name])), 256)
        fingerprints.add(built.fingerprint)
        logits = built.model(input_ids=torch.randint(0, 256, (2, SEQ_LEN))).logits
        assert logits.shape == (2, SEQ_LEN, 300)
    assert len(fingerprints) == 3
    config, num_parameters = describe_run_model(run_with(str(configs["neox"])), 256)
    assert num_parameters == sum(p.numel() for p in neox.model.parameters()) and config.model_type == "gpt_neox"


def test_bad_model_specs_are_clear_errors(configs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not cover the tokenizer's 512 ids"):
        build_run_model(run_with(str(configs["neox"])), 512)
    with pytest.raises(ValueError, match="max_position_embeddings 64 is shorter than data.seq_len 128"):
        build_run_model(RunConfig(model=str(configs["neox"]), data=DataConfig(seq_len=128)), 256)
    with pytest.raises(ValueError, match="model 'huge': not a preset"):
        load_run_config(None, {"model": "huge"})
    with pytest.raises(FileNotFoundError, match="--model-path"):
        build_run_model(run_with(str(tmp_path / "absent")), 256)
    pickled = tmp_path / "pickled"
    shutil.copytree(configs["llama"], pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled weights"):
        build_run_model(run_with(str(pickled)), 256)


def test_pretrained_dir_is_theta0_and_other_weights_are_refused(configs: dict[str, Path], tmp_path: Path) -> None:
    source = build_run_model(run_with(str(configs["neox"]), seed=7), 256).model
    source.save_pretrained(tmp_path / "pre", safe_serialization=True)
    built = build_run_model(run_with(str(tmp_path / "pre"), seed=0), 256)  # the run seed does not matter
    saved = source.state_dict()
    assert built.model.state_dict().keys() == saved.keys()
    assert all(torch.equal(t, saved[name]) for name, t in built.model.state_dict().items())
    fresh = build_run_model(run_with(str(configs["neox"]), seed=7), 256)
    assert built.fingerprint != fresh.fingerprint  # same architecture; the weights' hash tells them apart
    assert build_run_model(run_with(str(tmp_path / "pre")), 256, meta=True).fingerprint == built.fingerprint

    # another peer keeps a copy elsewhere (--model-path): same weights, same fingerprint
    shutil.copytree(tmp_path / "pre", tmp_path / "copy")
    copy = build_run_model(run_with(str(tmp_path / "pre")), 256, model_path=tmp_path / "copy")
    assert copy.fingerprint == built.fingerprint

    # a peer whose files hold other weights builds another fingerprint and is refused
    with torch.no_grad():
        next(source.parameters()).add_(1e-3)
    source.save_pretrained(tmp_path / "other", safe_serialization=True)
    other = build_run_model(run_with(str(tmp_path / "pre")), 256, model_path=tmp_path / "other")
    assert other.fingerprint != built.fingerprint
    assert weights_sha256(sorted((tmp_path / "other").glob("*.safetensors"))) != weights_sha256(
        sorted((tmp_path / "pre").glob("*.safetensors"))
    )
    coordinator = PeerRecord(
        peer_id="12D3KooWCoordinator",
        role="coordinator",
        version=__version__,
        run_id="hivetrain",
        model_fingerprint=built.fingerprint,
        epoch=0,
        throughput=0.0,
        state_hash="",
        maddrs=(),
        reachable=True,
        updated_at=0.0,
    )
    assert check_compatible(coordinator, "hivetrain", copy.fingerprint)[0]
    ok, reason = check_compatible(coordinator, "hivetrain", other.fingerprint)
    assert not ok and "different model" in reason


def test_memory_estimate_counts_the_documented_parts() -> None:
    config = build_config("base", vocab_size=256, max_seq_len=1024)
    n = 150_000_000
    est = estimate_memory(n, config, microbatch=8, seq_len=1024, device_type="cuda", half_precision=True)
    assert (est.parameters_bytes, est.gradients_bytes, est.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    assert est.autocast_weights_bytes == 2 * n and est.outer_state_bytes == 12 * n
    tokens = 8 * 1024
    expected = 12 * tokens * (10 * 1024 * 4 + 4 * 2816 * 2) + tokens * 256 * (2 + 8)
    assert est.activations_bytes == expected
    # on the CPU: θ, momentum and pseudo-gradient 12N, the round's buffers 12N, the outer step's new θ and momentum 8N,
    # the 2 older states the state server keeps 16N, and the process itself
    host = 48 * n + PROCESS_BYTES
    assert (est.round_bytes, est.commit_bytes, est.served_bytes) == (12 * n, 8 * n, 16 * n)
    assert est.host_bytes == host
    cpu = estimate_memory(n, config, microbatch=8, seq_len=1024, device_type="cpu", half_precision=False)
    assert cpu.host_bytes == cpu.device_bytes + host and cpu.autocast_weights_bytes == 0
    eager = estimate_memory(
        n, config, microbatch=8, seq_len=1024, device_type="cuda", half_precision=True, overlap="eager"
    )
    assert eager.host_bytes == host + 8 * n  # the previous average and our previous pseudo-gradient


def test_preflight_refuses_with_the_options_named() -> None:
    run = RunConfig(model="base", data=DataConfig(seq_len=1024, batch_size=16), diloco=DilocoConfig(grad_accum_steps=2))
    config, num_parameters = describe_run_model(run, 256)
    with pytest.raises(InsufficientMemory) as refused:
        run_preflight(run, config, num_parameters, torch.device("cuda"), free=(4 * GIB, 64 * GIB))
    message = str(refused.value)
    for needed in ("GiB of GPU memory, 4.00 free", "data.batch_size (now 16", "diloco.grad_accum_steps (now 2)"):
        assert needed in message
    assert "smaller model" in message and "CPU memory (offloaded)" in message and "--skip-memory-check" in message
    # the same run fits a larger GPU; on a CPU peer the host's memory is what counts
    assert run_preflight(run, config, num_parameters, torch.device("cuda"), free=(80 * GIB, 64 * GIB)).ok
    with pytest.raises(InsufficientMemory, match="GiB of host memory, 2.00 available"):
        run_preflight(run, config, num_parameters, torch.device("cpu"), free=(2 * GIB, 2 * GIB))


def test_checkpointed_activations_keep_one_input_per_layer_and_one_layer_recomputed() -> None:
    config = build_config("base", vocab_size=256, max_seq_len=1024)
    kept = estimate_memory(150_000_000, config, microbatch=8, seq_len=1024, device_type="cuda", half_precision=True)
    ckpt = estimate_memory(
        150_000_000,
        config,
        microbatch=8,
        seq_len=1024,
        device_type="cuda",
        half_precision=True,
        activation_checkpointing=True,
    )
    tokens = 8 * 1024
    layer, logits = tokens * (10 * 1024 * 4 + 4 * 2816 * 2), tokens * 256 * (2 + 8)
    assert kept.activations_bytes == 12 * layer + logits
    assert ckpt.activations_bytes == 12 * tokens * 1024 * 4 + layer + logits
    assert ckpt.parameters_bytes == kept.parameters_bytes and "(checkpointed)" in ckpt.breakdown()


def test_preflight_turns_activation_checkpointing_on_only_when_the_run_fits_with_it_alone() -> None:
    def run(mode: str) -> RunConfig:
        diloco = DilocoConfig(activation_checkpointing=mode)
        return RunConfig(model="base", data=DataConfig(seq_len=1024, batch_size=16), diloco=diloco)

    config, n = describe_run_model(run("auto"), 256)
    cuda = torch.device("cuda")
    roomy, tight, tiny = (80 * GIB, 64 * GIB), (8 * GIB, 64 * GIB), (2 * GIB, 64 * GIB)  # base at 16 x 1024, bf16
    assert not run_preflight(run("auto"), config, n, cuda, free=roomy).activation_checkpointing
    decision = run_preflight(run("auto"), config, n, cuda, free=tight)
    assert decision.ok and decision.activation_checkpointing
    assert (
        "activation checkpointing on (without it the run needs" in decision.reason and "GiB of GPU" in decision.reason
    )
    assert run_preflight(run("on"), config, n, cuda, free=roomy).activation_checkpointing
    with pytest.raises(InsufficientMemory, match="diloco.activation_checkpointing = 'on'"):
        run_preflight(run("off"), config, n, cuda, free=tight)
    with pytest.raises(InsufficientMemory) as refused:  # too small even checkpointed: the advice moves on
        run_preflight(run("auto"), config, n, cuda, free=tiny)
    assert "(checkpointed)" in str(refused.value) and "activation_checkpointing = 'on'" not in str(refused.value)


def test_a_checkpointed_model_trains_bit_for_bit_like_the_plain_one() -> None:
    """The backward pass recomputes each layer's forward pass: on the CPU in fp32 the same numbers, hence the same
    gradients and parameters."""
    from hivetrain.diloco.inner import InnerOptimizer
    from tests.diloco.test_precision import stream, tiny_model

    plain_model, ckpt_model = tiny_model(), tiny_model()
    set_activation_checkpointing(ckpt_model, True)
    assert ckpt_model.is_activation_checkpointing and not plain_model.is_activation_checkpointing
    losses: list[list[float]] = [[], []]
    for model, recorded in zip((plain_model, ckpt_model), losses, strict=True):
        InnerOptimizer(model, DilocoConfig(warmup_steps=2)).run(
            stream(8), 0, 6, lambda i, loss, r=recorded: r.append(loss)
        )
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), ckpt_model.parameters(), strict=True))
    set_activation_checkpointing(ckpt_model, False)
    assert not ckpt_model.is_activation_checkpointing


def test_resolve_device_names_the_fix_when_cuda_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="no CUDA device.*--device cpu or auto"):
            resolve_device(name)
