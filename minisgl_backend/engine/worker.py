"""Entry point of an engine process (one per tensor-parallel rank, started with spawn)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from minisgl_backend.engine import protocol
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.profiling import StepTrace, profiled

if TYPE_CHECKING:  # the engine (torch, models) is imported in the engine process only
    from minisgl_backend.engine.engine import Engine, StepHandle


def run_engine_process(config: EngineConfig, rank: int, conn: Connection, init_file: str) -> None:
    """Serve step messages until SHUTDOWN or until the scheduler's end of the pipe closes.

    Every rank answers READY once loaded (with the KV pool size); only rank 0 answers steps,
    since all ranks sample the same tokens. A failure is reported as ERROR before exiting.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # collectives stay on loopback
    _exit_with_parent(os.path.dirname(init_file))
    from minisgl_backend.distributed import destroy_process_group
    from minisgl_backend.engine.engine import Engine

    try:
        engine = Engine(config, rank, init_file)
        conn.send_bytes(protocol.encode(protocol.READY, {
            "num_pages": np.asarray([engine.num_pages], dtype=np.int64),
            "max_seq_len": np.asarray([engine.max_seq_len], dtype=np.int64),
            "vocab_size": np.asarray([engine.model_config.vocab_size], dtype=np.int64),
            "long_rope_from": np.asarray([engine.model_config.rope.long_from], dtype=np.int64),
        }))
        trace = StepTrace.from_env(f"engine-rank{rank}")  # MINISGL_TRACE_DIR
        try:
            with profiled(f"engine-rank{rank}"):
                _serve_steps(engine, conn, reply=rank == 0, overlap=config.overlap,
                             trace=trace)
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
        message = f"engine rank {rank} failed:\n{traceback.format_exc()}"
        try:
            conn.send_bytes(protocol.encode(protocol.ERROR, {
                "message": np.frombuffer(message.encode(), dtype=np.uint8)}))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        destroy_process_group()
        conn.close()
    # Nothing is left to flush: skip the interpreter's teardown of torch (seconds), so that
    # shutdown, and with it a model's unload inside tritonserver, is quick.
    os._exit(exit_code)


def _serve_steps(engine: Engine, conn: Connection, reply: bool, overlap: bool,
                 trace: StepTrace | None = None) -> None:
    """Run steps in message order. Without overlap each STEP is answered with its own tokens.
    With overlap a STEP is launched first and then answered with the previous step's tokens,
    so the device computes step N while the scheduler handles step N-1's tokens (on CPU, where
    a step has run when `Engine.finish` returns, step N-1 is answered before step N runs).
    A STEP with `masks_follow` runs its forward, answers the step before (its tokens are what
    the scheduler needs for the masks), then waits for the MASKS message (the masks are in
    the mask buffer) to sample."""
    pending: StepHandle | None = None

    def answer(handle: StepHandle | None) -> None:
        if handle is None:
            return
        step_reply = handle.wait()  # every rank waits, so none runs ahead of its steps
        if reply:
            conn.send_bytes(step_reply.to_bytes())

    while True:
        asked = time.perf_counter()
        kind, arrays = protocol.decode(conn.recv_bytes())
        if kind == protocol.SHUTDOWN:
            return
        if kind == protocol.FLUSH:
            answer(pending)
            pending = None
            continue
        msg = protocol.StepMessage.from_arrays(arrays)
        if trace is not None:
            trace.step()
        if pending is not None and pending.ready:
            answer(pending)
            pending = None
        started = engine.start(msg, waited=time.perf_counter() - asked)
        if msg.masks_follow:
            answer(pending)
            pending = None
            _wait_for_masks(conn)
        handle = engine.finish(started)
        if not overlap:
            answer(handle)
            continue
        answer(pending)
        pending = handle


def _wait_for_masks(conn: Connection) -> None:
    kind, _ = protocol.decode(conn.recv_bytes())
    if kind == protocol.SHUTDOWN:
        raise EOFError  # the scheduler stopped between a step and its masks
    if kind != protocol.MASKS:
        raise RuntimeError(f"expected the MASKS of the step before, got message kind {kind}")


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
