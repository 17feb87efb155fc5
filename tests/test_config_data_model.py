"""Run config validation, corpus handling and model presets."""

import re
from pathlib import Path

import pytest
import torch

from hivetrain.config import RunConfig, load_run_config
from hivetrain.data import load_corpus, resolve_files, stream_seed
from hivetrain.data.config import DataConfig
from hivetrain.model import build_config, build_model, count_parameters, model_fingerprint


def test_defaults_round_trip_and_fingerprint_is_stable():
    config = load_run_config()
    again = RunConfig.from_dict(config.to_dict())
    assert again == config and again.fingerprint() == config.fingerprint()


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"diloco.outer_lr": -1.0}, "diloco.outer_lr"),
        ({"diloco.inner_steps": 0}, "diloco.inner_steps"),
        ({"data.seq_len": "long"}, "data.seq_len"),
        ({"diloco.bogus": 1}, "diloco.bogus: unknown key"),
        ({"model": "huge"}, "model"),
        ({"averaging.round_timeout_s": 1.0}, "averaging.round_timeout_s"),
        ({"averaging.strategy": "moshpit", "averaging.compression": "int4"}, "averaging.compression='int4'"),
        ({"averaging.error_feedback": True}, "averaging.error_feedback needs averaging.compression"),
        ({"averaging.compression": "int4", "averaging.error_feedback_decay": 0.9}, "set averaging.error_feedback"),
        ({"averaging.error_feedback_decay": 0.0}, "averaging.error_feedback_decay"),
        ({"averaging.error_feedback_decay": 1.5}, "averaging.error_feedback_decay"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        load_run_config(None, overrides)


def test_toml_file_with_unknown_table_is_rejected(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_id = "x"\n[optimizer]\nlr = 1\n')
    with pytest.raises(ValueError, match="optimizer: unknown key"):
        load_run_config(path)
    path.write_text("run_id = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_run_config(path)


def test_missing_data_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no readable text or record file"):
        resolve_files([str(tmp_path / "nope.txt")])


def test_default_corpus_is_the_stdlib_and_windows_are_shared(tmp_path):
    files = resolve_files([])
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files[:50])
    corpus = load_corpus(DataConfig(max_corpus_bytes=2_000_000, seq_len=32, num_eval_windows=8))
    again = load_corpus(DataConfig(max_corpus_bytes=2_000_000, seq_len=32, num_eval_windows=8))
    assert corpus.vocab_size == 256
    assert torch.equal(corpus.eval_windows(32, 8), again.eval_windows(32, 8))
    a = next(corpus.train_batches(32, 4, stream_seed(0, "peerA")))
    b = next(corpus.train_batches(32, 4, stream_seed(0, "peerB")))
    assert a.shape == (4, 33) and not torch.equal(a, b)
    # held-out windows never overlap the training region
    assert corpus.eval_windows(32, 8).shape == (8, 33)


def test_presets_have_the_documented_sizes_and_identical_init():
    sizes = {}
    for preset in ("tiny", "small"):
        cfg = build_config(preset, 256, 128)
        sizes[preset] = count_parameters(build_model(cfg, seed=0))
    assert 0.3e6 < sizes["tiny"] < 0.7e6 and 3e6 < sizes["small"] < 7e6
    cfg = build_config("tiny", 256, 128)
    m1, m2 = build_model(cfg, 7), build_model(cfg, 7)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=False))
    assert model_fingerprint(cfg, m1) == model_fingerprint(cfg, m2)
    other = build_config("small", 256, 128)
    assert model_fingerprint(other, build_model(other, 7)) != model_fingerprint(cfg, m1)


def test_overlap_needs_the_butterfly_strategy():
    import pytest

    from hivetrain.config import RunConfig

    with pytest.raises(ValueError, match="diloco.overlap='eager' needs averaging.strategy='butterfly'"):
        RunConfig.from_dict(
            {"diloco": {"overlap": "eager"}, "averaging": {"strategy": "moshpit", "target_group_size": 2}}
        )
    assert RunConfig.from_dict({"diloco": {"overlap": "eager"}}).diloco.overlap == "eager"


@pytest.mark.parametrize(
    ("raw", "refusal"),
    [
        ({"diloco": {"fragments": 3, "inner_steps": 50}}, "inner_steps = 50 is not a multiple of diloco.fragments = 3"),
        ({"diloco": {"fragments": 2, "overlap": "eager"}}, "overlap = 'delayed'"),
        ({"diloco": {"fragment_mix": 0.2, "fragments": 2}}, "needs diloco.fragments > 1 and diloco.overlap"),
        ({"diloco": {"fragment_mix": 0.0, "overlap": "delayed"}}, "needs diloco.fragments > 1 and diloco.overlap"),
        (
            {"diloco": {"fragments": 2}, "averaging": {"strategy": "gossip", "target_group_size": 2}},
            "needs averaging.strategy='butterfly'",
        ),
    ],
)
def test_fragments_refuse_what_they_cannot_run_naming_the_fix(raw, refusal):
    from hivetrain.config import RunConfig

    with pytest.raises(ValueError, match=re.escape(refusal)):
        RunConfig.from_dict(raw)


def test_fragments_make_an_epoch_one_fragments_share_of_the_inner_steps():
    from hivetrain.config import RunConfig

    cfg = RunConfig.from_dict(
        {"diloco": {"fragments": 4, "inner_steps": 40, "outer_steps": 12, "overlap": "delayed", "fragment_mix": 0.5}}
    ).diloco
    assert cfg.phase_steps == 10 and cfg.schedule_length() == 120  # 12 fragment steps = 3 whole-model cycles
    assert RunConfig.from_dict({"diloco": {"inner_steps": 40, "outer_steps": 12}}).diloco.schedule_length() == 480


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_every_shipped_config_loads(name):
    """A config in ``configs/`` that users copy passes its own validation, and a lossy codec in one comes with error
    feedback (without it, what the codec drops is lost for good)."""
    config = load_run_config(CONFIGS / name)
    assert config.run_id and config.averaging.error_feedback == (config.averaging.compression != "none")
