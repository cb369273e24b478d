"""Entry point of an engine process (one per tensor-parallel rank, started with spawn)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from minisgl_backend.engine import protocol
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.profiling import StepTrace, profiled

if TYPE_CHECKING:  # the engine (torch, models) is imported in the engine process only
    import torch

    from minisgl_backend.engine.engine import Engine, StepHandle


def run_engine_process(config: EngineConfig, rank: int, conn: Connection, init_file: str) -> None:
    """Serve step messages until SHUTDOWN or until the scheduler's end of the pipe closes.
    Every rank answers READY once loaded; only rank 0 answers steps (all ranks sample the same
    tokens). A failure is reported as ERROR before exiting."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # collectives stay on loopback
    _exit_with_parent(os.path.dirname(init_file))
    from minisgl_backend.distributed import destroy_process_group
    from minisgl_backend.engine.engine import Engine
    from minisgl_backend.engine.mask_buffer import MaskBuffer
    from minisgl_backend.models import weight_bytes
    from minisgl_backend.startup_heap import freeze_startup_heap

    try:
        engine = Engine(config, rank, init_file)
        conn.send_bytes(protocol.encode(protocol.READY, {
            "num_pages": np.asarray([engine.num_pages], dtype=np.int64),
            "max_seq_len": np.asarray([engine.max_seq_len], dtype=np.int64),
            "vocab_size": np.asarray([engine.model_config.vocab_size], dtype=np.int64),
            "long_rope_from": np.asarray([engine.model_config.rope.long_from], dtype=np.int64),
            "weight_bytes": np.asarray([weight_bytes(engine.model)], dtype=np.int64),
        }))
        # Before any step: the scheduler's guide mask buffer (its descriptor, then nothing else).
        engine.attach_masks(MaskBuffer.receive(conn, config, engine.model_config.vocab_size))
        freeze_startup_heap()  # collections between steps skip the model and the imports
        trace = StepTrace.from_env(f"engine-rank{rank}")  # MINISGL_TRACE_DIR
        try:
            with profiled(f"engine-rank{rank}"):
                _serve_steps(engine, conn, reply=rank == 0, trace=trace)
        finally:
            if trace is not None:
                trace.close()
        if engine.timeline is not None:
            engine.timeline.write(f"engine-rank{rank}", f"{config.model_dir}: page size "
                                  f"{config.page_size}, max_running_requests "
                                  f"{config.max_running_requests}, overlap {config.overlap}")
        exit_code = 0
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        exit_code = 0  # the scheduler went away: exit quietly
    except BaseException:
        _send_error(conn, f"engine rank {rank} failed:\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        destroy_process_group()
        conn.close()
    # Nothing is left to flush: skip the interpreter's teardown of torch (seconds), so that
    # shutdown, and with it a model's unload inside tritonserver, is quick.
    os._exit(exit_code)


class _Replier:
    """Sends each launched step's reply, in order, from a thread of its own as soon as its
    sampled ids are on the host: the scheduler gets step N's tokens while the device computes
    step N+1, not after its launch. Ranks other than 0 wait for their steps without replying."""

    def __init__(self, conn: Connection, reply: bool, device: torch.device) -> None:
        self._conn, self._reply, self._device = conn, reply, device
        self._queue: queue.SimpleQueue[StepHandle | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="minisgl-replier", daemon=True)
        self._thread.start()

    def submit(self, handle: StepHandle) -> None:
        self.check()
        self._queue.put(handle)

    def check(self) -> None:
        """Raise what stopped the thread (a pipe the scheduler closed, a failed copy)."""
        if self._error is not None:
            raise self._error

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the steps submitted so far (their replies sent)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._device.type == "cuda":
            import torch

            torch.cuda.set_device(self._device)  # this rank's device on this thread too
        while (handle := self._queue.get()) is not None:
            try:
                step_reply = handle.wait()
                if self._reply:
                    self._conn.send_bytes(step_reply.to_bytes())
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._error = exc
                if not isinstance(exc, (OSError, EOFError)):  # the scheduler is still there
                    _send_error(self._conn, f"a step's reply failed:\n{traceback.format_exc()}")
                return


def _send_error(conn: Connection, message: str) -> None:
    """Tell the scheduler why this rank stops (if it is still listening)."""
    try:
        conn.send_bytes(protocol.encode(protocol.ERROR, {
            "message": np.frombuffer(message.encode(), dtype=np.uint8)}))
    except OSError:
        pass


def _serve_steps(engine: Engine, conn: Connection, reply: bool,
                 trace: StepTrace | None = None) -> None:
    """Run steps in message order, each answered with its tokens (`_Replier`). A STEP with
    `masks_follow` runs its forward, then its sampling waits for the masks: on a GPU the device
    waits for the mask buffer's ready word (its MASKS message is then skipped); otherwise the
    host waits for the MASKS message, keeping the next STEP if it comes first."""
    replier = _Replier(conn, reply, engine.device)
    early: deque[bytes] = deque()  # STEPs that came while the host waited for MASKS
    try:
        while True:
            asked = time.perf_counter()
            kind, arrays = protocol.decode(early.popleft() if early else conn.recv_bytes())
            replier.check()
            if kind == protocol.SHUTDOWN:
                return
            if kind == protocol.MASKS:
                continue  # the masks of a step whose sampling the device held for them
            msg = protocol.StepMessage.from_arrays(arrays)
            if trace is not None:
                trace.step()
            started = engine.start(msg, waited=time.perf_counter() - asked)
            if msg.masks_follow and not engine.wait_for_masks_on_device(msg):
                _wait_for_masks(conn, msg, early)
            replier.submit(engine.finish(started))
    finally:
        engine.release_mask_waits()
        replier.close()


def _wait_for_masks(conn: Connection, msg: protocol.StepMessage, early: deque[bytes]) -> None:
    """Wait for the MASKS message of `msg` (earlier ones, of steps the device waited for, are
    skipped), keeping the STEPs that come before it in `early`."""
    wanted = int(msg.mask_seq[0]) if len(msg.mask_seq) else 0
    while True:
        data = conn.recv_bytes()
        kind, arrays = protocol.decode(data)
        if kind == protocol.SHUTDOWN:
            raise EOFError  # the scheduler stopped between a step and its masks
        if kind == protocol.STEP:
            early.append(data)
        elif kind != protocol.MASKS:
            raise RuntimeError(f"expected the MASKS of the step before, got message kind {kind}")
        elif int(arrays["mask_seq"][0]) >= wanted:
            return


def _exit_with_parent(private_dir: str) -> None:
    """Exit as soon as the process that spawned this one is gone (killed, crashed), so that an
    engine never outlives its scheduler, even mid-step; the private directory the scheduler
    would have removed goes too."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        shutil.rmtree(private_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="minisgl-parent-watch", daemon=True).start()
