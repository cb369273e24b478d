"""The engine processes on their own: steps can be queued before earlier tokens are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.protocol import StepMessage
from minisgl_backend.scheduler.engine_client import EngineClient
from tests.conftest import hf_greedy

PROMPT = [5, 17, 42, 99, 7, 250, 13]
STEPS = 6


def _prefill() -> StepMessage:
    return StepMessage(is_prefill=True, rows=[0], starts=[0], extend_lens=[len(PROMPT)],
                       tokens=PROMPT, page_rows=[0], page_counts=[len(PROMPT) + STEPS],
                       new_pages=list(range(len(PROMPT) + STEPS)), admit_rows=[0],
                       admit=RowSampling.of([(SamplingParams(), 0)], vocab_size=1))


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_steps_sent_before_reading_tokens_equal_hf(tiny_models: dict[str, Path],
                                                          overlap: bool) -> None:
    """Decode inputs come from the engine's token pool, so the scheduler can send step N+1
    before it has read step N's token (what overlap scheduling needs). Each step is answered
    once its token is on the host, overlap on or off."""
    model = tiny_models["qwen3"]
    client = EngineClient(EngineConfig(model_dir=str(model), device="cpu", overlap=overlap,
                                       max_running_requests=4, max_total_tokens=64))
    try:
        client.send(_prefill().to_bytes())
        for _ in range(STEPS - 1):  # every decode step queued before any token is read
            client.send(StepMessage(is_prefill=False, rows=[0]).to_bytes())
        tokens = [int(client.receive_step(timeout=60).tokens[0]) for _ in range(STEPS)]
    finally:
        client.shutdown()
    assert tokens == hf_greedy(model, [PROMPT], STEPS)[0]
