"""A process forked from the fork server that starts processes of its own (``hivetrain local-swarm`` as the tests and
``forkserver.run`` start it) forks them itself: it holds torch, transformers and hivemind already, and a second fork
server would import them again in a fresh interpreter (12-16 s beside 4 CPU hogs before its coordinator started)."""

from __future__ import annotations

import json

import pytest

from hivetrain.localswarm import forkserver


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_forked_launcher_forks_its_children_itself_and_they_run(tmp_path):
    proc = forkserver.run(["tests.forkserver_nested_launcher", str(tmp_path)], timeout=90)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0, (tmp_path / "child.log").read_text()
    assert seen["child_parent"] == seen["pid"]  # forked by the launcher, not by a fork server
    assert seen["own_server"] is False
    # the child made an MPFuture (hivemind's locks are its own, as from the fork server) and printed its result
    assert (tmp_path / "child.log").read_text().split()[0] == "7"
