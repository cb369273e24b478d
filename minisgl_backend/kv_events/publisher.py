"""The publisher: ZeroMQ sockets and the thread that feeds them.

The prefix cache reports to it on the scheduler thread (`CacheEvents`); a report only goes on a
queue there. The publisher thread takes what is queued, turns it into events (`BlockLedger`),
sends them as one message and keeps the message in a bounded buffer for the replay socket,
which it answers between messages.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from minisgl_backend.kv_events.ledger import BlockLedger
from minisgl_backend.kv_events.wire import END_SEQ, KvEvent, encode_batch, frames

logger = logging.getLogger(__name__)

REPLAY_BUFFER_MESSAGES = 10_000  # messages a subscriber can still ask the replay socket for
REPLAY_POLL_S = 0.05  # how long a replay request may wait while no event comes
SEND_HWM = 100_000  # messages ZeroMQ queues per subscriber before dropping for it

_STORED, _REMOVED, _CLEARED = range(3)


def binds(endpoint: str) -> bool:
    """vLLM's rule: an endpoint with a wildcard host, or a local transport, is bound (routers
    connect to it); any other is connected to (a router whose subscriber binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Publishes the prefix cache's events on `endpoint` (bound or connected: `binds`), answers
    replay requests on `replay_endpoint` (bound; None: no replay socket)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 ledger: BlockLedger) -> None:
        self._context = zmq.Context.instance()
        self._pub = self._open(zmq.PUB, endpoint, "kv_events_endpoint", binds(endpoint))
        self._pub.set_hwm(SEND_HWM)
        self._replay = None
        if replay_endpoint:
            try:
                self._replay = self._open(zmq.ROUTER, replay_endpoint,
                                          "kv_events_replay_endpoint", bind=True)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._topic = topic.encode()
        self._handlers: dict[int, Callable[..., KvEvent]] = {
            _STORED: ledger.stored, _REMOVED: ledger.removed, _CLEARED: ledger.cleared}
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_MESSAGES)
        self._next_seq = 0
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="minisgl-kv-events", daemon=True)
        self._thread.start()

    def _open(self, kind: int, endpoint: str, setting: str, bind: bool) -> Any:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as exc:  # address in use, bad address
            socket.close(linger=0)
            verb = "bind" if bind else "connect to"
            raise ValueError(f"{setting}: cannot {verb} {endpoint!r}: {exc}") from None
        return socket

    # ----- the prefix cache's reports (scheduler thread) ---------------------------------

    def stored(self, parent_page: int | None, key: list[int], pages: list[int]) -> None:
        self._queue.put((_STORED, parent_page, key, pages))

    def removed(self, pages: list[int]) -> None:
        self._queue.put((_REMOVED, pages))

    def cleared(self) -> None:
        self._queue.put((_CLEARED,))

    def shutdown(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._queue.put(None)
        self._thread.join()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ----- publisher thread --------------------------------------------------------------

    def _run(self) -> None:
        timeout = REPLAY_POLL_S if self._replay is not None else None
        while True:
            try:
                reports = [self._queue.get(timeout=timeout)]
            except queue.Empty:
                reports = []
            while not self._queue.empty():
                reports.append(self._queue.get_nowait())
            stop = None in reports
            try:
                self._publish([self._event(r) for r in reports if r is not None])
                if self._replay is not None:
                    self._answer_replays()
            except Exception:  # a subscriber's trouble must not stop the events
                logger.exception("publishing KV-cache events failed")
            if stop:
                return

    def _event(self, report: tuple[Any, ...]) -> KvEvent:
        kind, *args = report
        return self._handlers[kind](*args)

    def _publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._pub.send_multipart(frames(self._topic, seq, payload))
        self._buffer.append((seq, payload))

    def _answer_replays(self) -> None:
        """Answer every waiting replay request: the buffered messages from its sequence
        number on, then the end marker."""
        assert self._replay is not None
        while self._replay.poll(0):
            request = self._replay.recv_multipart()
            if len(request) < 2 or len(request[-1]) != 8:
                logger.warning("ignoring a malformed KV-events replay request")
                continue
            route = request[:-1]  # the client's identity and, from a REQ socket, b""
            start = int.from_bytes(request[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([*route, seq.to_bytes(8, "big"), payload],
                                                flags=zmq.NOBLOCK)
            self._replay.send_multipart([*route, END_SEQ, b""], flags=zmq.NOBLOCK)
