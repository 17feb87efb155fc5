"""CPU hogs beside a test: they spin, they are ended by PID, and none outlives its deadline or its starter."""

import subprocess
import sys
import time

import psutil
import pytest

from hivetrain.testing.hogs import CpuHogs, _cpu_seconds


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_hogs_spin_until_stopped_by_pid(cpu_hogs):
    hogs = cpu_hogs(2, max_duration_s=60)
    time.sleep(1.0)
    assert len(hogs.pids) == 2 and all(p.poll() is None for p in hogs.popens)
    assert all(_cpu_seconds(pid) > 0 for pid in hogs.pids)
    assert all(psutil.Process(pid).ppid() == psutil.Process().pid for pid in hogs.pids)
    hogs.stop()
    assert all(p.poll() is not None for p in hogs.popens) and hogs.exited_early == []
    assert len(hogs.cpu_s) == 2 and "2 CPU hog(s)" in hogs.describe()


@pytest.mark.slow
def test_a_hog_ends_by_itself_at_its_deadline_and_when_its_starter_is_gone():
    with CpuHogs(1, max_duration_s=0.5) as hogs:
        hogs.popens[0].wait(timeout=30)
    assert hogs.exited_early == hogs.pids
    starter = "from hivetrain.testing.hogs import CpuHogs; print(CpuHogs(1, 60).start().pids[0])"
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=60, check=True)
    orphan = int(out.stdout.split()[-1])  # its starter exited without stopping it
    assert wait_gone(orphan, timeout_s=20), f"hog {orphan} outlived its starter"
