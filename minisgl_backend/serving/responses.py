"""The engine model's responses. The scheduler thread queues each delta (`Responder.put`); one
response thread owns every `send`: a sample's new text and tokens while streaming (the deltas
queued meanwhile joined), its whole output otherwise, and exactly one FINAL per request, with
its last sample's end or its first error. Between rounds it polls for cancelled requests."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from minisgl_backend.scheduler.output import GenerationOutput, RequestOutput
from minisgl_backend.serving.inflight import CANCEL_POLL_SECONDS, ActiveRequest, InFlight
from minisgl_backend.serving.interface import PERF_METRICS
from minisgl_backend.serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)
MAX_OUTPUTS_PER_ROUND = 4096
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PERF_DTYPES = {name: pb_utils.triton_string_to_numpy(data_type)
               for name, data_type, _ in PERF_METRICS}


def error_response(message: str, *code: Any) -> Any:
    """A response that ends its request with an error (`code`: a `TritonError` code)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, *code))


class Responder:
    """The response thread (see the module's docstring); it ends with `stop`."""

    def __init__(self, tokenizer: Any, inflight: InFlight, metrics: EngineMetrics) -> None:
        self.tokenizer, self.inflight, self.metrics = tokenizer, inflight, metrics
        self.outputs: queue.SimpleQueue[tuple[ActiveRequest, RequestOutput] | None] = \
            queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="minisgl-responses", daemon=True)
        self.thread.start()

    def put(self, state: ActiveRequest, out: RequestOutput) -> None:
        """Queue a request's delta (on the scheduler thread)."""
        self.outputs.put((state, out))

    def stop(self) -> None:
        """Send what is queued, then end the thread."""
        self.outputs.put(None)
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            items, stopping = self._next_round()
            # Metrics first, in one flush per round: a client that reads /metrics after its
            # final response sees its request counted.
            for state, out in items:
                self.metrics.record_output(out, state.first_output, state.arrived)
                state.first_output = False
            try:
                self.metrics.flush()
            except Exception:  # metrics must never hold up a response
                logger.exception("updating the metrics failed")
            samples: dict[tuple[int, int], tuple[ActiveRequest, list[RequestOutput]]] = {}
            for state, out in items:  # each sample's deltas, in order
                samples.setdefault((id(state), out.index), (state, []))[1].append(out)
            for state, deltas in samples.values():
                if not state.done:  # else an error ended it (its other samples' ends follow)
                    for output in state.take_responses(deltas):
                        self._send(state, output)
            if stopping:
                return
            self.inflight.poll_cancelled()

    def _next_round(self) -> tuple[list[tuple[ActiveRequest, RequestOutput]], bool]:
        """The deltas queued now (waiting up to a poll interval for one), and whether `stop`'s
        marker came. A request's deltas that piled up while responses were being sent go out
        as one response: under load fewer, larger responses keep the stream up with the
        engine."""
        items: list = []
        try:
            items.append(self.outputs.get(timeout=CANCEL_POLL_SECONDS))
            while len(items) < MAX_OUTPUTS_PER_ROUND and items[-1] is not None:
                items.append(self.outputs.get_nowait())
        except queue.Empty:
            pass
        if items and items[-1] is None:
            return items[:-1], True
        return items, False

    def _send(self, state: ActiveRequest, output: GenerationOutput) -> None:
        """One response; FINAL with an error or with the end of the request's last sample."""
        final = output.error is not None or (output.finished and state.all_finished)
        try:
            state.sender.send(self._response(state, output), flags=FINAL if final else 0)
        except Exception:  # a client gone away must not stop the thread
            logger.exception("sending a response failed")
            if not final:
                self.inflight.abort(state.uid)
        if final:
            self.inflight.end(state)

    def _response(self, state: ActiveRequest, output: GenerationOutput) -> Any:
        if output.error is not None:
            if output.finish_reason == "abort" and state.cancelled:
                return error_response("request cancelled", pb_utils.TritonError.CANCELLED)
            return error_response(output.error)
        parsed, text, token_ids = state.parsed, output.text, output.token_ids
        if not (parsed.stream or parsed.exclude_input):
            text = self.tokenizer.decode(parsed.prompt_ids, skip_special_tokens=True) + text
        tensors = [
            # [1], as TensorRT-LLM's postprocessing sends it: clients read text_output[0] as
            # bytes (LlamaIndex, TensorRT-LLM's client)
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.asarray([token_ids], dtype=np.int32)),
        ]
        if parsed.return_num_input_tokens:
            tensors.append(_int_tensor("num_input_tokens", output.prompt_tokens))
        if parsed.return_num_output_tokens:  # this response's tokens, as TensorRT-LLM counts
            tensors.append(_int_tensor("num_output_tokens", len(token_ids)))
        if parsed.return_cached_tokens:
            tensors.append(_int_tensor("cached_tokens", output.cached_tokens))
        if parsed.return_finish_reason and output.finished:
            tensors.append(pb_utils.Tensor(
                "finish_reason", np.array([[(output.finish_reason or "").encode()]],
                                          dtype=np.object_)))
        if parsed.params.n > 1:
            tensors.append(_int_tensor("sequence_index", output.index))
            tensors.append(_int_tensor("batch_index", 0))
        if parsed.return_log_probs:
            tensors.append(pb_utils.Tensor("output_log_probs",
                                           np.asarray([[output.logprobs or []]], np.float32)))
            tensors.append(pb_utils.Tensor("cum_log_probs", np.asarray(
                [[output.cumulative_logprob or 0.0]], dtype=np.float32)))
        if parsed.return_log_probs and parsed.params.logprobs:
            ids, values = top_log_prob_arrays(output.top_logprobs or [], parsed.params.logprobs)
            tensors.append(pb_utils.Tensor("output_top_log_prob_ids", ids))
            tensors.append(pb_utils.Tensor("output_top_log_probs", values))
        if output.context_logits is not None:  # [1, prompt tokens, vocab]
            tensors.append(pb_utils.Tensor("context_logits", output.context_logits[None]))
        generation_logits = output.generation_logits
        if generation_logits is not None:  # [1, beam 1, tokens, vocab]
            tensors.append(pb_utils.Tensor("generation_logits", generation_logits[None, None]))
        if parsed.return_perf_metrics:
            tensors += [pb_utils.Tensor(name, np.asarray([[value]], dtype=PERF_DTYPES[name]))
                        for name, value in perf_metrics(state.arrived_ns, output).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def perf_metrics(arrived_ns: int, output: GenerationOutput) -> dict[str, float]:
    """The `return_perf_metrics` outputs of a sample's response, by name (draft tokens: the
    sample's so far)."""
    return {
        "kv_cache_alloc_new_blocks": output.pages - output.reused_pages,
        "kv_cache_reused_blocks": output.reused_pages,
        "kv_cache_alloc_total_blocks": output.pages,
        "arrival_time_ns": arrived_ns,
        "first_scheduled_time_ns": output.admitted_ns,
        "first_token_time_ns": output.first_token_ns,
        "last_token_time_ns": output.last_token_ns,
        "acceptance_rate": (output.accepted_draft_tokens / output.draft_tokens
                            if output.draft_tokens else 0.0),
        "total_accepted_draft_tokens": output.accepted_draft_tokens,
        "total_draft_tokens": output.draft_tokens,
    }


def top_log_prob_arrays(top: list[dict[int, float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's `k` most likely alternatives as ids [1, tokens, k] (int32) and their
    log-probabilities (float32), most likely first."""
    ids = np.zeros((1, len(top), k), dtype=np.int32)
    values = np.full((1, len(top), k), -np.inf, dtype=np.float32)
    for row, alternatives in enumerate(top):
        ranked = sorted(alternatives.items(), key=lambda item: -item[1])[:k]
        ids[0, row, :len(ranked)] = [token for token, _ in ranked]
        values[0, row, :len(ranked)] = [value for _, value in ranked]
    return ids, values


def _int_tensor(name: str, value: int) -> Any:
    return pb_utils.Tensor(name, np.asarray([[value]], dtype=np.int32))
