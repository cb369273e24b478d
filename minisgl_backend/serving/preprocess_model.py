"""Triton `preprocessing` model: prompt text (or chat messages) to token ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from minisgl_backend.serving.lifecycle import exit_with_server
from minisgl_backend.serving.request import RequestError, prompt_token_ids
from minisgl_backend.serving.settings import (
    load_model_config,
    model_parameters,
    request_policy,
    resolve_model_dir,
)
from minisgl_backend.serving.tensors import input_getter
from minisgl_backend.startup_heap import freeze_startup_heap


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        from transformers import AutoTokenizer

        config = load_model_config(args)
        parameters = model_parameters(config)
        self.limits = request_policy(parameters)
        model_dir = resolve_model_dir(parameters, args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        exit_with_server(config["name"])
        freeze_startup_heap()  # a collection would hold up every request being tokenized

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._tokenize(request) for request in requests]

    def _tokenize(self, request: Any) -> Any:
        try:
            ids = prompt_token_ids(input_getter(request), self.tokenizer, self.limits)
        except RequestError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        tensor = pb_utils.Tensor("input_ids", np.asarray([ids], dtype=np.int32))
        return pb_utils.InferenceResponse(output_tensors=[tensor])
