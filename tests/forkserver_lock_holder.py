"""Run by ``tests/test_forkserver_locks.py`` from the fork server: take hivemind's MPFuture allocation lock, say so in
the file named by argv[1], and hold it until killed (as a peer SIGKILLed inside a DHT call does)."""

import sys
import time

from hivemind.utils.mpfuture import SharedBytes

if __name__ == "__main__":
    SharedBytes._lock.acquire()
    with open(sys.argv[1], "w") as f:
        f.write("holding")
    time.sleep(120)
