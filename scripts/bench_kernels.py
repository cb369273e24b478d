"""Kernel-level timings on the GPU, as the engine runs them (captured in CUDA graphs).

1. Decode attention at real head layouts: the project's Triton kernel (default tiles, or a
   sweep of tiles, pipeline stages, warps and split limits) next to FlashInfer's
   decode, through the attention backends' own CUDA-graph paths, for each page size, batch size
   and context length; K/V bytes read per call / time = achieved bandwidth, also as a share of
   the copy bandwidth measured in the same run.
2. SiLU-and-mul: the Triton kernel next to FlashInfer's, per token count.
3. Sampling (temperature 0.6, no top-k / top-p) from the model's bf16 logits: the Triton
   kernels next to the torch path (which first makes a float32 copy), per vocabulary and batch
   size; log-probability statistics (the logsumexp and the 5 or 20 most likely tokens,
   `kernels/logprobs.py`) next to torch's log_softmax and topk, the same way; and the host's
   time per call of what a step launches around sampling (`--parts host`: small logits, so
   the device idles and a loop's wall time is the host's; not in a graph, as the engine
   launches them); and (`--parts edits`) the device time of bench_sampling_controls' "all"
   edits into a copy plus the sampling after them, per context length: penalties sparse or
   dense, min_p's floor written or left to the sampling kernels (`kernels/logit_edits.py`).
4. The attention prologue (q/k norm for Qwen3, RoPE, KV store) per token count, with 1, 2, 4
   and 8 heads per program.
5. A decoder layer's four projections at batch sizes up to 16, as the layer runs them (FlashInfer
   add-RMSNorm / SiLU-and-mul next to cuBLAS) and as one fused Triton GEMV each (norm or
   SiLU-and-mul folded in front, the residual add behind; `kernels/gemv.py`), with the
   weights' read bandwidth; `--sweep` times the GEMV's tile variants.

    python scripts/bench_kernels.py --shapes llama-3.1-8b qwen3-0.6b --batch-sizes 1 64 256 \\
        --context-lens 256 1024 2048 --page-sizes 16 64 --sweep
    python scripts/bench_kernels.py --device cpu --shapes tiny-qwen3 --batch-sizes 2 \\
        --context-lens 40 --page-sizes 16 --calls 1 --replays 1    # smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl_backend.attention.base import AttentionBackend
from minisgl_backend.benchmark.cli import markdown_table, percent
from minisgl_backend.benchmark.hardware import measure_copy_bandwidth
from minisgl_backend.benchmark.shapes import SHAPES
from minisgl_backend.core import Batch
from minisgl_backend.kvcache.pool import PagedKVPool

if TYPE_CHECKING:
    from kernels.gemv import GemvLaunch
    from minisgl_backend.engine.controls import LogitControls

ATTENTION_HEADER = ("shape", "page", "batch", "context", "kernel", "us/call", "GB/s",
                    "of copy bw")
SILU_HEADER = ("width", "tokens", "kernel", "us/call")
SAMPLING_HEADER = ("vocab", "batch", "sampler", "us/call")
LOGPROBS_HEADER = ("vocab", "batch", "top", "kernel", "us/call")
PROLOGUE_HEADER = ("shape", "tokens", "heads per program", "us/call")
GEMV_HEADER = ("shape", "projection", "batch", "path", "us/call", "weights GB/s", "of copy bw")
HOST_HEADER = ("batch", "call", "host us/call")
EDITS_HEADER = ("vocab", "batch", "context", "penalties", "min_p floor", "us/call")
PARTS = ("attention", "silu", "sampling", "logprobs", "host", "edits", "prologue", "gemv")
HOST_VOCAB = 4096  # small logits for the host part: the device idles between calls
HOST_LOGPROBS = 5  # log-probabilities per row in the host part
L2_DEFEAT_BYTES = 200 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"],
                        choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--sweep", action="store_true",
                        help="time every Triton decode variant, not only the default")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--silu-tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--calls", type=int, default=8, help="kernel calls per captured graph")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="which tables to make")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return parser.parse_args(argv)


def time_per_call(fn: Callable[[], object], calls: int, replays: int, device: torch.device,
                  before_replay: Callable[[], None] | None = None) -> float:
    """Seconds per `fn()`: on a GPU, `calls` of them captured in one CUDA graph and replayed
    `replays` times (`before_replay` runs between capture and replays); on CPU (a smoke test)
    plain calls."""
    fn()  # compile / warm up outside the capture
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(replays * calls):
            fn()
        return (time.perf_counter() - start) / (replays * calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    if before_replay is not None:
        before_replay()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / (replays * calls)


def time_each(fns: dict[str, Callable[[], object]], args: argparse.Namespace,
              device: torch.device, row: Callable[[str, float], list[str]]) -> list[list[str]]:
    """`time_per_call` of each function; one table row per function, `row(name, seconds)`,
    printed as it comes."""
    rows = []
    for name, fn in fns.items():
        rows.append(row(name, time_per_call(fn, args.calls, args.replays, device)))
        print(" | ".join(rows[-1]), flush=True)
    return rows


# ----- decode attention -------------------------------------------------------------------------


def triton_variants(sweep: bool) -> dict[str, dict[str, object]]:
    """Name -> TritonAttentionBackend keyword arguments."""
    from kernels.decode_attention import DecodeLaunch

    variants: dict[str, dict[str, object]] = {"triton": {}}
    if not sweep:
        return variants
    for block_n, warps, stages in itertools.product((32, 64), (4, 8), (2, 3, 4)):
        variants[f"triton n{block_n} w{warps} s{stages}"] = {
            "decode_launch": DecodeLaunch(block_n=block_n, num_warps=warps, num_stages=stages)}
    for max_splits in (4, 32):
        variants[f"triton max splits {max_splits}"] = {"max_splits": max_splits}
    return variants


def decode_world(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, bs: int,
                 context: int, device: torch.device, dtype: torch.dtype
                 ) -> tuple[PagedKVPool, torch.Tensor, Batch, torch.Tensor]:
    """One layer's pool full of random K/V, every request's pages scattered at random."""
    pages_per_req = -(-context // page_size)
    num_pages = bs * pages_per_req
    pool = PagedKVPool(1, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
    pool.buffer[:, :, :num_pages].normal_()
    pages = torch.randperm(num_pages, device=device, dtype=torch.int64).to(torch.int32)
    page_table = torch.full((bs + 1, pages_per_req), pool.dummy_page, dtype=torch.int32,
                            device=device)
    page_table[:bs] = pages.view(bs, pages_per_req)
    rows = torch.arange(bs, device=device)
    positions = torch.full((bs,), context - 1, dtype=torch.int64, device=device)
    batch = Batch(phase="decode", rows=rows, input_ids=torch.zeros_like(positions),
                  positions=positions,
                  out_slots=torch.full_like(positions, pool.dummy_slot),
                  extend_lens=[1] * bs, seq_lens=[context] * bs)
    q = torch.randn(bs, num_heads, head_dim, device=device, dtype=dtype)
    return pool, page_table, batch, q


def time_decode(backend: AttentionBackend, batch: Batch, page_table: torch.Tensor,
                q: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """The engine's decode path: capture with the graph metadata (placeholder pages), then
    replay with the real batch's."""
    def call() -> object:
        return backend.forward(q, None, None, 0, batch)

    if device.type != "cuda":
        backend.prepare(batch, page_table)
        return time_per_call(call, args.calls, args.replays, device)
    backend.init_cuda_graph(batch.size)
    backend.prepare_for_capture(batch, page_table)
    return time_per_call(call, args.calls, args.replays, device,
                         before_replay=lambda: backend.prepare_for_replay(batch, page_table))


