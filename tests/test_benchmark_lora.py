"""The `lora` benchmark: its random adapters load, and a CPU smoke run on a tiny random model
prints its three runs (no speed is asserted)."""

from __future__ import annotations

from pathlib import Path

from minisgl_backend.benchmark.lora import write_random_adapter
from minisgl_backend.benchmark.shapes import shape_config
from minisgl_backend.lora.config import check_adapter_tensors, read_adapter_config
from minisgl_backend.models import ModelConfig
from tests.test_benchmarks import last_table, tool


def test_random_adapters_fit_their_shape(tmp_path: Path) -> None:
    for shape in ("tiny-llama", "tiny-qwen3-moe"):
        config = ModelConfig.from_dict(shape_config(shape))
        folder = write_random_adapter(tmp_path / shape, config, rank=4, seed=0)
        check_adapter_tensors(read_adapter_config(shape, folder, max_rank=4), config)


def test_cpu_smoke_run() -> None:
    run = tool("lora", "--device", "cpu", "--shape", "tiny-llama", "--max-total-tokens", "4096",
               "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1", "--adapters", "2",
               "--rank", "4")
    assert run.returncode == 0, run.stdout[-3000:]
    header, rows = last_table(run.stdout)
    assert header == ["run", "batch", "decode tok/s", "ms/step", "step vs base"]
    assert [row[0] for row in rows] == ["base", "base, LoRA on", "2 adapters"]
    assert rows[0][4] == "1.000x" and all(float(row[2]) > 0 for row in rows)
