"""The coordinator reads no data: a data path missing on its machine is a warning (volunteers may hold it), not a
refusal."""

import logging

from hivetrain.cli.coordinator import _warn_missing_data
from hivetrain.config import load_run_config


def test_a_data_path_missing_on_the_coordinators_machine_is_named_in_a_warning(tmp_path, caplog):
    (tmp_path / "here.txt").write_text("text")
    paths = [str(tmp_path / "here.txt"), str(tmp_path / "volunteers" / "corpus"), str(tmp_path / "nowhere*.txt")]
    config = load_run_config(None, {"data.paths": paths})
    with caplog.at_level(logging.WARNING, logger="hivetrain.cli.coordinator"):
        _warn_missing_data(config)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "volunteers" / "corpus") in warning and "nowhere*.txt" in warning
    assert "here.txt" not in warning and "refused at join-swarm" in warning
    caplog.clear()
    _warn_missing_data(load_run_config(None, {"data.paths": paths[:1]}))
    assert not caplog.records
