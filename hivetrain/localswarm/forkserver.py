"""Start ``python -m MODULE ARGS`` processes by forking one server process that has already imported the heavy modules.

A coordinator or join-swarm process spends about 6 s of CPU importing torch, transformers (about 3.4 s alone, from
version 5) and hivemind before it does anything. A local swarm of a coordinator and four peers on a 2-core machine thus
spent about 15 s of its first 25 importing the same modules five times. Python's ``multiprocessing`` forkserver
(started once per launching process, with ``set_forkserver_preload``) imports them once; every process is then forked
from it, sharing those pages copy-on-write. A process started so that still runs a single thread (``hivetrain
local-swarm`` started by ``run``, as the tests do) forks its own children directly: it holds those modules already.

Each forked process is still a process of its own, as ``subprocess.Popen(..., start_new_session=True)`` would make
it: a new session and process group (so signalling the group reaches its p2pd), stdin from /dev/null, stdout and
stderr appended to its log file, its own environment and working directory, the module run as ``__main__`` with
``sys.argv`` as ``python -m`` sets it, non-daemon threads joined and ``atexit`` handlers run at the end, and its exit
status (``-N`` for a signal) read back. What differs: its parent is the fork server, not the launcher, and
environment variables that the interpreter reads at start (``PYTHON*``) or that torch reads at import
(``OMP_NUM_THREADS``, applied here with ``torch.set_num_threads``) come from the server's start.

As with any multiprocessing start method but "fork", the fork server imports the launching program's main module
again (as ``__mp_main__``): a script that starts processes this way guards its own work with
``if __name__ == "__main__":`` (pytest's and hivetrain's entry points do).

``run`` is ``subprocess.run(..., capture_output=True, text=True, timeout=T)`` for one command-line call.
``ForkedProcess`` is the ``subprocess.Popen`` subset the launchers use (``pid``, ``poll``, ``wait``, ``returncode``,
``send_signal``, ``terminate``, ``kill``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = (
    "torch", "transformers", "hivemind", "hivetrain.cli.main", "hivetrain.cli.join_swarm", "hivetrain.cli.coordinator",
)  # fmt: skip
"""What the server imports before it forks anything: what every coordinator and join-swarm process imports."""

SESSION_WAIT_S = 60.0
"""How long ``start`` waits for the child to be in its own process group, seconds, so that signalling the group right
after ``start`` reaches it, as after ``Popen``. It takes milliseconds; the bound is for a starved machine (beside 4
CPU hogs a child gets a third of a core), where a launch must be slow, not fail."""

_lock = threading.Lock()
_context: multiprocessing.context.BaseContext | None = None


def available() -> bool:
    """Whether this platform has a fork server (Linux and macOS do)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes are forked from the preloaded server (for
    ``torch.multiprocessing.start_processes(..., start_method="forkserver")`` and ``context().Process``)."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            _context = ctx
        return _context


