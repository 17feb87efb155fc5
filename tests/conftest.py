"""Shared fixtures: DHT nodes on 127.0.0.1 that are always shut down, and CPU hogs beside a test."""

import pytest

from hivetrain.peers.node import NodeConfig, start_node
from hivetrain.testing.hogs import DEFAULT_MAX_DURATION_S, CpuHogs

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture
def make_node(tmp_path):
    """make_node(initial_peers=(), name=None) -> PeerNode; every node is shut down after the test."""
    nodes = []

    def factory(initial_peers=(), name=None):
        identity = str(tmp_path / f"{name}.key") if name else None
        node = start_node(
            NodeConfig(
                initial_peers=tuple(initial_peers), host_maddrs=LOOPBACK, identity_path=identity, startup_timeout_s=30
            )
        )
        nodes.append(node)
        return node

    yield factory
    for node in reversed(nodes):
        node.shutdown()


@pytest.fixture
def cpu_hogs():
    """cpu_hogs(count, max_duration_s=1200) -> CpuHogs: ``count`` busy-loop processes (one core each) run beside the
    test until it ends, then are killed by PID. A hog that exited before the test ended fails the test at teardown:
    the test did not run loaded to its end."""
    started: list[CpuHogs] = []

    def factory(count: int, max_duration_s: float = DEFAULT_MAX_DURATION_S) -> CpuHogs:
        hogs = CpuHogs(count, max_duration_s)
        started.append(hogs)
        return hogs.start()

    try:
        yield factory
    finally:
        for hogs in started:
            hogs.stop()
    for hogs in started:
        print(f"\n{hogs.describe()}")
        assert not hogs.exited_early, f"CPU hogs {hogs.exited_early} ended before the test did: {hogs.describe()}"


# The fast lane (`./scripts/test --fast`, issue 27 item 6) leaves out every test marked `slow`; a test that starts an OS
# process (a subprocess, a multiprocessing child such as a hivemind DHT, p2pd), itself or through a function-scoped
# fixture, must carry the mark, or it fails here naming what it started, so the fast lane cannot grow process starts
# unnoticed. Processes of module- or session-scoped fixtures (a DHT shared by a whole file) are not charged to the test
# that happens to set them up; matplotlib's one-time font scan (fc-list) is not a process the test starts.
_started: list[str] = []
_charging = [False]  # True while the test's own code or one of its function-scoped fixtures runs
_NOT_CHARGED = ("fc-list",)


def _record_starts() -> None:
    import multiprocessing.process
    import subprocess

    execute_child = subprocess.Popen._execute_child
    start = multiprocessing.process.BaseProcess.start

    def recording_execute_child(self, args, *rest, **kwargs):
        name = args if isinstance(args, (str, bytes)) else (list(args)[:3] if args else args)
        if _charging[0] and not any(exe in str(name) for exe in _NOT_CHARGED):
            _started.append(f"subprocess {name}")
        return execute_child(self, args, *rest, **kwargs)

    def recording_start(self):
        if _charging[0]:
            _started.append(f"multiprocessing {type(self).__name__} {self.name}")
        return start(self)

    subprocess.Popen._execute_child = recording_execute_child
    multiprocessing.process.BaseProcess.start = recording_start


_record_starts()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # Broader-scoped fixtures reach this hook only from this directory's nodes (a session fixture's hook runs on the
    # session), so charge only what runs inside a function-scoped fixture.
    was, _charging[0] = _charging[0], fixturedef.scope == "function"
    try:
        yield
    finally:
        _charging[0] = was


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _charging[0] = True
    try:
        yield
    finally:
        _charging[0] = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not _started or item.get_closest_marker("slow") is not None:
        return
    if report.passed:
        report.outcome = "failed"
        shown = "; ".join(_started[:3]) + (f"; and {len(_started) - 3} more" if len(_started) > 3 else "")
        report.longrepr = (
            f"{item.nodeid} started {len(_started)} process(es) ({shown}) but is not marked slow: add "
            "@pytest.mark.slow (the fast lane, ./scripts/test --fast, runs no process-starting test)"
        )
