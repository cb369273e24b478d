"""The scheduler's handle on the engine processes: spawn, send steps, receive tokens, stop.

Channels are anonymous pipes (socket pairs), so nothing listens on any address. Every wait also
watches the processes' sentinels, so a dead engine turns into an `EngineDeadError` instead of a
hang.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
from multiprocessing.connection import Connection, wait
from pathlib import Path

from minisgl_backend.engine import protocol
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.mask_buffer import MaskBuffer
from minisgl_backend.engine.worker import run_engine_process


class EngineDeadError(RuntimeError):
    """An engine process exited or failed; the engine cannot serve any more requests."""


class EngineClient:
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        self.config = config
        self._tmpdir = tempfile.mkdtemp(prefix="minisgl-")  # private (mode 0700)
        init_file = str(Path(self._tmpdir) / "tp-store")
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._dead: str | None = None
        try:
            for rank in range(config.tp_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=run_engine_process, name=f"minisgl-engine-{rank}",
                                   args=(config, rank, child, init_file), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            ready = [self._receive(conn, protocol.READY, startup_timeout) for conn in self._conns]
            # Where the scheduler writes the guided rows' token masks for the ranks to read:
            # every rank gets the shared memory's descriptor before any step.
            self.masks = MaskBuffer.of_engine(config, int(ready[0]["vocab_size"][0]))
            for conn, proc in zip(self._conns, self._procs):
                self.masks.share(conn, proc.pid)  # type: ignore[arg-type]
        except BaseException:
            self.shutdown()
            raise
        self.num_pages = int(ready[0]["num_pages"][0])
        self.max_seq_len = int(ready[0]["max_seq_len"][0])
        # LongRoPE's pretraining length (0: the model has no LongRoPE).
        self.long_rope_from = int(ready[0]["long_rope_from"][0])
        self.weight_bytes = sum(int(r["weight_bytes"][0]) for r in ready)  # over every rank

    @property
    def private_dir(self) -> str:
        """The folder (mode 0700) of the ranks' rendezvous file; removed on shutdown."""
        return self._tmpdir

    @property
    def alive(self) -> bool:
        return self._dead is None and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def send(self, message: bytes) -> None:
        """Send one message to every rank."""
        self._check_alive()
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError as exc:
            self._fail(f"cannot reach the engine process: {exc}")

    def receive_step(self, timeout: float | None = None) -> protocol.StepReply:
        """What the oldest step not yet received sampled (from rank 0)."""
        return protocol.StepReply.from_arrays(
            self._receive(self._conns[0], protocol.TOKENS, timeout))

    def _receive(self, conn: Connection, expected: int, timeout: float | None) -> dict:
        self._check_alive()
        sentinels = [p.sentinel for p in self._procs]
        if not wait([conn, *sentinels], timeout):
            self._fail(f"the engine did not answer within {timeout} s")
        if not conn.poll():  # a process died without answering: did any rank report why?
            self._fail(self._error_from_any_rank() or self._death_message())
        try:
            kind, arrays = protocol.decode(conn.recv_bytes())
        except (EOFError, OSError):
            self._fail(self._error_from_any_rank() or self._death_message())
        if kind == protocol.ERROR:
            self._fail(_error_text(arrays))
        if kind != expected:
            self._fail(f"unexpected message kind {kind} from the engine (expected {expected})")
        return arrays

    def _error_from_any_rank(self) -> str | None:
        for conn in self._conns:
            try:
                while conn.poll():
                    kind, arrays = protocol.decode(conn.recv_bytes())
                    if kind == protocol.ERROR:
                        return _error_text(arrays)
            except (EOFError, OSError):
                continue
        return None

    def _death_message(self) -> str:
        codes = [f"rank {i}: exit code {p.exitcode}" for i, p in enumerate(self._procs)
                 if not p.is_alive()]
        return "an engine process died (" + (", ".join(codes) or "connection lost") + ")"

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not all(p.is_alive() for p in self._procs):
            self._fail(self._death_message())

    def _fail(self, reason: str) -> None:
        self._dead = reason
        self._terminate()
        raise EngineDeadError(reason)

    def _terminate(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every rank to exit, then make sure they have; remove the private directory."""
        if self._dead is None:
            for conn in self._conns:
                try:
                    conn.send_bytes(protocol.encode(protocol.SHUTDOWN, {}))
                except OSError:
                    pass
            for proc in self._procs:
                proc.join(timeout=timeout)
            self._dead = "the engine was shut down"
        self._terminate()
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _error_text(arrays: dict) -> str:
    return arrays["message"].tobytes().decode(errors="replace")