class ForkedProcess:
    """A process forked from the fork server, with the ``subprocess.Popen`` methods the launchers use.

    ``returncode`` is None while it runs, then its exit code (``-N`` when signal N ended it)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.args = args
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the process has exited. Raises ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forks_itself() -> bool:
    """Whether this process can be its own fork server: it has imported torch, transformers and hivemind and runs one
    thread, native threads included (``fork`` copies only the calling thread: a lock another thread held would stay
    held in the child, and an OpenMP pool would be gone). ``hivetrain local-swarm`` forked from a fork server
    (``run``: how the tests start it) is such a process until its first thread; a fresh fork server for it would
    import the same modules again in a new interpreter (about 6 s of CPU; beside 4 CPU hogs, 12-16 s before its
    coordinator started).
    Only where ``/proc/self/task`` lists the threads (Linux)."""
    if not all(name in sys.modules for name in PRELOAD if not name.startswith("hivetrain.")):
        return False  # (our own entry modules are cheap, and the one that runs is ``__main__``, not under its name)
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def start(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, stderr_path: Path | None = None
) -> ForkedProcess:
    """Fork ``python -m argv[0] argv[1:]`` from the fork server (started, and its modules imported, on first use: about
    6 s of CPU, once per launching process), or from this process itself when it holds those modules already and runs
    a single thread (``_forks_itself``), its stdout appended to ``log_path``, its stderr too unless ``stderr_path``
    is given.

    Returns once the child is in its own session and process group. Raises RuntimeError if it is not within
    ``SESSION_WAIT_S`` (the child is killed first) or if the fork server cannot start."""
    server = multiprocessing.get_context("fork") if _forks_itself() else context()
    args = [sys.executable, "-m", *argv]
    paths = (str(log_path), str(stderr_path) if stderr_path is not None else None)
    process = server.Process(
        target=_child_main,
        args=(list(argv), dict(env), paths, os.getcwd()),
        name=f"hivetrain:{argv[0]}",
        daemon=True,  # ended (SIGTERM) and joined if the launcher exits without stopping it; _child_main undoes it
    )
    process.start()
    forked = ForkedProcess(process, args)
    deadline = time.monotonic() + SESSION_WAIT_S
    while _process_group(forked.pid) not in (forked.pid, None):
        if time.monotonic() > deadline:
            forked.kill()
            forked.wait(5)
            raise RuntimeError(f"{argv[0]} (pid {forked.pid}) was not in its own session after {SESSION_WAIT_S}s")
        time.sleep(0.005)
    return forked


def run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, *argv], capture_output=True, text=True, timeout=timeout)``, forked from the fork
    server: stdout and stderr apart, the exit code. On timeout its whole process group is killed (SIGKILL) and
    ``subprocess.TimeoutExpired`` raised with what it had written."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hivetrain-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = start(argv, dict(os.environ if env is None else env), out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
            raise subprocess.TimeoutExpired(
                proc.args, timeout, output=out.read_text(errors="replace"), stderr=err.read_text(errors="replace")
            ) from None
        return subprocess.CompletedProcess(
            proc.args, code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _process_group(pid: int) -> int | None:
    """The process group of ``pid`` (None once it is gone)."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _own_hivemind_locks() -> None:
    """Give this child hivemind's process-wide locks of its own.

    hivemind creates ``multiprocessing`` locks when it is imported (``SharedBytes._lock``, taken whenever an
    ``MPFuture`` is made, i.e. at every DHT call; ``MPFuture._initialization_lock`` and ``_update_lock``;
    ``_AsyncContextWrapper.EXECUTOR_LOCK``). Imported once here in the server, they were one set of semaphores shared by
    every process forked from it: a peer SIGKILLed while holding one (chaos ``joiner-restart-2peer``: the restart's
    SIGKILL at epoch 5) left it held forever, and every other process of the session then waited on its next DHT call.
    Running peers froze without a word, and each new coordinator or peer failed to start its DHT node within 30 s
    ("could not start the DHT node after 33.3s", no error text), for every later test of the loaded suites of
    sessions 22 and 23. A process started with ``python -m`` imports hivemind itself and has its own; so does this one
    now (hivemind's ``MPFuture.reset_backend``, for exactly this, plus the executor lock)."""
    if "hivemind" not in sys.modules:
        return
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _child_main(argv: list[str], env: dict[str, str], paths: tuple[str, str | None], cwd: str) -> None:
    """In the forked child: become what ``Popen([python, -m, *argv], stdout=log, stderr=STDOUT or its own file,
    stdin=DEVNULL, start_new_session=True, env=env)`` would have started, run the module, exit with its code."""
    os.setsid()
    multiprocessing.current_process().daemon = False  # the CLI may start processes of its own (hivemind's DHT does)
    _own_hivemind_locks()
    out_path, err_path = paths
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out_path), (2, err_path or out_path)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as we do
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = list(argv)
    sys.modules.pop(argv[0], None)  # preloaded: run it afresh as __main__, as ``python -m`` does
    code = 0
    try:
        import runpy

        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit: non-daemon threads first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing left to tell it to
            pass
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
