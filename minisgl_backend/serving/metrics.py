"""Custom metrics on Triton's /metrics endpoint (`pb_utils.MetricFamily`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import triton_python_backend_utils as pb_utils

from minisgl_backend.llm import LoadedModel
from minisgl_backend.scheduler import RequestOutput
from minisgl_backend.scheduler.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def _family(name: str, description: str, kind: Any) -> Any:
    return pb_utils.MetricFamily(name=name, description=description, kind=kind)


def _router_family(name: str, description: str, kind: Any) -> Any:
    """A metric by vLLM's name (with a colon); where Triton refused the colon, the same name
    with an underscore (docs/scale-out.md: which router setting maps it back)."""
    try:
        return _family(name, description, kind)
    except Exception as exc:  # noqa: BLE001 - whatever the metric API raises
        logger.warning("metric %s published as %s: %s", name, name.replace(":", "_"), exc)
        return _family(name.replace(":", "_"), description, kind)


class RouterMetrics:
    """What KV- and load-aware routers read, by vLLM's names (label `model_name`, as vLLM's):
    requests waiting and running, the share of the KV pool held by admitted requests, and the
    prefix cache's queried and hit prompt tokens. llm-d's endpoint picker, Dynamo's and
    SGLang's routers scrape these; the `minisgl_*` metrics say the same in more detail."""

    def __init__(self, model_name: str) -> None:
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        labels = {"model_name": model_name}
        self._families = [
            _router_family("vllm:num_requests_waiting", "Requests waiting for admission", gauge),
            _router_family("vllm:num_requests_running", "Requests admitted to the engine", gauge),
            _router_family("vllm:kv_cache_usage_perc", "Share of the KV pool held by admitted "
                           "requests (1: all of it)", gauge),
            _router_family("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the "
                           "prefix cache", counter),
            _router_family("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix "
                           "cache", counter),
        ]
        (self.waiting, self.running, self.kv_usage, self.queries,
         self.hits) = (family.Metric(labels=labels) for family in self._families)

    @staticmethod
    def gauge_values(stats: SchedulerStats) -> tuple[float, ...]:
        """The values of (`waiting`, `running`, `kv_usage`)."""
        return (stats.waiting, stats.running,
                stats.kv_pages_in_use / max(1, stats.kv_pages_total))


class LoraMetrics:
    """Requests per adapter, running and waiting (label `adapter`), the adapters on the device,
    and vLLM's `vllm:lora_requests_info`: one sample whose labels list the running and waiting
    adapters (its value: when they last changed), which llm-d's router reads for LoRA
    affinity. Set only when they change."""

    def __init__(self, model_name: str, max_loras: int) -> None:
        gauge = pb_utils.MetricFamily.GAUGE
        self._labels = {"model": model_name}
        self._max_loras = max_loras
        self._running = _family("minisgl_lora_requests_running",
                                "Running requests per LoRA adapter", gauge)
        self._waiting = _family("minisgl_lora_requests_waiting",
                                "Waiting requests per LoRA adapter", gauge)
        resident = _family("minisgl_lora_adapters_resident",
                           "LoRA adapters in device slots", gauge)
        self._resident_family, self.resident = resident, resident.Metric(labels=self._labels)
        self._per_adapter: dict[tuple[str, str], Any] = {}
        try:  # Triton checks metric names; vLLM's has a colon
            self._info_family = _family("vllm:lora_requests_info", "Running and waiting LoRA "
                                        "adapters (vLLM's name, for routers)", gauge)
        except Exception as exc:  # noqa: BLE001 - whatever the metric API raises
            logger.warning("vllm:lora_requests_info is not published: %s", exc)
            self._info_family = None
        self._info: dict[tuple[str, str], Any] = {}
        self._last: tuple = ()

    def update(self, stats: SchedulerStats) -> None:
        snapshot = (stats.lora_running, stats.lora_waiting, stats.lora_resident)
        if snapshot == self._last:
            return
        last_running, last_waiting = self._last[:2] if self._last else ((), ())
        for family, kind, counts, before in (
                (self._running, "running", stats.lora_running, last_running),
                (self._waiting, "waiting", stats.lora_waiting, last_waiting)):
            now = dict(counts)
            for name in now.keys() | dict(before).keys():  # an adapter gone goes to 0
                key = (kind, name)
                if key not in self._per_adapter:
                    self._per_adapter[key] = family.Metric(labels={**self._labels,
                                                                   "adapter": name})
                self._per_adapter[key].set(now.get(name, 0))
        self.resident.set(len(stats.lora_resident))
        if self._info_family is not None:
            # One sample per set of adapter lists seen, as vLLM's: the current one has the
            # newest time.
            key = (",".join(dict(stats.lora_running)), ",".join(dict(stats.lora_waiting)))
            if key not in self._info:
                self._info[key] = self._info_family.Metric(labels={
                    **self._labels, "running_lora_adapters": key[0],
                    "waiting_lora_adapters": key[1], "max_lora": str(self._max_loras)})
            self._info[key].set(time.time())
        self._last = snapshot


