"""The `fp8` benchmark: its perplexity text, its arithmetic, and CPU smoke runs of its parts on a
tiny random model (options, the table and the JSON file; no speed is asserted)."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minisgl_backend.benchmark.fp8 import TEXT_PATH, kv_run, perplexity, text_ids
from minisgl_backend.benchmark.hardware import weight_bytes
from minisgl_backend.benchmark.shapes import shape_config
from minisgl_backend.models import ModelConfig
from tests.test_benchmarks import last_table, number, tool

TINY = ["--device", "cpu", "--shape", "tiny-llama", "--max-total-tokens", "4096"]


def test_text_is_long_enough_under_the_default_models_tokenizer(default_model: Path) -> None:
    from transformers import AutoTokenizer

    assert len(TEXT_PATH.read_text().split()) >= 1600
    assert len(text_ids(AutoTokenizer.from_pretrained(str(default_model)))) >= 2000


def test_perplexity_of_known_distributions() -> None:
    ids = [3, 1, 4, 1, 5]
    uniform = np.zeros((len(ids), 8), np.float32)
    assert perplexity(uniform, ids) == pytest.approx(8.0)
    sure = np.full((len(ids), 8), -30.0, np.float32)
    sure[np.arange(len(ids) - 1), ids[1:]] = 30.0  # row i predicts ids[i + 1]
    assert perplexity(sure, ids) == pytest.approx(1.0, abs=1e-6)
    half = np.zeros((len(ids), 8), np.float32)
    half[:, 0] = math.log(7.0)  # token 0 has p = 1/2, every other 1/14
    assert perplexity(half, ids) == pytest.approx(14.0)
    with pytest.raises(ValueError):
        perplexity(uniform[:3], ids)


def test_fp8_weight_bytes_count_projections_at_one_byte_with_channel_scales() -> None:
    config = ModelConfig.from_dict(shape_config("llama-3.1-8b"))
    bf16 = weight_bytes(config, torch.bfloat16)
    fp8 = weight_bytes(config, torch.bfloat16, projection_dtype=torch.float8_e4m3fn)
    hidden, inter, kv, layers = 4096, 14336, 8 * 128, 32
    rows = (hidden + 2 * kv) + hidden + 2 * inter + hidden  # qkv, o, gate_up, down
    params = (hidden + 2 * kv) * hidden + hidden * hidden + 3 * inter * hidden
    assert bf16.total - fp8.total == layers * (params - 4 * rows)
    assert fp8.embedding == bf16.embedding  # the embedding and LM head stay in bf16
    assert fp8.per_decode_step(1) == pytest.approx(8.036e9, rel=1e-3)


def test_kv_part_reports_a_pool_too_small_without_timing() -> None:
    cache = SimpleNamespace(num_pages=256, page_size=16)
    llm = SimpleNamespace(scheduler=SimpleNamespace(cache=cache))
    args = Namespace(kv_context=2040, kv_new_tokens=60, repeats=1, seed=0)
    result = kv_run(args, llm, "baseline", 512, 2)  # type: ignore[arg-type]
    assert result.part == "kv 2 x 2040"
    # 2,100 tokens a request take 132 pages of 16
    assert result.value is None and "pool 4,096 tokens < 4,224 needed" in result.detail
    assert result.extra == {"pool_tokens": 4096, "needed_tokens": 4224}


def test_accuracy_part_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    run = tool("fp8", *TINY, "--parts", "accuracy", "--text-tokens", "64",
               "--chunked-prefill-size", "16", "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:]
    header, rows = last_table(run.stdout)
    assert header == ["part", "run", "figure", "value", "vs baseline", "detail"]
    assert [row[1] for row in rows] == ["baseline", "fp8", "fp8 + fp8 KV"]
    assert all(row[0] == "accuracy" and row[2] == "perplexity" for row in rows)
    assert all(1 < number(row[3]) <= 512 for row in rows)  # at most the vocabulary's size
    assert rows[0][4] == "1.000x" and all(number(row[4]) > 0 for row in rows)
    assert all("names Paris: no" in row[5] for row in rows)  # random weights
    assert "within 3%" in rows[1][5] and "within 3%" in rows[2][5]
    assert "64 tokens, prefilled in chunks of 16" in run.stdout
    saved = json.loads(out.read_text())
    assert saved["table"][1]["run"] == "fp8"
    assert [r["extra"]["tokens"] for r in saved["results"]] == [64] * 3
    assert all(r["extra"]["answer"] for r in saved["results"])
    assert saved["results"][1]["value"] == pytest.approx(number(rows[1][3]), rel=1e-3)


def test_speed_parts_on_a_tiny_model_side_by_side(tmp_path: Path) -> None:
    run = tool("fp8", *TINY, "--parts", "decode", "offline", "kv", "--num-requests", "4",
               "--min-len", "4", "--max-len", "12", "--new-tokens", "16", "--prompt-len", "4",
               "--kv-batch", "2", "1", "--kv-context", "64", "--kv-new-tokens", "8",
               "--copy-mib", "16", "--repeats", "1", "--json", str(tmp_path / "speed.json"))
    assert run.returncode == 0, run.stdout[-3000:]
    _, rows = last_table(run.stdout)
    assert [row[:3] for row in rows] == [
        ["kv 1 x 64", "baseline", "steps/s"], ["kv 1 x 64", "fp8 KV", "steps/s"],
        ["kv 2 x 64", "baseline", "steps/s"], ["kv 2 x 64", "fp8 KV", "steps/s"],
        ["decode batch 1", "baseline", "tok/s"], ["decode batch 1", "fp8", "tok/s"],
        ["offline anchor", "baseline", "output tok/s"], ["offline anchor", "fp8", "output tok/s"]]
    assert all(number(row[3]) > 0 and number(row[4]) > 0 for row in rows)
    assert all("2 rows at once" in row[5] for row in rows[2:4])
    assert "roofline" in rows[4][5] and "roofline" in rows[5][5]
    assert "a smoke run, not the GPU figures" in run.stdout
    assert len(json.loads((tmp_path / "speed.json").read_text())["results"]) == 8
