"""Smoke tests of the benchmark scripts: tiny shapes on CPU, each script in a subprocess.

The three scripts start together (they mostly wait on engine start-up), then each test checks
that its script exited 0 and ended with a Markdown table of positive numbers.
`bench_triton_offline.py` (offline API vs tritonserver + perf_analyzer) runs on its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl_backend.benchmark.cli import human_bytes, markdown_table
from minisgl_backend.benchmark.hardware import weight_bytes
from minisgl_backend.benchmark.shapes import SHAPES, shape_config
from minisgl_backend.benchmark.tokenizer import shape_tokenizer, write_tokenizer
from minisgl_backend.benchmark.workloads import anchor_workload, shared_prefix_workload
from minisgl_backend.models import ModelConfig

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
COMMON = ["--device", "cpu", "--max-total-tokens", "4096"]
RUNS: dict[str, list[str]] = {
    "bench_decode": ["--shape", "tiny-llama", "--batch-sizes", "1", "2", "--new-tokens", "48",
                     "--prompt-len", "4", "--repeats", "2", "--copy-mib", "16"],
    "bench_offline": ["--shape", "tiny-qwen3", "--num-requests", "4", "--min-len", "4",
                      "--max-len", "12", "--detokenize", "both"],
    # Best of 2 over 24 tokens: one run of 12 left the off rate to noise (a 1-token run about
    # as long as the 12-token one gave 0.00x).
    "bench_speculative": ["--shape", "tiny-llama", "--batch-sizes", "1", "2", "--new-tokens",
                          "24", "--prompt-len", "4", "--repeats", "2", "--acceptance", "0.8"],
    "bench_mechanisms": ["--shape", "tiny-qwen3-moe", "--num-requests", "3", "--min-len", "4",
                         "--max-len", "8", "--prefix-requests", "3", "--prefix-len", "48",
                         "--suffix-len", "4", "--prefix-output-len", "2"],
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess]:
    procs = {
        name: subprocess.Popen([sys.executable, str(SCRIPTS / f"{name}.py"), *COMMON, *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, args in RUNS.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
    return results


def last_table(output: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the Markdown table the output ends with."""
    lines = output.rstrip().splitlines()
    start = len(lines)
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start:]]
    assert len(cells) >= 3 and set(cells[1]) == {"---"}, output[-2000:]
    return cells[0], cells[2:]


def number(cell: str) -> float:
    return float(cell.rstrip("x%"))


def check_run(outputs: dict[str, subprocess.CompletedProcess], name: str,
              header: tuple[str, ...], may_be_zero: tuple[str, ...] = ()) -> list[dict[str, str]]:
    run = outputs[name]
    assert run.returncode == 0, run.stdout[-4000:]
    columns, rows = last_table(run.stdout)
    assert tuple(columns) == header
    records = [dict(zip(columns, row)) for row in rows]
    for record in records:
        for column, cell in record.items():
            if cell == "-" or column in ("shape", "mechanism", "setting", "workload",
                                         "detokenize", "config"):
                continue
            assert number(cell) > 0 or (column in may_be_zero and number(cell) == 0), record
    return records