class EngineMetrics:
    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        """`max_loras`: the model's adapter slots, where LoRA is on (None: off)."""
        self.lora = LoraMetrics(model_name, max_loras) if max_loras else None
        labels = {"model": model_name}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._families = [  # keep the families alive as long as their metrics
            _family("minisgl_kv_pages_total", "KV cache pages in the pool", gauge),
            _family("minisgl_kv_pages_in_use", "KV pages held by admitted requests", gauge),
            _family("minisgl_kv_pages_cached", "Unlocked prefix-cache KV pages", gauge),
            _family("minisgl_requests_running", "Requests admitted to the engine", gauge),
            _family("minisgl_requests_waiting", "Requests waiting for admission", gauge),
            _family("minisgl_prompt_tokens_cached_total",
                    "Prompt tokens served from the prefix cache", counter),
            _family("minisgl_prompt_tokens_total", "Prompt tokens of admitted requests", counter),
            _family("minisgl_generated_tokens_total", "Tokens generated", counter),
            _family("minisgl_time_to_first_token_seconds",
                    "Time from arrival to the first output", pb_utils.MetricFamily.HISTOGRAM),
            _family("minisgl_spec_acceptance_rate",
                    "Speculative decoding: draft tokens kept / verified, since the start", gauge),
            _family("minisgl_spec_accepted_tokens_per_step",
                    "Speculative decoding: draft tokens kept per verifying row and step, since "
                    "the start", gauge),
            _family("minisgl_spec_draft_tokens_total", "Draft tokens verified", counter),
        ]
        (pages_total, in_use, cached, running, waiting, prompt_cached, prompt, generated,
         ttft, acceptance, accepted_per_step, drafts) = self._families
        self.pages_total = pages_total.Metric(labels=labels)
        self.pages_in_use = in_use.Metric(labels=labels)
        self.pages_cached = cached.Metric(labels=labels)
        self.running = running.Metric(labels=labels)
        self.waiting = waiting.Metric(labels=labels)
        self.prompt_cached = prompt_cached.Metric(labels=labels)
        self.prompt = prompt.Metric(labels=labels)
        self.generated = generated.Metric(labels=labels)
        self.ttft = ttft.Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.acceptance = acceptance.Metric(labels=labels)
        self.accepted_per_step = accepted_per_step.Metric(labels=labels)
        self.drafts = drafts.Metric(labels=labels)
        self.router = RouterMetrics(model_name)
        self._drafts_sent = 0
        self._model_name = model_name
        self._gauges = (self.pages_total, self.pages_in_use, self.pages_cached, self.running,
                        self.waiting, self.acceptance, self.accepted_per_step,
                        self.router.waiting, self.router.running, self.router.kv_usage)
        self._gauge_values: tuple[float, ...] = (-1,) * len(self._gauges)  # nothing set yet
        # Counted by record_output, sent by flush (both on the response thread).
        self._pending_generated = self._pending_prompt = self._pending_cached = 0
        self._pending_ttft: list[float] = []

    def describe_model(self, loaded: LoadedModel) -> None:
        """What was loaded, set once: the weights' bytes over all ranks, labelled with the
        quantization scheme and KV-cache dtype, and the KV pool's capacity in tokens."""
        labels = {"model": self._model_name}
        self._families += [
            _family("minisgl_model_weight_bytes", "Bytes of the model's weights over all "
                    "ranks (labels: quantization scheme, KV-cache dtype)",
                    pb_utils.MetricFamily.GAUGE),
            _family("minisgl_kv_tokens_total", "Tokens the KV pool holds",
                    pb_utils.MetricFamily.GAUGE)]
        weights = self._families[-2].Metric(labels={
            **labels, "quantization": loaded.quantization,
            "kv_cache_dtype": loaded.kv_cache_dtype})
        tokens = self._families[-1].Metric(labels=labels)
        weights.set(loaded.weight_bytes)
        tokens.set(loaded.kv_tokens)
        self._model_metrics = (weights, tokens)

    def update_gauges(self, stats: SchedulerStats) -> None:
        """Set the gauges whose value changed. Each `set` is a round trip to tritonserver that
        holds the GIL while it waits: an idle model must make none, or a stub whose server
        exited without unloading it blocks there forever (its watchdog never runs)."""
        if self.lora is not None:
            self.lora.update(stats)
        values = (stats.kv_pages_total, stats.kv_pages_in_use, stats.kv_pages_cached,
                  stats.running, stats.waiting,
                  stats.accepted_draft_tokens / max(1, stats.draft_tokens),
                  stats.accepted_draft_tokens / max(1, stats.verified_rows),
                  *self.router.gauge_values(stats))
        if stats.draft_tokens > self._drafts_sent:
            self.drafts.increment(stats.draft_tokens - self._drafts_sent)
            self._drafts_sent = stats.draft_tokens
        if values == self._gauge_values:
            return
        for gauge, value, old in zip(self._gauges, values, self._gauge_values):
            if value != old:
                gauge.set(value)
        self._gauge_values = values

    def record_output(self, out: RequestOutput, first: bool, arrived: float) -> None:
        """Count an output here; `flush` sends the counts (each counter update is a round trip
        to tritonserver holding the GIL: one per output would slow the scheduler thread)."""
        self._pending_generated += len(out.token_ids)
        if first and out.error is None:
            self._pending_ttft.append(time.monotonic() - arrived)
            self._pending_prompt += out.prompt_tokens
            self._pending_cached += out.cached_tokens

    def flush(self) -> None:
        """Send what `record_output` counted since the last flush: at most five counter
        updates, plus one observation per new request."""
        for counters, attr in (((self.generated,), "_pending_generated"),
                               ((self.prompt, self.router.queries), "_pending_prompt"),
                               ((self.prompt_cached, self.router.hits), "_pending_cached")):
            value = getattr(self, attr)
            if value:
                for counter in counters:
                    counter.increment(value)
                setattr(self, attr, 0)
        for seconds in self._pending_ttft:
            self.ttft.observe(seconds)
        self._pending_ttft.clear()
