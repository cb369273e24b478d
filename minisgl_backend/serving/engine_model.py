"""Triton `minisgl` model: the decoupled engine model.

`execute` validates each request, hands it to the scheduler thread and returns at once. The
scheduler's outputs go through a queue to one response thread, which owns every `send`: text
deltas while streaming, one whole response otherwise, exactly one FINAL per request. The same
thread polls for cancelled requests and aborts them in the engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from minisgl_backend.llm import LLM
from minisgl_backend.scheduler import RequestOutput
from minisgl_backend.scheduler.output import merge_deltas
from minisgl_backend.serving.interface import PERF_METRICS
from minisgl_backend.serving.lifecycle import dump_stacks_on_sigusr1, exit_with_server
from minisgl_backend.serving.metrics import EngineMetrics
from minisgl_backend.serving.request import EngineRequest, RequestError, parse_engine_request
from minisgl_backend.serving.server_health import Readiness, model_ready, model_ready_url
from minisgl_backend.serving.settings import (
    engine_settings,
    load_model_config,
    model_parameters,
    request_policy,
    resolve_model_dir,
)
from minisgl_backend.serving.tensors import input_getter

logger = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.02
# Each is_cancelled() is a round trip to tritonserver: with many requests in flight, poll less
# often (about 0.5 ms of polling per request and per poll at most every this many seconds).
CANCEL_POLL_SECONDS_PER_REQUEST = 0.0005
MAX_OUTPUTS_PER_ROUND = 4096
READY_CHECK_SECONDS = 0.5
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PERF_DTYPES = {name: pb_utils.triton_string_to_numpy(data_type)
               for name, data_type, _ in PERF_METRICS}


@dataclass
class SequenceState:
    """One of a request's `num_return_sequences` sequences, as sent so far."""

    text: list[str] = field(default_factory=list)  # non-streaming: accumulated text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False
    first_token_ns: int = 0  # when its first and latest tokens were made (time.time_ns())
    last_token_ns: int = 0
    context_logits: np.ndarray | None = None  # non-streaming: kept for the one response
    generation_logits: list[np.ndarray] = field(default_factory=list)


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
    sequences: dict[int, SequenceState] = field(default_factory=dict)

    def sequence(self, index: int) -> SequenceState:
        return self.sequences.setdefault(index, SequenceState())

    @property
    def all_finished(self) -> bool:
        """Every sequence has ended (the one ending now carries the FINAL flag)."""
        done = [s for s in self.sequences.values() if s.finished]
        return len(done) == self.parsed.params.n


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        dump_stacks_on_sigusr1()
        config = load_model_config(args)
        parameters = model_parameters(config)
        model_dir = resolve_model_dir(parameters, args["model_repository"])
        self.llm = LLM(model_dir, **engine_settings(parameters))
        self.limits = request_policy(parameters)
        self.scheduler = self.llm.scheduler
        self.name = config["name"]
        self.ready_url = model_ready_url(os.getppid(), self.name)
        self.ready_url_answered = False  # a refusal counts only from an endpoint that answered
        self.failed = False  # the engine died; see _on_engine_failure
        self.ending = False  # the server is stopping; see _check_server_ready
        self.metrics = EngineMetrics(self.name)
        self.outputs: queue.SimpleQueue[tuple[ActiveRequest, RequestOutput] | None] = \
            queue.SimpleQueue()
        self.active: dict[int, ActiveRequest] = {}  # uid -> request not ended yet
        self.active_lock = threading.Lock()
        self.submitted: queue.SimpleQueue[ActiveRequest] = queue.SimpleQueue()
        self.stopping = threading.Event()
        # Two threads: one sends responses (and polls cancellations, which must not race with
        # them); the other makes the round trips to the server that may block while it shuts
        # down (readiness, gauges), so that those never hold up a final response.
        self.thread = threading.Thread(target=self._respond_loop, name="minisgl-responses",
                                       daemon=True)
        self.thread.start()
        threading.Thread(target=self._poll_loop, name="minisgl-server-poll", daemon=True).start()
        exit_with_server(self.name, lambda: self.scheduler.engine.shutdown(timeout=1.0),
                         private_dirs=[self.scheduler.engine.private_dir])

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request: Any) -> None:
        sender = request.get_response_sender()

        arrived, arrived_ns = time.monotonic(), time.time_ns()
        try:
            parsed = parse_engine_request(input_getter(request), self.scheduler.max_request_tokens,
                                          self.llm.tokenizer, self.limits, self.llm.vocab_size,
                                          request.parameters())
            try:  # a guide that does not compile, a prompt too long for the engine, ...
                checked = self.scheduler.check_request(parsed.prompt_ids, parsed.params)
            except ValueError as exc:
                raise RequestError(parsed.name_inputs(str(exc))) from None
        except (RequestError, ValueError) as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                        flags=FINAL)
            return
        except Exception as exc:  # noqa: BLE001 - whatever fails, the request gets its final
            logger.exception("reading a request failed")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"the request could not be read: {type(exc).__name__}: {exc}")), flags=FINAL)
            return
        state = ActiveRequest(request, sender, parsed, arrived, arrived_ns)
        state.uid = self.scheduler.submit(parsed.prompt_ids, parsed.params,
                                          lambda out: self.outputs.put((state, out)), checked,
                                          stream=parsed.stream)
        self.submitted.put(state)

    # ----- response thread ------------------------------------------------------------------

    def _respond_loop(self) -> None:
        """Responses, and cancellations: is_cancelled() must not race with a request's final
        response (Triton frees the request's response factory then), so both happen here."""
        last_poll = 0.0
        while True:
            try:
                items = [self.outputs.get(timeout=CANCEL_POLL_SECONDS)]
            except queue.Empty:
                items = []
            stopping = self._drain_outputs(items)
            self._take_submitted()
            responses = [(state, out) for state, deltas in _group_by_request(items)
                         for out in merge_deltas(deltas)]
            # Metrics first, in one flush per round: a client that reads /metrics after its
            # final response sees its request counted.
            for state, out in responses:
                self.metrics.record_output(out, state.first_output, state.arrived)
                state.first_output = False
            try:
                self.metrics.flush()
            except Exception:  # metrics must never hold up a response
                logger.exception("updating the metrics failed")
            for state, out in responses:
                self._respond(state, out)
            if stopping:
                break
            # Each is_cancelled() is a round trip: with many requests in flight, poll less often.
            now = time.monotonic()
            if now - last_poll >= max(CANCEL_POLL_SECONDS,
                                      CANCEL_POLL_SECONDS_PER_REQUEST * len(self.active)):
                last_poll = now
                self._poll_cancelled()

    def _poll_loop(self) -> None:
        """Engine failure and gauges every 20 ms, the server's readiness every 0.5 s."""
        last_ready_check = 0.0
        while not self.stopping.wait(CANCEL_POLL_SECONDS):
            self.metrics.update_gauges(self.scheduler.stats)
            if not self.failed and self.scheduler.failure is not None:
                self._on_engine_failure(self.scheduler.failure)
            now = time.monotonic()
            if self.active and now - last_ready_check >= READY_CHECK_SECONDS:
                last_ready_check = now
                self._check_server_ready()

    def _active_requests(self) -> list[ActiveRequest]:
        with self.active_lock:
            return list(self.active.values())

    def _drain_outputs(self, items: list) -> bool:
        """Append every output already queued (a request's deltas that piled up while responses
        were being sent go out as one response: under load fewer, larger responses keep the
        stream up with the engine). True when the end-of-outputs marker was seen."""
        while len(items) < MAX_OUTPUTS_PER_ROUND and (not items or items[-1] is not None):
            try:
                items.append(self.outputs.get_nowait())
            except queue.Empty:
                break
        if items and items[-1] is None:
            items.pop()
            return True
        return False

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
            try:
                ready = pb_utils.is_model_ready(self.name)
            except Exception as exc:  # noqa: BLE001 - the server refuses it while exiting
                logger.warning("model %s: readiness query failed: %s", self.name, exc)
                ready = False
        if ready:
            return
        if not self.ending:
            logger.warning("model %s is no longer ready: ending %d requests in flight",
                           self.name, len(self.active))
            self.ending = True
        for state in self._active_requests():
            if not state.cancelled:
                state.cancelled = True
                self.scheduler.abort(state.uid)

    def _on_engine_failure(self, reason: str) -> None:
        """The engine is gone: every request already failed with `reason` and later ones fail
        at once. Unload this model so that it reports not ready; a load through the model
        repository API (--model-control-mode=explicit) starts fresh engines."""
        self.failed = True
        logger.error("model %s: the engine failed (%s); unloading the model", self.name, reason)
        threading.Thread(target=self._unload_self, name="minisgl-unload", daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.name)
        except Exception as exc:  # noqa: BLE001 - e.g. not in explicit model control mode
            logger.error("model %s cannot unload itself (%s): it stays loaded and fails every "
                         "request; restart tritonserver to serve again", self.name, exc)

    def _take_submitted(self) -> None:
        while True:
            try:
                state = self.submitted.get_nowait()
            except queue.Empty:
                return
            if not state.done:  # it may have finished before it was registered
                with self.active_lock:
                    self.active[state.uid] = state

    def _poll_cancelled(self) -> None:
        for state in self._active_requests():
            if not state.cancelled and state.request.is_cancelled():
                state.cancelled = True
                self.scheduler.abort(state.uid)

    def _respond(self, state: ActiveRequest, out: RequestOutput) -> None:
        if state.done:
            return  # an error already ended the request (its other sequences' ends follow)
        seq = state.sequence(out.index)
        seq.finished = out.finished
        final = out.error is not None or (out.finished and state.all_finished)
        try:
            if out.error is not None:
                self._send_error(state, out)
            elif state.parsed.stream:
                if out.token_ids or out.finished:
                    self._add_tokens(seq, out)
                    state.sender.send(self._response(state, out, out.text, out.token_ids,
                                                     out.logprobs or [], out.context_logits,
                                                     out.generation_logits),
                                      flags=FINAL if final else 0)
            else:
                seq.text.append(out.text)
                self._add_tokens(seq, out)
                if out.context_logits is not None:
                    seq.context_logits = out.context_logits
                if out.generation_logits is not None:
                    seq.generation_logits.append(out.generation_logits)
                if out.finished:
                    text = "".join(seq.text)
                    if not state.parsed.exclude_input:
                        text = self.llm.tokenizer.decode(state.parsed.prompt_ids,
                                                         skip_special_tokens=True) + text
                    generation = (np.concatenate(seq.generation_logits)
                                  if seq.generation_logits else None)
                    state.sender.send(self._response(state, out, text, seq.token_ids,
                                                     seq.logprobs, seq.context_logits,
                                                     generation),
                                      flags=FINAL if final else 0)
        except Exception:  # a client gone away must not stop the thread
            logger.exception("sending a response failed")
            if not final:
                self.scheduler.abort(state.uid)
        if final:
            state.done = True
            with self.active_lock:
                self.active.pop(state.uid, None)

    @staticmethod
    def _add_tokens(seq: SequenceState, out: RequestOutput) -> None:
        if out.token_ids:
            seq.first_token_ns = seq.first_token_ns or out.first_token_ns or out.emitted_ns
            seq.last_token_ns = out.emitted_ns
        seq.token_ids.extend(out.token_ids)
        if out.logprobs:
            seq.logprobs.extend(out.logprobs)
            seq.cum_logprob += sum(out.logprobs)

    def _send_error(self, state: ActiveRequest, out: RequestOutput) -> None:
        if out.finish_reason == "abort" and state.cancelled:
            error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
        else:
            error = pb_utils.TritonError(out.error)
        state.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def _response(self, state: ActiveRequest, out: RequestOutput, text: str,
                  token_ids: list[int], logprobs: list[float],
                  context_logits: np.ndarray | None = None,
                  generation_logits: np.ndarray | None = None) -> Any:
        parsed = state.parsed
        seq = state.sequence(out.index)
        tensors = [
            # [1], as TensorRT-LLM's postprocessing sends it: clients read text_output[0] as
            # bytes (LlamaIndex, TensorRT-LLM's client)
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.asarray([token_ids], dtype=np.int32)),
        ]
        if parsed.return_num_input_tokens:
            tensors.append(_int_tensor("num_input_tokens", out.prompt_tokens))
        if parsed.return_num_output_tokens:  # this response's tokens, as TensorRT-LLM counts
            tensors.append(_int_tensor("num_output_tokens", len(token_ids)))
        if parsed.return_cached_tokens:
            tensors.append(_int_tensor("cached_tokens", out.cached_tokens))
        if parsed.return_finish_reason and out.finished:
            tensors.append(pb_utils.Tensor(
                "finish_reason", np.array([[(out.finish_reason or "").encode()]],
                                          dtype=np.object_)))
        if parsed.params.n > 1:
            tensors.append(_int_tensor("sequence_index", out.index))
            tensors.append(_int_tensor("batch_index", 0))
        if parsed.return_log_probs:
            tensors.append(pb_utils.Tensor("output_log_probs",
                                           np.asarray([[logprobs]], dtype=np.float32)))
            tensors.append(pb_utils.Tensor("cum_log_probs",
                                           np.asarray([[seq.cum_logprob]], dtype=np.float32)))
        if context_logits is not None:  # [1, prompt tokens, vocab]
            tensors.append(pb_utils.Tensor("context_logits", context_logits[None]))
        if generation_logits is not None:  # [1, beam 1, tokens, vocab]
            tensors.append(pb_utils.Tensor("generation_logits", generation_logits[None, None]))
        if parsed.return_perf_metrics:
            tensors += [pb_utils.Tensor(name, np.asarray([[value]], dtype=PERF_DTYPES[name]))
                        for name, value in perf_metrics(state.arrived_ns, seq, out).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        self.stopping.set()
        self.llm.shutdown()  # ends every request still running with an "abort" output
        self.outputs.put(None)
        self.thread.join(timeout=10)


def _group_by_request(items: list[tuple[ActiveRequest, RequestOutput]]
                      ) -> list[tuple[ActiveRequest, list[RequestOutput]]]:
    """Outputs grouped per sequence of a request, in order (by their first output)."""
    groups: dict[tuple[int, int], tuple[ActiveRequest, list[RequestOutput]]] = {}
    for state, out in items:
        groups.setdefault((id(state), out.index), (state, []))[1].append(out)
    return list(groups.values())


def perf_metrics(arrived_ns: int, seq: SequenceState, out: RequestOutput) -> dict[str, float]:
    """The `return_perf_metrics` outputs of a sequence's response, by name (draft tokens:
    the request's so far)."""
    return {
        "kv_cache_alloc_new_blocks": out.pages - out.reused_pages,
        "kv_cache_reused_blocks": out.reused_pages,
        "kv_cache_alloc_total_blocks": out.pages,
        "arrival_time_ns": arrived_ns,
        "first_scheduled_time_ns": out.admitted_ns,
        "first_token_time_ns": seq.first_token_ns,
        "last_token_time_ns": seq.last_token_ns,
        "acceptance_rate": (out.accepted_draft_tokens / out.draft_tokens
                            if out.draft_tokens else 0.0),
        "total_accepted_draft_tokens": out.accepted_draft_tokens,
        "total_draft_tokens": out.draft_tokens,
    }


def _int_tensor(name: str, value: int) -> Any:
    return pb_utils.Tensor(name, np.asarray([[value]], dtype=np.int32))
