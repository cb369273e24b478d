"""Speculative verify steps on a GPU: the verify rows run as decode rows (one per token) on
the decode kernels and CUDA graphs; outputs equal the non-speculative ones, float32 on the
Triton kernels and bfloat16 on FlashInfer, with graphs and overlap on and off. Skipped
without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.test_gpu_engine import GPU_SHAPES
from tests.test_speculative import _requests
from tests.conftest import CHECKED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("gpu-spec"), **GPU_SHAPES["llama"])


def run(model: Path, **settings: object) -> tuple[list, int]:
    with LLM(model, device="cuda", max_total_tokens=4096, hooks=CHECKED,
             **settings) as llm:
        outs = llm.generate(*_requests())
        return [(o.token_ids, o.finish_reason) for o in outs], llm.scheduler.speculator.accepted


CASES = [  # attention backend, dtype, largest CUDA-graph batch, overlap, page size
    ("triton", "float32", 64, True, 1),
    ("triton", "float32", 0, False, 16),
    pytest.param("flashinfer", "bfloat16", 64, True, 16,
                 marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")),
]


@pytest.mark.parametrize(("backend", "dtype", "graph_max_bs", "overlap", "page_size"), CASES)
def test_gpu_verify_steps_equal_the_non_speculative_output(model: Path, backend: str,
                                                           dtype: str, graph_max_bs: int,
                                                           overlap: bool,
                                                           page_size: int) -> None:
    settings = {"attention_backend": backend, "dtype": dtype,
                "cuda_graph_max_bs": graph_max_bs, "overlap": overlap, "page_size": page_size}
    base, _ = run(model, jump_forward=False, **settings)
    for method in ("ngram", "suffix"):
        outs, accepted = run(model, speculative=method, **settings)
        assert outs == base, method
        assert accepted > 0
