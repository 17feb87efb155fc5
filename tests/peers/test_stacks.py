"""``peers.stacks``: SIGUSR1 makes a process write its threads' stacks and go on (a stuck peer shows where it waits)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import sys, threading, time
from hivetrain.peers import stacks
stacks.enable()
assert stacks.enabled()
def waiting_for_the_dht():
    threading.Event().wait(60)
threading.Thread(target=waiting_for_the_dht, daemon=True).start()
print("ready", flush=True)
time.sleep(3)
print("still running", flush=True)
"""


@pytest.mark.slow
def test_sigusr1_dumps_every_threads_stack_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "still running" in out  # not ended by the signal
    assert "in waiting_for_the_dht" in err and err.count("hread 0x") == 2, err  # both threads, with their frames


def test_without_a_file_for_stderr_it_stays_off(monkeypatch):
    """A CLI entry point called in-process with its output captured (tests, notebooks): no stack dumps, no error."""
    import io

    from hivetrain.peers import stacks

    monkeypatch.setattr(stacks, "_enabled", False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    stacks.enable()
    assert not stacks.enabled()