def bench_decode_case(args: argparse.Namespace, device: torch.device, copy_bw: float,
                      shape: str, page_size: int, bs: int, context: int) -> list[list[str]]:
    from minisgl_backend.attention.triton_backend import TritonAttentionBackend

    config = SHAPES[shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool, page_table, batch, q = decode_world(heads, kv_heads, head_dim, page_size, bs, context,
                                              device, dtype)
    kv_bytes = 2 * bs * context * kv_heads * head_dim * pool.buffer.element_size()
    backends: dict[str, Callable[[], AttentionBackend]] = {
        name: (lambda kw=kwargs: TritonAttentionBackend(pool, heads, head_dim, **kw))
        for name, kwargs in triton_variants(args.sweep).items()}
    if device.type == "cuda" and not args.no_flashinfer:
        from minisgl_backend.attention.flashinfer_backend import FlashInferAttentionBackend

        backends["flashinfer"] = lambda: FlashInferAttentionBackend(
            pool, heads, head_dim, device, page_table.shape[1])
    rows: list[list[str]] = []
    for name, make in backends.items():
        seconds = time_decode(make(), batch, page_table, q, args, device)
        rate = kv_bytes / seconds
        rows.append([shape, str(page_size), str(bs), str(context), name, f"{seconds * 1e6:.1f}",
                     f"{rate / 1e9:,.0f}", percent(rate / copy_bw) if copy_bw else "-"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def bench_decode(args: argparse.Namespace, device: torch.device, copy_bw: float
                 ) -> list[list[str]]:
    rows: list[list[str]] = []
    for shape, page_size, bs, context in itertools.product(
            args.shapes, args.page_sizes, args.batch_sizes, args.context_lens):
        rows += bench_decode_case(args, device, copy_bw, shape, page_size, bs, context)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----- SiLU-and-mul -----------------------------------------------------------------------------


def bench_silu(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    from kernels.activation import silu_and_mul as triton_silu_and_mul
    from minisgl_backend.layers.fast_ops import flashinfer_module

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flashinfer = flashinfer_module() if device.type == "cuda" else None
    widths = sorted({SHAPES[s]["intermediate_size"] for s in args.shapes})
    rows: list[list[str]] = []
    for width, tokens in itertools.product(widths, args.silu_tokens):
        x = torch.randn(tokens, 2 * width, device=device, dtype=dtype)
        out = torch.empty(tokens, width, device=device, dtype=dtype)
        kernels: dict[str, Callable[[], object]] = {
            "triton": lambda: triton_silu_and_mul(x, out=out)}
        if flashinfer is not None:
            kernels["flashinfer"] = lambda: flashinfer.activation.silu_and_mul(x, out=out)
        rows += time_each(kernels, args, device, lambda name, seconds: [
            str(width), str(tokens), name, f"{seconds * 1e6:.2f}"])
    return rows


# ----- sampling ---------------------------------------------------------------------------------


def bench_sampling(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    from kernels.sampling import sample_from_logits
    from minisgl_backend.engine.sampler import make_sampling_tensors, sample_with_torch

    vocabs = sorted({SHAPES[s]["vocab_size"] for s in args.shapes})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[list[str]] = []
    for vocab, bs in itertools.product(vocabs, args.batch_sizes):
        logits = (torch.randn(bs, vocab, device=device) * 4).to(dtype)
        params = make_sampling_tensors([0.6] * bs, [-1] * bs, [1.0] * bs, list(range(bs)),
                                       [1] * bs, device)
        params.any_filtered = False
        uniform = torch.rand(bs, device=device, dtype=torch.float64)
        chunks = (1024, 2048, 4096, 8192) if args.sweep else (None,)
        samplers: dict[str, Callable[[], object]] = {
            "triton" + (f" chunk {c}" if c else ""): (
                lambda c=c: sample_from_logits(logits, params.temperature, params.top_k,
                                               uniform, **({"chunk": c} if c else {})))
            for c in chunks}
        samplers["torch"] = lambda: sample_with_torch(logits.float(), params, uniform)
        rows += time_each(samplers, args, device, lambda name, seconds: [
            str(vocab), str(bs), name, f"{seconds * 1e6:.1f}"])
    return rows


def bench_logprobs(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    from kernels.logprobs import logprob_stats

    vocabs = sorted({SHAPES[s]["vocab_size"] for s in args.shapes})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[list[str]] = []
    for vocab, bs, top in itertools.product(vocabs, args.batch_sizes, (5, 20)):
        logits = (torch.randn(bs, vocab, device=device) * 4).to(dtype)
        kernels: dict[str, Callable[[], object]] = {
            "triton": lambda: logprob_stats(logits, top),
            "torch": lambda: torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(top)}
        rows += time_each(kernels, args, device, lambda name, seconds: [
            str(vocab), str(bs), str(top), name, f"{seconds * 1e6:.1f}"])
    return rows


def host_seconds(fn: Callable[[], object], calls: int, device: torch.device,
                 rounds: int = 5) -> float:
    """The host's seconds per `fn()`: the best of `rounds` loops of `calls`, the device
    synchronized before and after each (outside the timing)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best


def bench_host(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    """Host time of a step's calls around sampling, through the engine's own entry points
    (HOST_LOGPROBS per row: `LogitControls.sampled_logprobs` for a step whose logits no
    control changes, `raw_logprobs` and `report` for one they do)."""
    import numpy as np

    from kernels.sampling import sample_from_logits
    from minisgl_backend.engine.controls import LogitControls, RowParams
    from minisgl_backend.engine.protocol import LogprobColumns

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    width = LogprobColumns(HOST_LOGPROBS).width
    rows: list[list[str]] = []
    for bs in args.batch_sizes:
        logits = (torch.randn(bs, HOST_VOCAB, device=device) * 4).to(dtype)
        batch = np.arange(bs)
        params = RowParams(bs)
        params.admit(batch, {"logprobs": np.full(bs, HOST_LOGPROBS)})
        controls = LogitControls(params, bs, HOST_VOCAB,
                                 torch.zeros(bs, 2, dtype=torch.int32, device=device))
        tokens = torch.randint(0, HOST_VOCAB, (bs,), device=device)
        raw = controls.raw_logprobs(logits, batch)
        assert raw is not None
        temperature = torch.full((bs,), 0.6, device=device)
        top_k = torch.full((bs,), -1, dtype=torch.int32, device=device)
        uniform = torch.rand(bs, device=device, dtype=torch.float64)
        seeds, positions = torch.arange(bs, device=device), torch.full((bs,), 77, device=device)
        edits, next_t = _edit_controls(bs, device), torch.full((bs,), 40, device=device)
        batch_t, lens = torch.arange(bs, device=device), np.full(bs, 40)
        calls: dict[str, Callable[[], object]] = {
            "torch.empty": lambda: torch.empty(bs, width, device=device),  # the step's table
            "argmax": lambda: torch.argmax(logits, dim=-1),
            "sample_from_logits": lambda: sample_from_logits(logits, temperature, top_k,
                                                             uniform),
            "sample_from_logits seeded": lambda: sample_from_logits(
                logits, temperature, top_k, seed=seeds, position=positions),
            "LogitControls.sampled_logprobs": lambda: controls.sampled_logprobs(logits, batch,
                                                                                tokens),
            "LogitControls.raw_logprobs": lambda: controls.raw_logprobs(logits, batch),
            "LogitControls.report": lambda: controls.report(raw, batch, tokens),
            # Every control of bench_sampling_controls' "all" on each row, as a step runs them.
            "all: LogitControls.apply keep_raw": lambda: edits.apply(
                logits, batch, batch_t, next_t, lens, keep_raw=True, leave_floor=True),
            "all: LogitControls.record": lambda: edits.record(batch, batch_t, tokens, lens),
            "all: LogitControls.sampled_logprobs": lambda: edits.sampled_logprobs(logits, batch,
                                                                                  tokens)}
        for name, fn in calls.items():
            seconds = host_seconds(fn, args.calls * args.replays, device)
            rows.append([str(bs), name, f"{seconds * 1e6:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def bench_edits(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    """Device time of the "all" edits into a copy (a step with log-probabilities) and the
    sampling after them, for rows whose `context` tokens are all prompt."""
    import numpy as np

    from kernels.logit_edits import SPARSE_POSITIONS, apply_edits
    from kernels.sampling import sample_from_logits

    vocabs = sorted({SHAPES[s]["vocab_size"] for s in args.shapes})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[list[str]] = []
    for vocab, bs, context in itertools.product(vocabs, args.batch_sizes, args.context_lens):
        logits = (torch.randn(bs, vocab, device=device) * 4).to(dtype)
        out = torch.empty_like(logits)
        controls = _edit_controls(bs, device, vocab, context)
        edits = controls._edit_rows(np.arange(bs), every_row=True)  # what `apply` uploads
        assert edits.min_p is not None
        table_rows, next_t = torch.arange(bs, device=device), torch.full((bs,), context,
                                                                           device=device)
        temperature = torch.full((bs,), 0.7, device=device)
        top_k = torch.full((bs,), -1, dtype=torch.int64, device=device)
        seeds = torch.arange(bs, device=device)

        def step(sparse_limit: int, left: bool) -> None:
            apply_edits(logits, out, edits.program_rows, table_rows, next_t, edits.factors,
                        edits.tables, edits.flags, min_p=edits.min_p, floor=not left,
                        sparse_limit=sparse_limit)
            sample_from_logits(out, temperature, top_k, seed=seeds, position=next_t,
                               min_p=edits.min_p if left else None)

        variants = {(penalties, floor): (lambda limit=limit, left=left: step(limit, left))
                    for penalties, limit in (("dense", 0), ("sparse", SPARSE_POSITIONS))
                    for floor, left in (("written", False), ("in sampling", True))}
        for (penalties, floor), fn in variants.items():
            seconds = time_per_call(fn, args.calls, args.replays, device)
            rows.append([str(vocab), str(bs), str(context), penalties, floor,
                         f"{seconds * 1e6:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def _edit_controls(bs: int, device: torch.device, vocab: int = HOST_VOCAB, prompt: int = 40
                   ) -> LogitControls:
    """Controls of `bs` table rows, each admitted with bench_sampling_controls' "all" settings
    (penalties, min_p, 50 bias entries, 6 bad-word sequences, logprobs) and a `prompt`-token
    prompt of random ids below `vocab`."""
    import numpy as np
    from bench_sampling_controls import configurations

    from minisgl_backend.engine.controls import LogitControls, RowParams
    from minisgl_backend.engine.protocol import StepMessage

    settings = configurations(vocab, each=False)["all"]
    bias, bans = settings.pop("logit_bias"), settings.pop("bad_token_ids")
    rows = np.arange(bs)
    admit = {name: np.full(bs, value) for name, value in settings.items()}
    admit["temperature"] = np.full(bs, 0.7)
    params = RowParams(bs)
    params.admit(rows, admit)
    pool = torch.randint(0, vocab, (bs, prompt + 24), dtype=torch.int32, device=device)
    controls = LogitControls(params, bs, vocab, pool)
    controls.admit(StepMessage(
        is_prefill=True, admit_rows=rows.tolist(), admit=admit, prompt_rows=rows.tolist(),
        prompt_counts=[prompt] * bs, prompt_tokens=pool[:, :prompt].flatten().tolist(),
        bias_rows=rows.tolist(), bias_counts=[len(bias)] * bs,
        bias_ids=[int(t) for t in bias] * bs, bias_values=list(bias.values()) * bs,
        ban_rows=np.repeat(rows, len(bans)).tolist(), ban_lens=[len(b) for b in bans] * bs,
        ban_tokens=[t for b in bans for t in b] * bs))
    return controls


# ----- attention prologue -----------------------------------------------------------------------


def bench_prologue(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    from kernels.qkv_prologue import fused_qk_norm_rope_store
    from minisgl_backend.layers.rotary import RotaryEmbedding, rope_inv_freq
    from minisgl_backend.models.config import RopeConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[list[str]] = []
    for shape, tokens in itertools.product(args.shapes, args.batch_sizes):
        config = SHAPES[shape]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
        rope = RotaryEmbedding(rope_inv_freq(head_dim, RopeConfig(theta=1e6)), 32768)
        rope.to(device)
        cache = rope.cos_sin_cache()
        positions = torch.randint(0, 4096, (tokens,), device=device)
        pool = PagedKVPool(1, -(-tokens // 16) + 1, 16, kv_heads, head_dim, dtype, device)
        slots = torch.randperm(tokens, device=device)
        norm = torch.ones(head_dim, device=device, dtype=dtype) \
            if config["model_type"].startswith("qwen3") else None
        out = torch.empty_like(q)
        calls: dict[str, Callable[[], object]] = {
            str(n): lambda n=n: fused_qk_norm_rope_store(
                q, k, v, positions, cache, slots, pool.k_cache(0), pool.v_cache(0),
                q_norm_weight=norm, k_norm_weight=norm, out=out, heads_per_program=n)
            for n in (1, 2, 4, 8)}
        rows += time_each(calls, args, device, lambda name, seconds: [
            shape, str(tokens), name, f"{seconds * 1e6:.2f}"])
    return rows


# ----- decoder-layer projections at small batch ------------------------------------------------


def gemv_variants(sweep: bool, rows: int) -> dict[str, GemvLaunch | None]:
    """Name -> fused_gemv launch (None: its default for the rows)."""
    from kernels.gemv import FMA_MAX_ROWS, GemvLaunch

    if not sweep:
        return {"fused Triton": None}
    variants: dict[str, GemvLaunch | None] = {
        f"fused Triton n{n} k{k} s{s}": GemvLaunch(block_n=n, block_k=k, use_dot=True,
                                                   num_stages=s)
        for n, k, s in itertools.product((16, 32), (128, 256, 512), (3, 4))}
    if rows <= FMA_MAX_ROWS:
        variants |= {f"fused Triton fma n{n} k{k} w{w}": GemvLaunch(
            block_n=n, block_k=k, use_dot=False, num_warps=w)
            for n, k, w in itertools.product((4, 8, 16), (256, 512), (4, 8))}
    return variants


def bench_gemv(args: argparse.Namespace, device: torch.device, copy_bw: float
               ) -> list[list[str]]:
    import torch.nn.functional as F

    from kernels.gemv import MAX_ROWS, fused_gemv
    from minisgl_backend.layers import fast_ops

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[list[str]] = []
    for shape in args.shapes:
        config = SHAPES[shape]
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        projections = {  # name -> (N, K, prologue, residual epilogue)
            "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, "norm", False),
            "o": (hidden, heads * head_dim, None, True),
            "gate_up": (2 * inter, hidden, "norm", False),
            "down": (hidden, inter, "gated", True),
        }
        for bs in (b for b in args.batch_sizes if b <= MAX_ROWS):
            for name, (n, k, prologue, add) in projections.items():
                # Successive calls read different copies of the weight (>= 4x the H200's 50 MB
                # L2 in all), as the layers of a model do: one copy would be served from L2.
                weight_bytes = n * k * torch.finfo(dtype).bits // 8
                copies = -(-L2_DEFEAT_BYTES // weight_bytes) if device.type == "cuda" else 1
                weights = itertools.cycle([torch.randn(n, k, device=device, dtype=dtype) / k**0.5
                                           for _ in range(copies)])
                x = torch.randn(bs, 2 * k if prologue == "gated" else k, device=device,
                                dtype=dtype)
                residual = torch.randn(bs, n if add else k, device=device, dtype=dtype)
                norm_w = torch.ones(k, device=device, dtype=dtype)
                out = torch.empty(bs, n, device=device, dtype=dtype)

                def layer_ops() -> object:
                    """What the decoder layer runs today around this projection."""
                    if prologue == "norm":  # add-RMSNorm (in place) in front
                        y, _ = fast_ops.add_rms_norm(x, residual, norm_w, 1e-5)
                        return F.linear(y, next(weights), out=out)
                    if prologue == "gated":
                        return F.linear(fast_ops.silu_and_mul(x), next(weights), out=out)
                    return F.linear(x, next(weights), out=out)  # the add waits for the next norm

                paths: dict[str, Callable[[], object]] = {
                    "cuBLAS GEMV only": lambda: F.linear(x[:, :k], next(weights), out=out),
                    "layer ops today": layer_ops}
                for label, launch in gemv_variants(args.sweep, bs).items():
                    paths[label] = lambda launch=launch: fused_gemv(
                        x, next(weights), norm_weight=norm_w if prologue == "norm" else None,
                        eps=1e-5, gated=prologue == "gated", residual=residual if add else None,
                        out=out, launch=launch)

                def row(label: str, seconds: float) -> list[str]:
                    rate = weight_bytes / seconds
                    return [shape, name, str(bs), label, f"{seconds * 1e6:.2f}",
                            f"{rate / 1e9:,.0f}", percent(rate / copy_bw) if copy_bw else "-"]

                rows += time_each(paths, args, device, row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    copy_bw = measure_copy_bandwidth(device) if device.type == "cuda" \
        and {"attention", "gemv"} & set(args.parts) else 0.0
    if copy_bw:
        print(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tables = []
    if "attention" in args.parts:
        tables.append((f"Decode attention ({name}, "
                       f"{'bf16' if device.type == 'cuda' else 'fp32'})", ATTENTION_HEADER,
                       bench_decode(args, device, copy_bw)))
    if "silu" in args.parts:
        tables.append(("SiLU-and-mul", SILU_HEADER, bench_silu(args, device)))
    if "sampling" in args.parts:
        tables.append(("Sampling (temperature 0.6, model-dtype logits)", SAMPLING_HEADER,
                       bench_sampling(args, device)))
    if "logprobs" in args.parts:
        tables.append(("Log-probability statistics (model-dtype logits)", LOGPROBS_HEADER,
                       bench_logprobs(args, device)))
    if "host" in args.parts:
        tables.append(("Host time of a step's calls around sampling (small logits)",
                       HOST_HEADER, bench_host(args, device)))
    if "edits" in args.parts:
        tables.append(("The \"all\" edits into a copy, then sampling (model-dtype logits)",
                       EDITS_HEADER, bench_edits(args, device)))
    if "prologue" in args.parts:
        tables.append(("Attention prologue (q/k norm for Qwen3, RoPE, KV store)",
                       PROLOGUE_HEADER, bench_prologue(args, device)))
    if "gemv" in args.parts:
        tables.append(("Decoder-layer projections at small batch", GEMV_HEADER,
                       bench_gemv(args, device, copy_bw)))
    for title, header, rows in tables:
        print(f"\n## {title}\n")
        print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
