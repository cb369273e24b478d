"""Smoke tests of the benchmark tool (`python -m minisgl_backend.benchmark`): tiny shapes or the
default model on CPU, each run in a subprocess, checked to exit 0 and end with a Markdown table
of positive numbers. The runs of the `outputs` fixture start together (they mostly wait on
engine start-up); the others run on their own.
"""

from __future__ import annotations

import os
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

REPO = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, "-m", "minisgl_backend.benchmark"]
COMMON = ["--device", "cpu", "--max-total-tokens", "4096"]
TINY_ANCHOR = ["--num-requests", "4", "--min-len", "4", "--max-len", "12"]
RUNS: dict[str, list[str]] = {
    "decode": ["decode", *COMMON, "--shape", "tiny-llama", "--batch-sizes", "1", "2",
               "--new-tokens", "48", "--prompt-len", "4", "--repeats", "2", "--copy-mib", "16"],
    "offline": ["offline", *COMMON, "--shape", "tiny-qwen3", *TINY_ANCHOR, "--detokenize",
                "both"],
    # Best of 2 over 24 tokens: one run of 12 left the off rate to noise.
    "speculative": ["speculative", *COMMON, "--shape", "tiny-llama", "--batch-sizes", "1", "2",
                    "--max-tokens", "24", "--prompt-len", "4", "--repeats", "2",
                    "--acceptance", "0.8"],
    "mechanisms": ["offline", *COMMON, "--shape", "tiny-qwen3-moe", "--num-requests", "3",
                   "--min-len", "4", "--max-len", "8", "--vary", "cuda_graph_max_bs=0",
                   "--vary", "overlap=false"],
    "prefix": ["offline", *COMMON, "--shape", "tiny-qwen3-moe", "--workload", "shared-prefix",
               "--num-requests", "3", "--prefix-len", "48", "--suffix-len", "4",
               "--max-tokens", "2", "--vary", "cache=naive"],
    "kv-events": ["offline", *COMMON, "--shape", "tiny-qwen3", *TINY_ANCHOR, "--page-size", "16",
                  "--vary", f"kv_events_endpoint=ipc:///tmp/minisgl-bench-test-{os.getpid()}"],
}
TIMEOUT_S = 300


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess]:
    procs = {name: subprocess.Popen([*TOOL, *args], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, args in RUNS.items()}
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


TEXT_COLUMNS = ("run", "detokenize", "workload", "config", "path", "part", "case", "kernel",
                "overlap", "outputs", "concurrency")


def check(run: subprocess.CompletedProcess, header: tuple[str, ...],
          may_be_zero: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """The run's table as records, each number positive (or zero where allowed)."""
    assert run.returncode == 0, run.stdout[-4000:]
    columns, rows = last_table(run.stdout)
    assert tuple(columns) == header
    records = [dict(zip(columns, row)) for row in rows]
    for record in records:
        for column, cell in record.items():
            if cell != "-" and column not in TEXT_COLUMNS:
                assert number(cell) > 0 or (column in may_be_zero and number(cell) == 0), record
    assert "command: python -m minisgl_backend.benchmark" in run.stdout
    assert "\ndate: " in run.stdout and "\ndevice: " in run.stdout and "\ncompared: " in run.stdout
    return records


OFFLINE = ("run", "detokenize", "requests", "input tokens", "output tokens", "total s",
           "output tok/s", "prompt cache hits", "vs first")


def test_decode(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    rows = check(outputs["decode"], ("run", "batch", "new tokens", "decode tok/s", "ms/step",
                                     "roofline tok/s", "of roofline", "vs first"))
    assert [r["batch"] for r in rows] == ["1", "2"]
    assert rows[0]["roofline tok/s"] != "-" and rows[1]["roofline tok/s"] == "-"


def test_speculative_with_synthetic_acceptance(
        outputs: dict[str, subprocess.CompletedProcess]) -> None:
    """Off and with synthetic acceptance, per batch size; the roofline at batch 1."""
    rows = check(outputs["speculative"], ("workload", "batch", "config", "tokens",
                                          "decode tok/s", "vs off", "acceptance", "of roofline"))
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in ("1", "2") for c in ("off", "ngram p=0.8")]
    assert rows[1]["acceptance"] != "-" and rows[0]["of roofline"] != "-"


def test_offline(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    """Without, then with the shape's tokenizer in the model folder (the outputs have text)."""
    run = outputs["offline"]
    rows = check(run, OFFLINE, may_be_zero=("prompt cache hits",))
    assert [(r["run"], r["detokenize"], r["requests"]) for r in rows] == [
        ("default", "off", "4"), ("default", "on", "4")]
    expected = anchor_workload(SHAPES["tiny-qwen3"]["vocab_size"], 4, 4, 12)
    assert all(int(r["output tokens"]) == expected.output_tokens for r in rows)
    assert rows[0]["vs first"] == "1.00x"
    assert "tokenizer 'word-level'" in run.stdout
    for setting in ("off", "on"):  # the collector's pauses in each timed call
        assert re.search(rf"garbage collector, default, detokenize {setting} .*: \d+ full "
                         rf"collections", run.stdout)


def test_offline_varies_engine_settings(outputs: dict[str, subprocess.CompletedProcess]) -> None:
    """CUDA graphs and overlap off against the default on the anchor workload, the naive cache
    against the radix one on the shared-prefix workload."""
    rows = check(outputs["mechanisms"], OFFLINE, may_be_zero=("prompt cache hits",))
    assert [r["run"] for r in rows] == ["default", "cuda_graph_max_bs=0", "overlap=false"]
    assert rows[0]["vs first"] == "1.00x"
    rows = check(outputs["prefix"], OFFLINE, may_be_zero=("prompt cache hits",))
    assert [r["run"] for r in rows] == ["default", "cache=naive"]
    assert rows[1]["prompt cache hits"] == "0.0%"  # the naive cache never shares


def test_offline_with_kv_events_drains_them(outputs: dict[str, subprocess.CompletedProcess]
                                            ) -> None:
    """Events on against off; the run with them has a subscriber that received them."""
    run = outputs["kv-events"]
    rows = check(run, OFFLINE, may_be_zero=("prompt cache hits",))
    assert [r["run"].split("=")[0] for r in rows] == ["default", "kv_events_endpoint"]
    drained = re.search(r"KV-cache events drained: (\d+) messages, (\d+) bytes", run.stdout)
    assert drained and int(drained[1]) > 0 and int(drained[2]) > 0, run.stdout[-2000:]


def test_offline_replays_the_detokenizer_alone() -> None:
    run = tool("offline", "--device", "cpu", "--shape", "tiny-llama", *TINY_ANCHOR,
               "--detokenize", "replay")
    assert run.returncode == 0, run.stdout[-3000:]
    expected = anchor_workload(SHAPES["tiny-llama"]["vocab_size"], 4, 4, 12)
    assert f"tokenizer 'word-level', random outputs of the anchor workload (4 requests, " \
        f"{expected.output_tokens} tokens): " in run.stdout


def test_offline_compares_with_hf_transformers() -> None:
    """The default model's greedy tokens equal HF's on the same prompt ids."""
    run = tool("offline", "--device", "cpu", "--workload", "chat", "--num-requests", "2",
               "--max-tokens", "4", "--compare-hf")
    rows = check(run, OFFLINE, may_be_zero=("prompt cache hits",))
    assert [r["run"] for r in rows] == ["default", "HF batched (left pad)",
                                        "HF one prompt at a time"]
    assert all(r["output tokens"] == "8" for r in rows)
    assert "greedy tokens: 2/2 prompts identical to HF's" in run.stdout


def test_serving() -> None:
    """The offline API and tritonserver + perf_analyzer on the same 4 requests (CPU, about
    30 s), the server's engine settings those of the offline rows."""
    run = tool("serving", *COMMON, "--shape", "tiny-qwen3", *TINY_ANCHOR, "--concurrency", "2",
               "--chunked-prefill-size", "64")
    records = check(run, ("concurrency", "path", "requests", "output tokens", "seconds",
                          "output tok/s", "vs offline", "mean TTFT ms", "mean ITL ms",
                          "mean in flight"))
    offline, served = "offline API", "tritonserver + perf_analyzer"
    assert [(r["concurrency"], r["path"]) for r in records] == [
        ("all", offline), ("2", offline), ("2", served)]
    expected = anchor_workload(SHAPES["tiny-qwen3"]["vocab_size"], 4, 4, 12)
    assert all(r["requests"] == "4" and int(r["output tokens"]) == expected.output_tokens
               for r in records)
    assert [r["vs offline"] for r in records[:2]] == ["-", "-"]
    assert records[2]["vs offline"].endswith("%") and number(records[2]["vs offline"]) > 0
    assert number(records[2]["mean in flight"]) <= 2  # perf_analyzer kept at most 2 in flight
    assert "'chunked_prefill_size': '64'" in run.stdout  # the server's engine settings


def test_openai_api_against_grpc() -> None:
    """The same 4 streamed requests through the OpenAI front door and straight to minisgl."""
    run = tool("openai_api", *COMMON, "--shape", "tiny-qwen3", "--concurrency", "2",
               "--requests", "4", "--prompt-tokens", "8", "--output-tokens", "4",
               "--repeats", "1")
    records = check(run, ("path", "concurrency", "requests", "output tokens", "seconds",
                          "output tok/s", "vs gRPC"))
    assert [r["path"] for r in records] == ["minisgl over gRPC", "OpenAI front door"]
    assert all(r["requests"] == "4" and r["output tokens"] == "16" for r in records)
    assert records[0]["vs gRPC"] == "1.00x" and number(records[1]["vs gRPC"]) > 0


def test_controls_side_by_side() -> None:
    run = tool("controls", *COMMON, "--shape", "tiny-qwen3", "--batch-sizes", "1", "2",
               "--max-tokens", "32", "--prompt-len", "4", "--repeats", "2",
               "--each")  # enough decode steps that noise cannot hide them
    rows = check(run, ("batch", "config", "decode tok/s", "ms/step", "vs none"))
    configs = ["none", "all", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_p", "logit_bias", "bad_token_ids", "logprobs"]
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in ("1", "2") for c in configs]
    assert [r["vs none"] for r in rows if r["config"] == "none"] == ["1.00x", "1.00x"]
    assert "penalties 760,320 B/row = 194.6 MB" in run.stdout


def test_controls_run_the_configs_asked_for() -> None:
    run = tool("controls", *COMMON, "--shape", "tiny-qwen3", "--batch-sizes", "1",
               "--max-tokens", "32", "--prompt-len", "4", "--repeats", "2", "--configs",
               "logprobs", "min_p")
    rows = check(run, ("batch", "config", "decode tok/s", "ms/step", "vs none"))
    assert [(r["config"], r["vs none"]) for r in rows] == [("logprobs", "-"), ("min_p", "-")]


STRUCTURED = ("batch", "config", "tokens", "decode tok/s", "ms/step", "vs unguided")


def test_structured_needs_a_tokenizer_that_spells_json() -> None:
    run = tool("structured", "--shape", "qwen3-0.6b")
    assert run.returncode == 1 and "cannot spell JSON: give --tokenizer" in run.stdout


def test_structured_runs_the_configs_asked_for() -> None:
    run = tool("structured", "--device", "cpu", "--batch-sizes", "2", "--max-tokens", "8",
               "--repeats", "1", "--configs", "json_schema")
    rows = check(run, STRUCTURED)
    assert [(r["config"], r["vs unguided"]) for r in rows] == [("json_schema", "-")]
    assert "jump-forward" not in run.stdout


def test_structured_next_to_unguided() -> None:
    run = tool("structured", "--device", "cpu", "--batch-sizes", "1", "2", "--max-tokens", "16",
               "--repeats", "1")
    rows = check(run, STRUCTURED)
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in ("1", "2") for c in ("unguided", "json_schema", "json_schema+jump")]
    assert run.stdout.count("compile ") == 3 and "cached" in run.stdout
    assert re.search(r"jump-forward: [1-9]\d* of \d+ forced tokens kept", run.stdout)


def test_speculative_on_the_default_model() -> None:
    run = tool("speculative", "--device", "cpu", "--batch-sizes", "1", "--max-tokens", "12",
               "--repeats", "1")
    rows = check(run, ("workload", "batch", "config", "tokens", "decode tok/s", "vs off",
                       "acceptance", "of roofline"), may_be_zero=("acceptance",))
    assert [(r["workload"], r["config"]) for r in rows] == [
        (w, c) for w in ("repetitive", "chat") for c in ("off", "ngram", "suffix")]
    assert len({r["tokens"] for r in rows if r["workload"] == "repetitive"}) == 1  # the same
    assert number(rows[1]["acceptance"]) > 0  # ngram kept drafts on repetitions


def test_kernels_on_cpu() -> None:
    """The Triton kernels in the interpreter: decode attention, sampling and log-probabilities
    next to the torch path."""
    run = tool("kernels", "--device", "cpu", "--shapes", "tiny-qwen3", "--batch-sizes", "2",
               "--context-lens", "40", "--page-sizes", "16", "--calls", "1", "--replays", "1")
    rows = check(run, ("part", "case", "kernel", "us/call", "GB/s", "of copy bw"))
    assert [(r["part"], r["kernel"]) for r in rows] == [
        ("attention", "triton"), ("sampling", "triton"),
        ("sampling", "torch"), *[("logprobs", k) for _ in (5, 20) for k in ("triton", "torch")]]


def test_kernels_warm_every_variant() -> None:
    run = tool("kernels", "--warm", "--device", "cpu", "--shapes", "tiny-qwen3", "tiny-llama",
               "--backends", "torch", "--page-sizes", "16", "1")
    assert run.returncode == 0, run.stdout[-3000:]
    lines = [line for line in run.stdout.splitlines() if "warm after" in line]
    assert [line.split(":")[0] for line in lines] == [
        "tiny-qwen3, torch, page 16", "tiny-qwen3, torch, page 1",
        "tiny-llama, torch, page 16", "tiny-llama, torch, page 1"]


def test_scheduler_runs_the_workload_through_the_real_scheduler() -> None:
    """Every requested token comes back through the scheduler with the instant engine, with
    overlap on and off, outputs streamed or whole."""
    run = tool("scheduler", "--num-requests", "12", "--min-len", "4", "--max-len", "40",
               "--page-sizes", "1", "16", "--repeats", "1", "--max-running-requests", "5",
               "--chunked-prefill-size", "32")
    rows = check(run, ("requests", "output tokens", "steps", "page", "overlap", "outputs",
                       "total s", "us/step", "us/output token"))
    assert [(r["page"], r["overlap"], r["outputs"]) for r in rows] == [
        (page, overlap, outputs) for page in ("1", "16") for overlap in ("on", "off")
        for outputs in ("stream", "whole")]
    workload = anchor_workload(151936, 12, 4, 40)
    assert all(int(r["output tokens"]) == workload.output_tokens for r in rows)


def test_scheduler_times_guided_steps_against_unguided() -> None:
    """--guided-batch: every token of the JSON-schema requests is one their grammar allowed (a
    request with one it did not would end in an error, which the run raises)."""
    run = tool("scheduler", "--guided-batch", "16", "--max-tokens", "24", "--repeats", "1")
    rows = check(run, ("batch", "config", "overlap", "outputs", "steps", "us/step",
                       "vs unguided"))
    assert [(r["config"], r["overlap"], r["outputs"]) for r in rows] == [
        (config, overlap, outputs) for overlap in ("on", "off") for outputs in ("stream", "whole")
        for config in ("unguided", "json_schema")]
    assert all(r["steps"] == "23" for r in rows)  # decode steps


def test_suite_skips_steps_that_do_not_fit(tmp_path: Path) -> None:
    """A budget below every step's limit: each step says it was skipped, none runs."""
    run = tool("suite", str(tmp_path), "--budget-s", "1", "--steps", "offline", "tp")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "== offline-qwen3-0.6b: skipped (budget)" in run.stdout
    assert "== offline-llama-3.1-8b-tp2: skipped (budget)" in run.stdout
    assert not list(tmp_path.glob("offline-*.log"))


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
