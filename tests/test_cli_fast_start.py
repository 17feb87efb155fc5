"""Issue 26 item 3: ``--help`` and a wrong flag answer before torch, transformers and hivemind are imported.

Each check runs a fresh interpreter (``sys.modules`` of this one already holds torch) and asserts on the modules it
imported, not on time: the suite runs on busy machines, where a wall-clock bound would test the load, not the code.
"""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "hivemind", "datasets")

PROBE = """
import contextlib, io, json, sys
from hivetrain.cli.main import join_swarm, main
argv = json.loads(sys.argv[1])
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = join_swarm(argv[1:]) if argv[0] == "join-swarm-command" else main(argv)
    except SystemExit as exc:
        code = exc.code
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "heavy": heavy}))
"""


def probe(argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["join-swarm-command", "--help"],
        ["join-swarm", "--help"],
        ["coordinator", "--help"],
        ["coordinator", "invite", "--help"],
        ["coordinator", "revoke", "--help"],
        ["local-swarm", "--help"],
        ["sim", "--help"],
        ["chaos", "--help"],
        ["identity", "--help"],
        ["status", "--help"],
        ["generate", "--help"],
        ["export", "--help"],
    ],
    ids=lambda argv: " ".join(argv),
)
@pytest.mark.slow
def test_help_prints_usage_without_the_heavy_imports(argv):
    got = probe(argv)
    assert got["code"] in (0, None), got
    assert "usage:" in got["stdout"], got
    assert got["heavy"] == [], f"{' '.join(argv)} imported {got['heavy']} before answering"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["join-swarm-command", "--duty-cycle", "2"], "--duty-cycle"),
        (["join-swarm", "--bootstrap-timeout", "soon"], "--bootstrap-timeout"),
        (["coordinator", "--no-such-flag"], "--no-such-flag"),
        (["local-swarm", "--peers", "three", "--out", "x"], "--peers"),
    ],
)
@pytest.mark.slow
def test_a_wrong_flag_is_one_error_line_with_exit_2_before_the_heavy_imports(argv, flag):
    got = probe(argv)
    assert got["code"] == 2, got
    errors = [line for line in got["stderr"].splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and "Traceback" not in got["stderr"], got["stderr"]
    assert got["heavy"] == [], f"{' '.join(argv)} imported {got['heavy']} before refusing"


@pytest.mark.slow
def test_the_run_config_loads_without_torch():
    """``hivetrain.config`` is what every command reads first: it must stay light (``averaging`` imports lazily)."""
    code = (
        "import sys, json; import hivetrain.config, hivetrain.cli.args; "
        "print(json.dumps([m for m in %r if m in sys.modules]))"
    )
    proc = subprocess.run([sys.executable, "-c", code % (HEAVY,)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == []
