"""The `heavy` marker's lock: tests/conftest.py's autouse fixture `heavy_alone` holds it around every test.

A test marked `heavy` (its peak is GBs) holds one lock that every worker of the run shares (a file beside the
workers' temporary folders, `flock`ed): two never run at once, whichever workers draw them, so two peaks never meet
on a 24 GB machine. The lock goes with the process, so a worker that dies frees it. (pytest-xdist's `--dist
loadgroup` would pin them to one worker, but hangs at the end of the run when a worker crashes:
pytest-dev/pytest-xdist#1378.)"""

import contextlib
import fcntl


@contextlib.contextmanager
def held(node, tmp_path_factory):
    """The lock, held while the test `node` runs if it is marked `heavy`; else nothing."""
    if node.get_closest_marker("heavy") is None:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "heavy.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
