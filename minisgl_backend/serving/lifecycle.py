"""Leave nothing behind when tritonserver dies without unloading its models.

When tritonserver exits abruptly (a crash, SIGKILL, or its exit timeout running out with
requests in flight), a Python backend stub may be left waiting on a server that is gone. Each of
our models starts a watchdog: once the stub has been re-parented (its server is gone), it runs
the model's cleanup (bounded), removes the folders the cleanup would have removed (in case it
ran out of time) and the stub's shared-memory region, which nobody else will, and ends the
process.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.5
CLEANUP_SECONDS = 5.0


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <stub pid>` writes every thread's Python stack to the server log (a stuck
    stub, e.g. at shutdown, can then be diagnosed without a debugger)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_with_server(model_name: str, cleanup: Callable[[], None] | None = None,
                     private_dirs: Sequence[str] = ()) -> None:
    server_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == server_pid:
            time.sleep(POLL_SECONDS)
        logger.error("model %s: tritonserver (pid %d) is gone; stopping this stub", model_name,
                     server_pid)
        if cleanup is not None:
            worker = threading.Thread(target=cleanup, name="minisgl-cleanup", daemon=True)
            worker.start()
            worker.join(CLEANUP_SECONDS)
        for folder in private_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        _remove_own_shm_region()
        os._exit(1)

    threading.Thread(target=watch, name="minisgl-server-watch", daemon=True).start()


def _remove_own_shm_region() -> None:
    """The stub's command line names its region: `stub model.py <region> <size> ...`."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        region = args[2].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return
    if region and "/" not in region:
        try:
            os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass
