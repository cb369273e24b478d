"""Kernel timings on the GPU, as the engine runs them (captured in CUDA graphs), or `--warm`.

- attention: decode attention at real head layouts, the project's Triton kernel next to
  FlashInfer's, through the attention backends' own CUDA-graph paths, per page size, batch
  size and context length (every request at that context, its pages scattered at random);
- sampling: temperature sampling (0.6, no top-k / top-p) from the model's bf16 logits, the
  Triton kernels next to the torch path (which first makes a float32 copy);
- logprobs: the log-probability statistics (logsumexp and the 5 or 20 most likely tokens)
  next to torch's log_softmax + topk;
- gemv (only when named in --parts): the shape's projections (qkv, o, gate_up, down) at the
  batch sizes up to 16, the FP8 GEMV (weights per output channel, and per 128 x 128 block)
  next to the bf16 GEMV and torch's linear (cuBLAS); GB/s counts the weight bytes. Each
  captured call reads another copy of the weight, so that the copies outgrow the L2 cache.

GB/s is the bytes a call reads (K/V, logits or weights) over its time, also as a share of
the copy bandwidth measured in the same run (read + write, so a read-only kernel can pass
100%). On CPU (a smoke test) the Triton kernels run in the interpreter, plain calls timed.

`--warm` compiles the GPU kernels ahead instead: FlashInfer JIT-compiles each kernel family on
first use (minutes on a fresh machine) and Triton the project's kernels, both into disk caches.
Each variant (shape x backend x page size) runs a 2-layer model of the shape through prefill,
chunked prefill with a cached prefix, eager and CUDA-graph decode, with temperature sampling.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.hardware import measure_copy_bandwidth
from minisgl_backend.benchmark.shapes import SHAPES, shape_config, write_config
from minisgl_backend.core import Batch, SamplingParams
from minisgl_backend.kvcache.pool import PagedKVPool

HEADER = ("part", "case", "kernel", "us/call", "GB/s", "of copy bw")
PARTS = ("attention", "sampling", "logprobs")
OPTIONAL_PARTS = ("gemv",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"],
                        choices=sorted(SHAPES))
    parser.add_argument("--parts", nargs="+", default=list(PARTS),
                        choices=PARTS + OPTIONAL_PARTS)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--calls", type=int, default=8, help="kernel calls per captured graph")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--warm", action="store_true", help="compile the kernels ahead")
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "auto"],
                        help="with --warm: the attention backends to compile for")


def time_per_call(fn: Callable[[], object], args: argparse.Namespace, device: torch.device,
                  before_replay: Callable[[], None] | None = None) -> float:
    """Seconds per `fn()`: on a GPU, `--calls` of them captured in one CUDA graph and replayed
    `--replays` times (`before_replay` runs between capture and replays); on CPU plain calls."""
    fn()  # compile / warm up outside the capture
    count = args.calls * args.replays
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - start) / count
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            fn()
    if before_replay is not None:
        before_replay()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / count


def attention_cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                    ) -> Iterator[tuple[str, str, int, float]]:
    """(case, kernel, bytes read, seconds) of decode attention, through the backends."""
    from minisgl_backend.attention.triton_backend import TritonAttentionBackend

    for shape, page, bs, context in itertools.product(args.shapes, args.page_sizes,
                                                      args.batch_sizes, args.context_lens):
        config = SHAPES[shape]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        pages = -(-context // page)
        pool = PagedKVPool(1, bs * pages, page, kv_heads, head_dim, dtype, device)
        pool.buffer[:, :, :bs * pages].normal_()
        table = torch.full((bs + 1, pages), pool.dummy_page, dtype=torch.int32, device=device)
        table[:bs] = torch.randperm(bs * pages, device=device).to(torch.int32).view(bs, pages)
        positions = torch.full((bs,), context - 1, dtype=torch.int64, device=device)
        batch = Batch(phase="decode", rows=torch.arange(bs, device=device),
                      input_ids=torch.zeros_like(positions), positions=positions,
                      out_slots=torch.full_like(positions, pool.dummy_slot),
                      extend_lens=[1] * bs, seq_lens=[context] * bs)
        q = torch.randn(bs, heads, head_dim, device=device, dtype=dtype)
        backends = {"triton": lambda: TritonAttentionBackend(pool, heads, head_dim)}
        if device.type == "cuda":
            from minisgl_backend.attention.flashinfer_backend import FlashInferAttentionBackend

            backends["flashinfer"] = lambda: FlashInferAttentionBackend(pool, heads, head_dim,
                                                                        device, pages)
        for name, make in backends.items():
            backend = make()
            call = lambda b=backend: b.forward(q, None, None, 0, batch)  # noqa: E731
            if device.type == "cuda":  # the engine's path: capture, then replay the real batch
                backend.init_cuda_graph(bs)
                backend.prepare_for_capture(batch, table)
                seconds = time_per_call(call, args, device, lambda b=backend: (
                    b.prepare_for_replay(batch, table)))
            else:
                backend.prepare(batch, table)
                seconds = time_per_call(call, args, device)
            yield (f"{shape} page {page} batch {bs} context {context}", name,
                   2 * bs * context * kv_heads * head_dim * pool.buffer.element_size(), seconds)
        del pool
        if device.type == "cuda":
            torch.cuda.empty_cache()


def logits_cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                 ) -> Iterator[tuple[str, str, dict[str, Callable[[], object]], int]]:
    """(part, case, {kernel: fn}, bytes read) of sampling and log-probabilities."""
    from kernels.logprobs import logprob_stats
    from kernels.sampling import sample_from_logits
    from minisgl_backend.core import RowSampling
    from minisgl_backend.engine.sampler import SamplingTensors, sample_with_torch

    size = torch.finfo(dtype).bits // 8
    vocabs = sorted({SHAPES[s]["vocab_size"] for s in args.shapes})
    for vocab, bs in itertools.product(vocabs, args.batch_sizes):
        logits = (torch.randn(bs, vocab, device=device) * 4).to(dtype)
        if "sampling" in args.parts:
            rows, table = np.arange(bs), RowSampling.table(bs)
            table.put(rows, RowSampling.of([(SamplingParams(temperature=0.6), i)
                                            for i in range(bs)], vocab))
            params = SamplingTensors.of(table, rows, device)
            uniform = torch.rand(bs, device=device, dtype=torch.float64)
            yield "sampling", f"vocab {vocab} batch {bs}", {
                "triton": lambda p=params, u=uniform, x=logits: sample_from_logits(
                    x, p.temperature, u),
                "torch": lambda p=params, u=uniform, x=logits: sample_with_torch(
                    x.float(), p, u)}, bs * vocab * size
        for top in (5, 20) if "logprobs" in args.parts else ():
            yield "logprobs", f"vocab {vocab} batch {bs} top {top}", {
                "triton": lambda x=logits, k=top: logprob_stats(x, k),
                "torch": lambda x=logits, k=top: torch.log_softmax(
                    x, dim=-1, dtype=torch.float32).topk(k)}, bs * vocab * size


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of a dense decoder layer's projections."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def _weight_copies(weight: torch.Tensor, count: int) -> Callable[[], torch.Tensor]:
    """A function returning `weight` and `count - 1` copies of it in turn."""
    copies = itertools.cycle([weight] + [weight.clone() for _ in range(count - 1)])
    return lambda: next(copies)


def gemv_cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
               ) -> Iterator[tuple[str, dict[str, tuple[Callable[[], object], int]]]]:
    """(case, {kernel: (fn, weight bytes)}) of the few-rows linear layers."""
    from kernels.fp8_gemv import fp8_gemv
    from kernels.gemv import MAX_ROWS, fused_gemv
    from minisgl_backend.quantization import fp8

    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    block = (128, 128)
    for shape in args.shapes:
        for name, (n, k) in projection_shapes(SHAPES[shape]).items():
            weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            per_channel = fp8.quantize_per_channel(weight)
            per_block = fp8.quantize_blocks(weight, block)
            size = weight.element_size() * n * k

            def cycle(w: torch.Tensor) -> Callable[[], torch.Tensor]:
                return _weight_copies(w, min(args.calls, 1 + l2 // (w.element_size() * n * k)))

            dense, channel, blocks = cycle(weight), cycle(per_channel[0]), cycle(per_block[0])
            for bs in [b for b in args.batch_sizes if b <= MAX_ROWS]:
                x = torch.randn(bs, k, device=device, dtype=dtype)
                yield f"{shape} {name} {n}x{k} batch {bs}", {
                    "torch linear": (lambda x=x: torch.nn.functional.linear(x, dense()),
                                     size),
                    "gemv": (lambda x=x: fused_gemv(x, dense()), size),
                    "fp8 gemv channel": (lambda x=x: fp8_gemv(x, channel(), per_channel[1]),
                                         n * k),
                    "fp8 gemv block": (lambda x=x: fp8_gemv(x, blocks(), per_block[1],
                                                            block=block), n * k)}
            del weight, dense, channel, blocks
            if device.type == "cuda":
                torch.cuda.empty_cache()


def warm(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    for shape, backend, page_size in itertools.product(args.shapes, args.backends,
                                                       args.page_sizes):
        with tempfile.TemporaryDirectory() as folder, cli.make_llm(
                args, write_config(shape_config(shape, 2), Path(folder)), load_format="dummy",
                attention_backend=backend, page_size=page_size, max_total_tokens=4096,
                cuda_graph_max_bs=4, max_running_requests=8, chunked_prefill_size=64) as llm:
            prompts = [[5 + i] * (40 + 30 * i) for i in range(4)]
            llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.6, ignore_eos=True))
            llm.generate([p + [9] * 20 for p in prompts], SamplingParams(max_tokens=3))
        print(f"{shape}, {backend}, page {page_size}: warm after "
              f"{time.perf_counter() - start:.1f} s", flush=True)


def run(args: argparse.Namespace) -> None:
    if args.warm:
        warm(args)
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_bw = measure_copy_bandwidth(device) if device.type == "cuda" else 0.0
    rows = []

    def add(part: str, case: str, kernel: str, nbytes: int, seconds: float) -> None:
        rate = nbytes / seconds
        rows.append([part, case, kernel, f"{seconds * 1e6:.2f}", f"{rate / 1e9:.3g}",
                     cli.percent(rate / copy_bw) if copy_bw else "-"])
        print(" | ".join(rows[-1]), flush=True)

    if "attention" in args.parts:
        for case, kernel, nbytes, seconds in attention_cases(args, device, dtype):
            add("attention", case, kernel, nbytes, seconds)
    for part, case, fns, nbytes in logits_cases(args, device, dtype):
        for kernel, fn in fns.items():
            add(part, case, kernel, nbytes, time_per_call(fn, args, device))
    if "gemv" in args.parts:
        for case, timed in gemv_cases(args, device, dtype):
            for kernel, (fn, nbytes) in timed.items():
                add("gemv", case, kernel, nbytes, time_per_call(fn, args, device))
    cli.report(args, f"each kernel against the other implementation of its case, and the "
               f"copy bandwidth ({copy_bw / 1e12:.3f} TB/s); {dtype}", HEADER, rows)
