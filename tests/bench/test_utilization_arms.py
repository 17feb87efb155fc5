"""The utilization bench's arms: each ``--codecs`` name is a valid run config, and ``--pgrad-mb`` builds the model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import utilization  # noqa: E402 - a bench script, not part of the package

from hivetrain.config import load_run_config  # noqa: E402


@pytest.mark.parametrize(
    ("codec", "compression", "feedback"),
    [
        ("fp32", "none", False),
        ("int4", "int4", False),
        ("int4-ef", "int4", True),
        ("topk3-2b-ef", "topk", True),
        ("topk3-2b-ef90", "topk", True),
    ],
)
def test_each_codec_name_becomes_a_run_config_the_peers_accept(codec, compression, feedback):
    config = load_run_config(None, utilization.codec_overrides(codec)).averaging
    assert (config.compression, config.error_feedback) == (compression, feedback)
    assert config.error_feedback_decay == (0.9 if codec.endswith("-ef90") else 1.0)
    if compression == "topk":
        assert (config.topk_density, config.topk_value_bits) == (pytest.approx(0.03), 2)


@pytest.mark.parametrize("codec", ["topk3-2b", "topk-2b-ef", "topk90-2b-ef", "int3", "fp32-ef", ""])
def test_a_malformed_codec_name_is_refused_with_the_names_it_takes(codec):
    with pytest.raises(ValueError, match="topk<percent>-<bits>b-ef"):
        utilization.codec_overrides(codec)


def test_arm_names_keep_the_plain_name_for_fp32_and_directories_have_no_separators():
    assert utilization.arm_name("swarm+eager", "fp32") == "swarm+eager"
    assert utilization.arm_dir_name(utilization.arm_name("swarm+eager", "int4-ef")) == "swarm-eager-int4-ef"


def test_the_wide_model_has_the_smallest_layer_count_whose_fp32_pseudo_gradient_reaches_the_size(tmp_path):
    from hivetrain.model import ModelSource, build_model, load_model_config

    path = utilization.wide_model_config(50.0, tmp_path)
    config = load_model_config(ModelSource("config", str(path)), vocab_size=256, max_seq_len=64)
    params = sum(p.numel() for p in build_model(config, seed=0).parameters())
    assert params * 4 >= 50e6
    per_layer = 4 * 384 * 384 + 3 * 384 * 1024 + 2 * 384  # attention, MLP, two RMSNorms
    assert params * 4 - per_layer * 4 < 50e6  # one layer fewer would not reach it


def test_the_fragments_arm_writes_a_run_config_the_peers_accept(tmp_path):
    args = utilization.argparse.Namespace(
        model="tiny", data="d.txt", seq_len=32, batch_size=4, inner_steps=40, fragments=4
    )
    path = utilization.run_config("swarm+fragments", "int4-ef", args, tmp_path)
    config = load_run_config(str(path), {})
    assert (config.diloco.fragments, config.diloco.overlap, config.diloco.fragment_mix) == (4, "delayed", 0.5)
    assert config.diloco.phase_steps == 10 and config.averaging.error_feedback
    plain = load_run_config(str(utilization.run_config("swarm+eager", "fp32", args, tmp_path)), {})
    assert plain.diloco.fragments == 1
    assert "swarm+fragments" not in utilization.DEFAULT_ARMS  # an opt-in arm: the default run stays three arms
