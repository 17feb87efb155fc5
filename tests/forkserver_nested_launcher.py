"""Run by ``tests/test_forkserver_nested.py`` from the fork server, as ``hivetrain local-swarm`` is: start one child
with ``forkserver.start`` and print, as JSON, whether a fork server of our own was started, our pid, the child's parent
pid (as the child saw it) and the child's exit code."""

import json
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

from hivetrain.localswarm import forkserver

if __name__ == "__main__":
    out = Path(sys.argv[1])
    child = forkserver.start(["tests.forkserver_future_maker", "--ppid"], {}, out / "child.log")
    code = child.wait(60)
    print(
        json.dumps(
            {
                "own_server": multiprocessing.forkserver._forkserver._forkserver_pid is not None,
                "pid": os.getpid(),
                "child_parent": int((out / "child.log").read_text().split()[-1]),
                "code": code,
            }
        )
    )
