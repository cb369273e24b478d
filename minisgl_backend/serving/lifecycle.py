"""Leave nothing behind when tritonserver dies without unloading its models.

When tritonserver exits abruptly (a crash, SIGKILL, or its exit timeout running out with
requests in flight), a Python backend stub may be left waiting on a server that is gone. Each of
our models starts a watchdog: once the stub has been re-parented (its server is gone), it runs
the model's cleanup (bounded), removes the folders the cleanup would have removed (in case it
ran out of time) and the stub's shared-memory region, which nobody else will, and ends the
process. A tiny reaper process backs the watchdog up (a stub thread blocked in a round trip to
the dead server can hold the interpreter lock forever): it kills a stub that outlives its
server by more than the cleanup time and removes what the stub owned.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.5
CLEANUP_SECONDS = 5.0


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <stub pid>` writes every thread's Python stack to the server log (a stuck
    stub, e.g. at shutdown, can then be diagnosed without a debugger); so does a crash
    (SIGSEGV, SIGABRT, ...) before the stub dies."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_with_server(model_name: str, cleanup: Callable[[], None] | None = None,
                     private_dirs: Sequence[str] = ()) -> None:
    server_pid = os.getppid()
    region = _own_shm_region()

    def watch() -> None:
        while os.getppid() == server_pid:
            time.sleep(POLL_SECONDS)
        logger.error("model %s: tritonserver (pid %d) is gone; stopping this stub", model_name,
                     server_pid)
        if cleanup is not None:
            worker = threading.Thread(target=cleanup, name="minisgl-cleanup", daemon=True)
            worker.start()
            worker.join(CLEANUP_SECONDS)
        _remove(region, private_dirs)
        os._exit(1)

    threading.Thread(target=watch, name="minisgl-server-watch", daemon=True).start()
    _start_reaper(server_pid, region, private_dirs)


def _start_reaper(server_pid: int, region: str | None, private_dirs: Sequence[str]) -> None:
    """The watch thread above needs this process's GIL, which a thread stuck in a round trip to
    a dead server may hold forever. A tiny separate process backs it up: if the stub outlives
    its server by more than the cleanup time, it kills the stub and removes what it owned."""
    subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, str(server_pid), str(os.getpid()),
         str(CLEANUP_SECONDS + 2 * POLL_SECONDS), region or "", *private_dirs],
        stdin=subprocess.DEVNULL, close_fds=True)


# Run by `_start_reaper` (standard library only, no site packages: starts in milliseconds).
_REAPER = """
import os, shutil, signal, sys, time
server, stub, grace, region, dirs = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                     sys.argv[4], sys.argv[5:])
def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in "ZX" else int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
while parent_of(stub) == server:
    time.sleep(0.5)
deadline = time.monotonic() + grace
while parent_of(stub) is not None and time.monotonic() < deadline:
    time.sleep(0.2)
if parent_of(stub) is not None:
    os.kill(stub, signal.SIGKILL)
if region:
    try:
        os.unlink("/dev/shm/" + region)
    except OSError:
        pass
for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
"""


def _own_shm_region() -> str | None:
    """The stub's command line names its region: `stub model.py <region> <size> ...`."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        region = args[2].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return region if region.startswith("triton_python_backend_shm") and "/" not in region \
        else None


def _remove(region: str | None, private_dirs: Sequence[str]) -> None:
    for folder in private_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    if region:
        try:
            os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass
