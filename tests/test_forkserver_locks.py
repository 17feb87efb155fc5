"""Processes forked from the fork server (``hivetrain.localswarm.forkserver``) have hivemind's process-wide locks to
themselves: a sibling SIGKILLed while holding one does not freeze the others (loaded suites of sessions 22 and 23:
after chaos ``joiner-restart-2peer``'s SIGKILL, every later coordinator failed to start its DHT node)."""

from __future__ import annotations

import signal
import time

import pytest

from hivetrain.localswarm import forkserver


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sibling_killed_holding_hiveminds_lock_does_not_block_the_next_process(tmp_path):
    flag = tmp_path / "holding"
    holder = forkserver.start(["tests.forkserver_lock_holder", str(flag)], {}, tmp_path / "holder.log")
    try:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert flag.exists(), (tmp_path / "holder.log").read_text()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # a fresh process makes an MPFuture (every DHT call does): with the server's lock it would wait forever
    proc = forkserver.run(["tests.forkserver_future_maker"], timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "7", proc.stderr
