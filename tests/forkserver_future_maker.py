"""Run by ``tests/test_forkserver_locks.py`` from the fork server: make an MPFuture (every DHT call does), exit."""

from hivemind.utils.mpfuture import MPFuture

if __name__ == "__main__":
    future = MPFuture()
    future.set_result(7)
    print(future.result(timeout=5))