def test_bench_decode(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    rows = check_run(outputs, "bench_decode", (
        "batch", "new tokens", "decode tok/s", "ms/step", "roofline tok/s", "of roofline",
        "HF tok/s", "HF ms/step", "vs HF"))
    assert [r["batch"] for r in rows] == ["1", "2"]
    assert rows[0]["roofline tok/s"] != "-" and rows[1]["roofline tok/s"] == "-"
    assert all(r["HF tok/s"] != "-" for r in rows)


def test_bench_speculative(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    """Off and with synthetic acceptance, per batch size; the roofline at batch 1."""
    rows = check_run(outputs, "bench_speculative", (
        "batch", "config", "decode tok/s", "vs off", "kept per verify", "of roofline"))
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in ("1", "2") for c in ("off", "ngram k=4 p=0.8")]
    assert rows[1]["kept per verify"] != "-" and rows[0]["of roofline"] != "-"


def test_bench_offline(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    """Without, then with the shape's tokenizer in the model folder (the outputs have text)."""
    rows = check_run(outputs, "bench_offline", (
        "shape", "detokenize", "requests", "input tokens", "output tokens", "total s",
        "output tok/s"))
    assert [(r["shape"], r["detokenize"], r["requests"]) for r in rows] == [
        ("tiny-qwen3", "off", "4"), ("tiny-qwen3", "on", "4")]
    expected = anchor_workload(SHAPES["tiny-qwen3"]["vocab_size"], 4, 4, 12)
    assert all(int(r["output tokens"]) == expected.output_tokens for r in rows)
    assert "tokenizer 'word-level'" in outputs["bench_offline"].stdout
    assert "detokenizer cost: " in outputs["bench_offline"].stdout
    for setting in ("off", "on"):  # the collector's pauses in each timed call
        assert re.search(rf"garbage collector, detokenize {setting} .*: \d+ full collections",
                         outputs["bench_offline"].stdout)


def test_bench_offline_replays_the_detokenizer_alone() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_offline.py"), "--device", "cpu", "--shape",
         "tiny-llama", "--num-requests", "4", "--min-len", "4", "--max-len", "12",
         "--detokenize", "replay"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = anchor_workload(SHAPES["tiny-llama"]["vocab_size"], 4, 4, 12)
    assert f"tokenizer 'word-level', random outputs of the anchor workload (4 requests, " \
        f"{expected.output_tokens} tokens): " in run.stdout


def test_bench_mechanisms(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    rows = check_run(outputs, "bench_mechanisms", (
        "mechanism", "setting", "workload", "requests", "total s", "output tok/s",
        "mean TTFT ms", "prompt cache hits", "speed-up"), may_be_zero=("prompt cache hits",))
    assert [(r["mechanism"], r["setting"]) for r in rows] == [
        ("CUDA graphs", "off"), ("CUDA graphs", "on"), ("overlap", "off"), ("overlap", "on"),
        ("radix cache", "off"), ("radix cache", "on")]
    assert rows[0]["speed-up"] == "1.00x"
    assert rows[4]["prompt cache hits"] == "0.0%"  # the naive cache never shares


def test_bench_triton_offline() -> None:
    """Offline API and tritonserver + perf_analyzer on the same 4 requests (CPU, about 30 s),
    with mixed prefill steps (a model parameter of the server)."""
    args = ["--shape", "tiny-qwen3", "--num-requests", "4", "--min-len", "4", "--max-len", "12",
            "--concurrency", "2", "--mixed-prefill"]
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_triton_offline.py"), *COMMON,
                          *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    columns, rows = last_table(run.stdout)
    assert tuple(columns) == ("concurrency", "path", "requests", "output tokens", "seconds",
                              "output tok/s", "vs offline", "mean TTFT ms", "mean ITL ms",
                              "mean in flight")
    records = [dict(zip(columns, row)) for row in rows]
    offline, served = "offline API", "tritonserver + perf_analyzer"
    assert [(r["concurrency"], r["path"]) for r in records] == [
        ("all", offline), ("2", offline), ("2", served)]
    expected = anchor_workload(SHAPES["tiny-qwen3"]["vocab_size"], 4, 4, 12)
    for record in records:
        assert record["requests"] == "4" and int(record["output tokens"]) == \
            expected.output_tokens, record
        for column in ("seconds", "output tok/s", "mean TTFT ms", "mean ITL ms",
                       "mean in flight"):
            assert number(record[column]) > 0, record
    assert [r["vs offline"] for r in records[:2]] == ["-", "-"]
    assert records[2]["vs offline"].endswith("%") and number(records[2]["vs offline"]) > 0
    assert number(records[2]["mean in flight"]) <= 2  # perf_analyzer kept at most 2 in flight
    assert "'mixed_prefill': 'true'" in run.stdout  # the server's engine settings


# ----- the shared pieces, in-process ----------------------------------------------------------


def test_anchor_workload_is_reproducible_and_in_range() -> None:
    a, b = anchor_workload(1000, 256), anchor_workload(1000, 256)
    assert a.prompts == b.prompts and a.params == b.params and len(a) == 256
    assert all(100 <= len(p) <= 1024 for p in a.prompts)
    assert all(100 <= p.max_tokens <= 1024 and p.temperature == 0.6 and p.ignore_eos
               for p in a.params)
    assert all(0 <= t < 1000 for p in a.prompts for t in p)
    assert anchor_workload(1000, 8, seed=1).prompts != a.prompts[:8]


@pytest.mark.parametrize("vocab_size", [151936, 128256])
def test_anchor_workload_is_upstreams(vocab_size: int) -> None:
    """The request set of upstream mini-sglang's benchmark/offline/bench.py (its totals)."""
    w = anchor_workload(vocab_size)
    assert (len(w), w.input_tokens, w.output_tokens) == (256, 142_827, 133_966)
    assert max(t for p in w.prompts for t in p) == 10000 and w.prompts[0][:3] == [6311, 6890, 663]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_tokenizer_decodes_every_id(shape: str) -> None:
    vocab_size = SHAPES[shape]["vocab_size"]
    tokenizer = shape_tokenizer(shape, vocab_size)
    texts = tokenizer.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    assert len(texts) == vocab_size and all(texts)


def test_llama_3_tokenizer_folder_loads_with_transformers(tmp_path: Path) -> None:
    """The folder `LLM` gets: AutoTokenizer loads Llama 3's tokenizer with its special tokens."""
    from transformers import AutoTokenizer

    write_tokenizer("llama-3.1-8b", SHAPES["llama-3.1-8b"]["vocab_size"], tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == 128256
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (128000, 128001)
    ids = tokenizer.encode("Hello world, this is Llama 3!", add_special_tokens=False)
    assert ids == [9906, 1917, 11, 420, 374, 445, 81101, 220, 18, 0]
    assert tokenizer.decode(ids + [128001], skip_special_tokens=True) == \
        "Hello world, this is Llama 3!"


def test_a_named_tokenizer_may_cover_part_of_a_padded_vocabulary(tmp_path: Path) -> None:
    """Qwen3's 151,936 ids with Llama 3's 128,256 tokens (a real checkpoint pads its vocabulary
    past its tokenizer's too); a word-level tokenizer must match the vocabulary exactly, and no
    tokenizer may have more ids than the model."""
    from transformers import AutoTokenizer

    write_tokenizer("qwen3-0.6b", SHAPES["qwen3-0.6b"]["vocab_size"], tmp_path, "llama-3")
    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) == 128256
    with pytest.raises(ValueError, match="has 128256 ids"):
        shape_tokenizer("tiny-llama", SHAPES["tiny-llama"]["vocab_size"], "llama-3")
    assert shape_tokenizer("tiny-llama", 600, "word-level").get_vocab_size() == 600


def test_bench_structured_output_needs_a_tokenizer_that_spells_json() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_structured_output.py"), "--shape", "qwen3-0.6b"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 2 and "cannot spell JSON: give --tokenizer" in run.stdout


def test_shared_prefix_workload() -> None:
    w = shared_prefix_workload(1000, num_requests=5, prefix_len=2000, suffix_len=8)
    assert len(w) == 5 and all(len(p) == 2008 for p in w.prompts)
    assert all(p[:2000] == w.prompts[0][:2000] for p in w.prompts)
    assert len({tuple(p[2000:]) for p in w.prompts}) == 5


def test_real_shapes_parse_and_have_the_documented_sizes() -> None:
    llama = ModelConfig.from_dict(shape_config("llama-3.1-8b"))
    assert (llama.hidden_size, llama.num_layers, llama.num_kv_heads, llama.vocab_size) == \
        (4096, 32, 8, 128256) and llama.rope.rope_type == "llama3"
    qwen = ModelConfig.from_dict(shape_config("qwen3-0.6b"))
    assert qwen.tie_word_embeddings and qwen.head_dim == 128 and qwen.qk_norm
    moe = ModelConfig.from_dict(shape_config("qwen3-30b-a3b", num_layers=4))
    assert (moe.num_layers, moe.num_experts, moe.num_experts_per_tok) == (4, 128, 8)
    assert shape_config("qwen3-0.6b", vocab_size=128256)["vocab_size"] == 128256
    assert SHAPES["qwen3-0.6b"]["vocab_size"] == 151936  # a copy was changed
    with pytest.raises(ValueError, match="vocab_size"):
        shape_config("qwen3-0.6b", vocab_size=0)


def test_weight_bytes_of_llama_8b() -> None:
    config = ModelConfig.from_dict(shape_config("llama-3.1-8b"))
    weights = weight_bytes(config, torch.bfloat16)
    assert weights.total == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count, bf16
    assert weights.per_decode_step(1) == weights.total - 2 * 128256 * 4096
    half = weight_bytes(config, torch.bfloat16, tp_size=2)
    assert half.per_decode_step(1) < 0.51 * weights.per_decode_step(1)


def test_moe_weight_bytes_scale_with_routed_experts() -> None:
    weights = weight_bytes(ModelConfig.from_dict(shape_config("qwen3-30b-a3b")), torch.bfloat16)
    assert weights.experts > 0.9 * weights.total
    one, many = weights.per_decode_step(1), weights.per_decode_step(256)
    assert one < 0.15 * weights.total and many > 0.99 * (weights.total - weights.embedding)


def test_report_helpers() -> None:
    assert human_bytes(16.06e9) == "16.06 GB" and human_bytes(4.8e12) == "4.8 TB"
    assert markdown_table(("a", "b"), [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_warm_kernels_runs_every_variant() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "warm_kernels.py"), "--device", "cpu", "--shapes",
         "tiny-qwen3", "tiny-llama", "--backends", "torch", "--page-sizes", "16", "1"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "warm after" in line]
    assert [line.split(":")[0] for line in lines] == [
        "tiny-qwen3, torch, page 16", "tiny-qwen3, torch, page 1",
        "tiny-llama, torch, page 16", "tiny-llama, torch, page 1"]



def test_bench_kernels_times_every_variant_on_cpu() -> None:
    """The kernel benchmark's CPU smoke test: the Triton kernels in the interpreter, every sweep
    variant of the decode kernel, SiLU-and-mul, sampling, log-probabilities, the host's
    time of a step's calls around sampling and the controls' edits with sampling; every
    table ends the output."""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_kernels.py"), "--device", "cpu", "--shapes",
         "tiny-qwen3", "--batch-sizes", "2", "--context-lens", "40", "--page-sizes", "16",
         "--silu-tokens", "1", "--calls", "1", "--replays", "1", "--sweep"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    header, rows = last_table(run.stdout)
    assert header == ["shape", "projection", "batch", "path", "us/call", "weights GB/s",
                      "of copy bw"]
    per_projection = 2 + 12 + 12  # two of today's paths, 12 dot tiles, 12 CUDA-core variants
    assert [r[1] for r in rows[::per_projection]] == ["qkv", "o", "gate_up", "down"]
    assert [r[3] for r in rows[:3]] == ["cuBLAS GEMV only", "layer ops today",
                                        "fused Triton n16 k128 s3"]
    assert rows[per_projection - 1][3] == "fused Triton fma n16 k512 w8"
    assert len(rows) == 4 * per_projection
    assert all(number(r[4]) > 0 for r in rows)
    header, rows = last_table(run.stdout.split("## Decoder-layer")[0])
    assert header == ["shape", "tokens", "heads per program", "us/call"]
    assert [row[2] for row in rows] == ["1", "2", "4", "8"] and all(number(r[3]) > 0 for r in rows)
    header, rows = last_table(run.stdout.split("## Attention prologue")[0])
    assert header == ["vocab", "batch", "context", "penalties", "min_p floor", "us/call"]
    assert [row[3:5] for row in rows] == [[p, f] for p in ("dense", "sparse")
                                          for f in ("written", "in sampling")]
    assert all(number(r[5]) > 0 for r in rows)
    header, rows = last_table(run.stdout.split('## The "all" edits')[0])
    assert header == ["batch", "call", "host us/call"]
    assert [row[1] for row in rows] == ["torch.empty", "argmax", "sample_from_logits",
                                        "sample_from_logits seeded",
                                        "LogitControls.sampled_logprobs",
                                        "LogitControls.raw_logprobs", "LogitControls.report",
                                        "all: LogitControls.apply keep_raw",
                                        "all: LogitControls.record",
                                        "all: LogitControls.sampled_logprobs"]
    assert all(number(r[2]) > 0 for r in rows)
    header, rows = last_table(run.stdout.split("## Host time")[0])
    assert header == ["vocab", "batch", "top", "kernel", "us/call"]
    assert [row[2:4] for row in rows] == [[top, k] for top in ("5", "20")
                                          for k in ("triton", "torch")]
    assert all(number(r[4]) > 0 for r in rows)
    header, rows = last_table(run.stdout.split("## Log-probability")[0])
    assert header == ["vocab", "batch", "sampler", "us/call"]
    assert [row[2] for row in rows] == [f"triton chunk {c}" for c in (1024, 2048, 4096, 8192)] \
        + ["torch"] and all(number(r[3]) > 0 for r in rows)
    silu = run.stdout.split("## SiLU-and-mul")[1].split("## Sampling")[0]
    assert "| triton |" in silu
    attention = run.stdout.split("## SiLU-and-mul")[0]
    variants = [line.split("|")[5].strip() for line in attention.splitlines()
                if line.startswith("| tiny-qwen3")]
    assert variants[0] == "triton" and len(variants) == 15, variants
    assert all(number(line.split("|")[6]) > 0 for line in attention.splitlines()
               if line.startswith("| tiny-qwen3"))


def test_bench_scheduler_runs_the_workload_through_the_real_scheduler() -> None:
    """Every requested token comes back through the scheduler with the instant engine, with
    overlap on and off; the table ends the output."""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_scheduler.py"), "--num-requests", "12",
         "--min-len", "4", "--max-len", "40", "--page-sizes", "1", "16", "--repeats", "1",
         "--max-running-requests", "5", "--chunked-prefill-size", "32"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    header, rows = last_table(run.stdout)
    assert header[:6] == ["requests", "output tokens", "steps", "page", "overlap", "outputs"]
    assert [tuple(row[3:6]) for row in rows] == [
        (page, overlap, outputs) for page in ("1", "16") for overlap in ("on", "off")
        for outputs in ("stream", "whole")]
    workload = anchor_workload(151936, 12, 4, 40)
    assert all(int(row[1]) == workload.output_tokens for row in rows)
    assert all(number(cell) > 0 for row in rows for cell in row[6:])


def test_bench_scheduler_times_guided_steps_against_unguided() -> None:
    """--guided-batch: every token of the JSON-schema requests is one their grammar allowed (a
    request with one it did not would end in an error, which the script raises), with overlap
    on and off, the masks filled on the scheduler's thread or by a worker process (16 rows: the
    workers' least), the outputs streamed or whole; the table ends the output."""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_scheduler.py"), "--guided-batch", "16",
         "--max-tokens", "24", "--repeats", "1", "--grammar-workers", "0", "1"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    header, rows = last_table(run.stdout)
    assert header == ["batch", "config", "fill workers", "overlap", "outputs", "steps",
                      "us/step", "vs unguided"]
    assert [tuple(row[1:5]) for row in rows] == [
        (config, workers, overlap, outputs) for overlap in ("on", "off")
        for outputs in ("stream", "whole")
        for config, workers in (("unguided", "0"), ("json_schema", "0"), ("json_schema", "1"))]
    assert all(int(row[5]) == 23 and number(row[6]) > 0 for row in rows)  # decode steps


def test_bench_sampling_controls_prints_every_control_side_by_side() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_sampling_controls.py"), *COMMON, "--shape",
         "tiny-qwen3", "--batch-sizes", "1", "2", "--max-tokens", "32", "--prompt-len", "4",
         "--repeats", "2", "--each"],  # enough decode steps that noise cannot hide them
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    header, rows = last_table(run.stdout)
    assert header == ["batch", "config", "decode tok/s", "ms/step", "vs none"]
    configs = ["none", "all", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_p", "logit_bias", "bad_token_ids", "logprobs"]
    assert [(r[0], r[1]) for r in rows] == [(b, c) for b in ("1", "2") for c in configs]
    assert all(number(r[2]) > 0 and number(r[3]) > 0 and number(r[4]) > 0 for r in rows)
    assert [r[4] for r in rows if r[1] == "none"] == ["1.00x", "1.00x"]
    assert "penalties 760,320 B/row = 194.6 MB" in run.stdout


def test_bench_sampling_controls_runs_the_configs_asked_for() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_sampling_controls.py"), *COMMON, "--shape",
         "tiny-qwen3", "--batch-sizes", "1", "--max-tokens", "32", "--prompt-len", "4",
         "--repeats", "2", "--configs", "logprobs", "min_p"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    _, rows = last_table(run.stdout)
    assert [(r[1], r[4]) for r in rows] == [("logprobs", "-"), ("min_p", "-")]  # no none


def test_profile_decode_step_measures_each_control() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "profile_decode_step.py"), "--shape", "tiny-llama",
         "--backends", "torch", "--batch-sizes", "1", "2", "--steps", "12", "--temperature",
         "0.7", "--controls", "none", "repetition_penalty", "logprobs", "all"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    header, rows = last_table(run.stdout)
    assert header[:3] == ["backend", "controls", "batch"]
    assert [(r[1], r[2]) for r in rows] == [(c, b) for c in ("none", "repetition_penalty",
                                                             "logprobs", "all")
                                            for b in ("1", "2")]
    assert all(number(r[4]) > 0 and number(r[6]) > 0 for r in rows)  # host and step ms


def test_bench_speculative_cpu_prints_both_workloads_and_every_config() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_speculative_cpu.py"), "--batch-sizes", "1",
         "--max-tokens", "12", "--repeats", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    header, rows = last_table(run.stdout)
    assert header == ["workload", "batch", "config", "tokens", "decode tok/s", "vs off",
                      "acceptance"]
    assert [(r[0], r[2]) for r in rows] == [(w, c) for w in ("repetitive", "chat")
                                            for c in ("off", "ngram", "suffix")]
    assert len({r[3] for r in rows if r[0] == "repetitive"}) == 1  # the same tokens
    assert rows[1][6] != "-" and number(rows[1][6]) > 0  # ngram kept drafts on repetitions


def test_bench_structured_output_runs_the_configs_asked_for() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_structured_output.py"), "--batch-sizes", "2",
         "--max-tokens", "8", "--repeats", "1", "--configs", "json_schema"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    _, rows = last_table(run.stdout)
    assert [(r[1], r[5]) for r in rows] == [("json_schema", "-")]  # no unguided to compare
    assert number(rows[0][3]) > 0 and "jump-forward" not in run.stdout


def test_bench_structured_output_prints_guided_next_to_unguided() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_structured_output.py"), "--batch-sizes", "1", "2",
         "--max-tokens", "16", "--repeats", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:]
    header, rows = last_table(run.stdout)
    assert header == ["batch", "config", "tokens", "decode tok/s", "ms/step", "vs unguided"]
    assert [(r[0], r[1]) for r in rows] == [(b, c) for b in ("1", "2")
                                            for c in ("unguided", "json_schema",
                                                      "json_schema+jump")]
    assert all(number(cell) > 0 for r in rows for cell in r[2:])
    assert run.stdout.count("compile ") == 3 and "cached" in run.stdout
    assert re.search(r"jump-forward: [1-9]\d* of \d+ forced tokens kept", run.stdout)
