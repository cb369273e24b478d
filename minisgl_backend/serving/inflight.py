"""The engine model's requests in flight, and what ends them early: the client cancelling, the
server stopping, the engine failing. Importable outside Triton's stub (the stub's calls are
made where needed)."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from minisgl_backend.scheduler.output import GenerationOutput, RequestOutput
from minisgl_backend.serving.request import EngineRequest
from minisgl_backend.serving.server_health import Readiness, model_ready, model_ready_url

if TYPE_CHECKING:
    from minisgl_backend.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.02
# Each is_cancelled() is a round trip to tritonserver: with many requests in flight, poll less
# often (at most every this many seconds per request in flight).
CANCEL_POLL_SECONDS_PER_REQUEST = 0.0005
READY_CHECK_SECONDS = 0.5


@dataclass(eq=False)
class ActiveRequest:
    """One Triton request in flight, owned by the response thread once submitted."""

    request: Any
    sender: Any
    parsed: EngineRequest
    arrived: float  # time.monotonic()
    arrived_ns: int  # time.time_ns()
    uid: int = -1
    cancelled: bool = False
    done: bool = False  # the final response was sent
    first_output: bool = True
    samples: dict[int, GenerationOutput] = field(default_factory=dict)

    @property
    def all_finished(self) -> bool:
        """Every sample has ended (the one ending now carries the FINAL flag)."""
        return sum(s.finished for s in self.samples.values()) == self.parsed.params.n

    def take_responses(self, deltas: list[RequestOutput]) -> list[GenerationOutput]:
        """What one sample's deltas, queued since the last round, send: streaming, the part
        they add (joined), else the whole sample once it ended. An error (`.error`) ends the
        request: streaming, the tokens before it go first."""
        sample = self.samples.setdefault(deltas[0].index, GenerationOutput())
        responses = []
        for delta in deltas:
            if delta.error is not None:
                if self.parsed.stream and sample.token_ids:
                    responses.append(sample.take())
                sample.add(delta)
                return [*responses, sample.take()]
            sample.add(delta)
        if sample.finished or (self.parsed.stream and sample.token_ids):
            responses.append(sample.take())
        return responses


class InFlight:
    """The requests submitted and not ended yet. The response thread ends them (`end`), and a
    request it ended before `execute`'s thread added it is not added."""

    def __init__(self, abort: Callable[[int], None]) -> None:
        self.abort = abort
        self._active: set[ActiveRequest] = set()
        self._lock = threading.Lock()
        self._last_poll = 0.0

    def __len__(self) -> int:
        return len(self._active)

    def add(self, state: ActiveRequest) -> None:
        with self._lock:
            if not state.done:
                self._active.add(state)

    def end(self, state: ActiveRequest) -> None:
        """The request's final response was sent."""
        with self._lock:
            state.done = True
            self._active.discard(state)

    def _cancel(self, states: list[ActiveRequest]) -> None:
        for state in states:
            if not state.cancelled:
                state.cancelled = True
                self.abort(state.uid)

    def poll_cancelled(self) -> None:
        """On the response thread (is_cancelled() must not race with a request's final
        response: Triton frees the request's response factory then): abort the requests their
        clients cancelled."""
        now = time.monotonic()
        if now - self._last_poll < max(CANCEL_POLL_SECONDS,
                                       CANCEL_POLL_SECONDS_PER_REQUEST * len(self)):
            return
        self._last_poll = now
        with self._lock:
            states = list(self._active)
        self._cancel([s for s in states if not s.cancelled and s.request.is_cancelled()])

    def cancel_all(self) -> None:
        with self._lock:
            states = list(self._active)
        self._cancel(states)


class ServerWatch:
    """A thread for the round trips to tritonserver that may block while it shuts down, so
    that they never hold up a final response: `tick` (the gauges) and the engine's failure
    every 20 ms, the server's readiness every 0.5 s while requests are in flight."""

    def __init__(self, name: str, scheduler: Scheduler, inflight: InFlight,
                 tick: Callable[[], None]) -> None:
        self.name, self.scheduler, self.inflight, self.tick = name, scheduler, inflight, tick
        self.ready_url = model_ready_url(os.getppid(), name)
        self.ready_url_answered = False  # a refusal counts only from an endpoint that answered
        self.failed = False  # the engine died; see _unload_self
        self.ending = False  # the server is stopping; see _check_server_ready
        self.stopping = threading.Event()
        threading.Thread(target=self._run, name="minisgl-server-poll", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        last_ready_check = 0.0
        while not self.stopping.wait(CANCEL_POLL_SECONDS):
            self.tick()
            if not self.failed and self.scheduler.failure is not None:
                self.failed = True
                threading.Thread(target=self._unload_self, args=(self.scheduler.failure,),
                                 name="minisgl-unload", daemon=True).start()
            now = time.monotonic()
            if len(self.inflight) and now - last_ready_check >= READY_CHECK_SECONDS:
                last_ready_check = now
                self._check_server_ready()

    def _check_server_ready(self) -> None:
        """Once tritonserver is stopping, end every request in flight: it waits for them (up
        to its exit timeout) and an ensemble's running step never sees a cancellation.
        Asked over the server's HTTP endpoint (see `server_health`: the stub's own query can
        crash it while the server stops); through the stub only where HTTP is off."""
        answer = model_ready(self.ready_url) if self.ready_url else Readiness.NO_ANSWER
        self.ready_url_answered |= answer == Readiness.READY
        if answer == Readiness.READY or answer == Readiness.NOT_READY:
            ready = answer == Readiness.READY
        elif answer == Readiness.REFUSED and self.ready_url_answered:
            ready = False  # the server closed the endpoint it answered on: it is stopping
        else:  # no usable answer (or a URL that never answered: a wrong guess of the port)
            import triton_python_backend_utils as pb_utils

            try:
                ready = pb_utils.is_model_ready(self.name)
            except Exception as exc:  # noqa: BLE001 - the server refuses it while exiting
                logger.warning("model %s: readiness query failed: %s", self.name, exc)
                ready = False
        if ready:
            return
        if not self.ending:
            logger.warning("model %s is no longer ready: ending %d requests in flight",
                           self.name, len(self.inflight))
            self.ending = True
        self.inflight.cancel_all()

    def _unload_self(self, reason: str) -> None:
        """The engine is gone: every request already failed with `reason` and later ones fail
        at once. Unload this model so that it reports not ready; a load through the model
        repository API (--model-control-mode=explicit) starts fresh engines."""
        import triton_python_backend_utils as pb_utils

        logger.error("model %s: the engine failed (%s); unloading the model", self.name, reason)
        try:
            pb_utils.unload_model(self.name)
        except Exception as exc:  # noqa: BLE001 - e.g. not in explicit model control mode
            logger.error("model %s cannot unload itself (%s): it stays loaded and fails every "
                         "request; restart tritonserver to serve again", self.name, exc)
