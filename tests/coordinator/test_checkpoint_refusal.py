"""``coordinator --checkpoint-dir`` is refused where there is no one state to copy: one line, before any node."""

import signal

import tomli_w

from hivetrain.cli.coordinator import main as coordinator_main


def test_a_moshpit_run_refuses_checkpoint_dir_naming_the_strategy_and_the_fix(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps({"run_id": "m", "model": "tiny", "averaging": {"strategy": "moshpit"}}))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = coordinator_main(["--config", str(config), "--checkpoint-dir", str(tmp_path / "ckpt")])
    finally:  # main installs the CLI's handlers; pytest's own come back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert code == 2
    assert "'moshpit'" in err and "drop --checkpoint-dir" in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()
