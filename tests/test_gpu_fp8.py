"""FP8 checkpoints on a GPU in bfloat16, through the FP8 kernels (GEMV for decode, scaled or
block-scaled GEMMs for prefill), CUDA graphs and overlap, with and without the FP8 KV cache.

bfloat16 sums in other orders than the float32 reference, so tokens may part where the oracle's
top two logits nearly tie. The check is the oracle's (HF float32 on the dequantized weights,
inputs and KV quantized as the format says: tests/fp8_checkpoints.py) read of the GPU's tokens:
fed the GPU's output, it must rank every GPU token within a small margin of its best.
Skipped without CUDA; the CPU runs of every format are in test_fp8_checkpoints.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.testing.tiny_models import build_tiny_model
from tests.conftest import CHECKED, mixed_prompts
from tests.fp8_checkpoints import FORMATS, KV_SCALES, fp8_oracle, write_fp8_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
MAX_TOKENS = 12
# How far below the oracle's best logit a bfloat16 run's token may be: bfloat16 rounds to 3
# significant digits, so logits of a few units move by a few hundredths.
MARGIN = 0.15


def near_greedy(oracle: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each generated token: the oracle's best logit minus the token's, at that step."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = oracle(ids).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logits.max(dim=1).values - chosen).tolist()


@pytest.mark.parametrize("name", [*FORMATS, "online"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_bfloat16_fp8_kernels_follow_the_oracle(tmp_path: Path, name: str,
                                                kv_cache_dtype: str) -> None:
    source = build_tiny_model("qwen3", tmp_path / "source", seed=5)
    prompts = mixed_prompts(8)
    if name == "online":
        model, settings, kv_scales = source, {"quantization": "fp8"}, (1.0, 1.0)
        oracle = fp8_oracle(source, name, kv_scales=kv_scales if kv_cache_dtype != "auto"
                            else None)
    else:
        model = write_fp8_checkpoint(source, tmp_path / name, name, prompts)
        settings = {}
        kv_scales = KV_SCALES if FORMATS[name].kv_scale_names else (1.0, 1.0)
        oracle = fp8_oracle(source, name, model,
                            kv_scales=kv_scales if kv_cache_dtype != "auto" else None)
    with LLM(model, device="cuda", hooks=CHECKED, dtype="bfloat16", cuda_graph_max_bs=16,
             kv_cache_dtype=kv_cache_dtype, **settings) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    gaps = [gap for prompt, out in zip(prompts, outputs)
            for gap in near_greedy(oracle, prompt, out.token_ids)]
    assert max(gaps) <= MARGIN, f"{name}: the oracle ranks a GPU token {max(gaps):.3f} below " \
                                f"its best"
