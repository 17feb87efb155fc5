"""Run by ``tests/test_forkserver_locks.py`` and ``tests/forkserver_nested_launcher.py`` from the fork server: make an
MPFuture (every DHT call does), print its result (and with ``--ppid`` our parent's pid), exit."""

import os
import sys

from hivemind.utils.mpfuture import MPFuture

if __name__ == "__main__":
    future = MPFuture()
    future.set_result(7)
    print(future.result(timeout=5))
    if "--ppid" in sys.argv:
        print(os.getppid())
