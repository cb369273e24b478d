"""Triton `minisgl` model, decoupled: `execute` submits each request (`intake`) and returns at
once; one thread sends every response (`responses`), another watches the engine and the server
(`inflight.ServerWatch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minisgl_backend.llm import LLM
from minisgl_backend.lora.trtllm import TaskAdapters
from minisgl_backend.serving.inflight import InFlight, ServerWatch
from minisgl_backend.serving.intake import submit
from minisgl_backend.serving.lifecycle import dump_stacks_on_sigusr1, exit_with_server
from minisgl_backend.serving.metrics import EngineMetrics
from minisgl_backend.serving.responses import Responder
from minisgl_backend.serving.settings import (
    engine_settings,
    load_model_config,
    model_parameters,
    request_policy,
    resolve_model_dir,
)


class TritonPythonModel:
    """Wires the engine (`LLM`), the intake, the response thread and the server watch."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_stacks_on_sigusr1()
        config = load_model_config(args)
        parameters = model_parameters(config)
        model_dir = resolve_model_dir(parameters, args["model_repository"])
        self.llm = LLM(model_dir, **engine_settings(parameters))
        self.limits = request_policy(parameters)
        name, scheduler = config["name"], self.llm.scheduler
        # TensorRT-LLM's LoRA tasks: their adapters are written where the engine's private
        # files are (removed with them).
        self.tasks = TaskAdapters(Path(scheduler.engine.private_dir) / "lora-tasks",
                                  self.llm.model_config, self.llm.load_lora)
        metrics = EngineMetrics(name, self.llm.max_loras if self.llm.lora_enabled else None)
        metrics.describe_model(self.llm.loaded)
        self.inflight = InFlight(scheduler.abort)
        self.responder = Responder(self.llm.tokenizer, self.inflight, metrics)
        self.watch = ServerWatch(name, scheduler, self.inflight,
                                 lambda: metrics.update_gauges(scheduler.stats))
        exit_with_server(name, lambda: scheduler.engine.shutdown(timeout=1.0),
                         private_dirs=[scheduler.engine.private_dir])

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            state = submit(request, self.llm, self.limits, self.responder.put, self.tasks)
            if state is not None:
                self.inflight.add(state)
        return None

    def finalize(self) -> None:
        self.watch.stop()
        self.llm.shutdown()  # ends every request still running with an "abort" output
        self.responder.stop()
