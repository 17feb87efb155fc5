"""``hivetrain chaos suite``: a bad scenario is refused before any scenario runs (no process is started)."""

from hivetrain.chaos import suite
from hivetrain.cli import chaos


def test_a_bad_scenario_name_is_refused_before_any_scenario_runs(monkeypatch, tmp_path, capsys):
    ran = []
    monkeypatch.setattr(chaos, "install_signal_handlers", lambda: None)  # not pytest's own SIGINT/SIGTERM handling
    monkeypatch.setattr(suite, "run_scenario", lambda scenario, out, log: ran.append(scenario.name))
    code = chaos.main(["suite", str(tmp_path / "out"), "kill-one-of-four", "no-such-scenario"])
    err = capsys.readouterr().err
    assert code == 2 and ran == []
    assert err.startswith("error: no scenario 'no-such-scenario'") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
