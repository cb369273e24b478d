"""The Triton attention kernels and backend against the torch reference backend.

Without CUDA the kernels run through Triton's interpreter on CPU tensors in fp32 (the `kernels`
package selects it when it is imported on a machine without CUDA); with CUDA the same
comparisons run compiled on the GPU in bf16 against an fp32 reference.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from kernels import is_interpreted
from kernels.decode_attention import (
    DecodeLaunch,
    decode_attention,
    decode_num_splits,
    decode_workspace,
)
from kernels.extend_attention import extend_attention
from kernels.kv_store import _kv_store_kernel, store_kv
from minisgl_backend.attention import AttentionBackend, create_attention_backend
from minisgl_backend.attention.torch_ref import TorchAttentionBackend, token_slots
from minisgl_backend.attention.triton_backend import TritonAttentionBackend
from minisgl_backend.core import Batch
from minisgl_backend.kvcache.pool import PagedKVPool

INTERPRETED = is_interpreted(_kv_store_kernel)
CUDA = torch.cuda.is_available() and not INTERPRETED
# The interpreter trips numpy's deprecation of int() on 1-element arrays at every loop bound.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
LAYERS = 2
MAX_LEN = 64  # positions every scenario stays below


@dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype
    tol: float
    head_dim: int
    odd_head_dim: int  # not a power of two: the masked path
    max_splits: int


# The interpreter is slow: small heads and few splits on CPU; real shapes on the GPU.
CPU = Target("cpu", torch.float32, 1e-4, head_dim=32, odd_head_dim=40, max_splits=2)
GPU = Target("cuda", torch.bfloat16, 2e-2, head_dim=128, odd_head_dim=96, max_splits=16)
TARGETS = [
    pytest.param(CPU, id="cpu-fp32", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU runs need the kernels imported with TRITON_INTERPRET=1 "
                                "(the default where torch sees no CUDA)")),
    pytest.param(GPU, id="cuda-bf16", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="needs CUDA (compiled kernels)")]),
]
HEADS = [pytest.param((8, 2), id="gqa8x2"), pytest.param((2, 2), id="mha2")]
PAGE_SIZES = [1, 16]

# (phase, [(cached prefix, new tokens) per request]); every request's pages beyond its length
# hold random K/V too, which the kernels must not read.
SCENARIOS = {
    "decode": ("decode", [(0, 1), (16, 1), (38, 1), (5, 1)]),
    "prefill": ("prefill", [(0, 13), (0, 1), (0, 40)]),
    "prefix": ("prefill", [(16, 9), (7, 20), (33, 1)]),
    "chunked": ("prefill", [(24, 16), (0, 8)]),  # a middle chunk of a long prompt
    "mixed": ("prefill", [(0, 5), (30, 2), (12, 37), (3, 1)]),
}


def _rand(shape: tuple[int, ...], target: Target, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=target.device, dtype=target.dtype)


class World:
    """A KV pool full of random values (and an fp32 copy for the reference), with every table
    row mapped to randomly scattered pages; the last table row is the dummy row."""

    def __init__(self, target: Target, num_heads: int, num_kv_heads: int, page_size: int,
                 num_rows: int = 6, head_dim: int | None = None, seed: int = 0) -> None:
        self.target = target
        self.gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or target.head_dim
        self.page_size = page_size
        pages_per_row = -(-MAX_LEN // page_size)
        num_pages = num_rows * pages_per_row + 2
        args = (LAYERS, num_pages, page_size, num_kv_heads, self.head_dim)
        self.pool = PagedKVPool(*args, target.dtype, torch.device(target.device))
        self.pool.buffer[:, :, :num_pages] = _rand(self.pool.buffer[:, :, :num_pages].shape,
                                                   target, self.gen)
        self.ref_pool = PagedKVPool(*args, torch.float32, torch.device(target.device))
        self.ref_pool.buffer.copy_(self.pool.buffer)
        pages = torch.randperm(num_pages, generator=self.gen)[: num_rows * pages_per_row]
        self.page_table = torch.full((num_rows + 1, pages_per_row), self.pool.dummy_page,
                                     dtype=torch.int32, device=target.device)
        self.page_table[:num_rows] = pages.view(num_rows, pages_per_row).to(self.page_table)
        self.num_rows = num_rows

    @property
    def dummy_row(self) -> int:
        return self.num_rows

    def batch(self, phase: str, reqs: list[tuple[int, int]]) -> Batch:
        dev = self.target.device
        rows = torch.randperm(self.num_rows, generator=self.gen)[: len(reqs)].to(dev)
        positions = torch.cat([torch.arange(p, p + n) for p, n in reqs]).to(dev)
        row_of_token = torch.repeat_interleave(rows, torch.tensor([n for _, n in reqs]).to(dev))
        return Batch(phase=phase, rows=rows,  # type: ignore[arg-type]
                     input_ids=torch.zeros_like(positions), positions=positions,
                     out_slots=token_slots(self.page_table, row_of_token, positions,
                                           self.page_size),
                     extend_lens=[n for _, n in reqs], seq_lens=[p + n for p, n in reqs])

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return (_rand((tokens, self.num_heads, d), self.target, self.gen),
                _rand((tokens, self.num_kv_heads, d), self.target, self.gen),
                _rand((tokens, self.num_kv_heads, d), self.target, self.gen))

    def backends(self) -> tuple[TritonAttentionBackend, TorchAttentionBackend]:
        tri = TritonAttentionBackend(self.pool, self.num_heads, self.head_dim,
                                     max_splits=self.target.max_splits)
        return tri, TorchAttentionBackend(self.ref_pool, self.num_heads, self.head_dim)

    def reference(self, ref: TorchAttentionBackend, batch: Batch, layer: int, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        ref_batch = dataclasses.replace(batch, attn_metadata=None)
        ref.prepare(ref_batch, self.page_table)
        return ref.forward(q.float(), k.float(), v.float(), layer, ref_batch, window)

    def assert_close(self, out: torch.Tensor, expected: torch.Tensor) -> None:
        assert out.dtype == self.target.dtype
        torch.testing.assert_close(out.float(), expected, rtol=self.target.tol,
                                   atol=self.target.tol)

    def assert_pools_equal(self) -> None:
        """Both backends stored the same K/V in the same slots (bf16 values are exact in fp32)."""
        assert torch.equal(self.pool.buffer.float(), self.ref_pool.buffer)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_backend_matches_torch_reference(target: Target, heads: tuple[int, int], page_size: int,
                                         scenario: str) -> None:
    world = World(target, *heads, page_size)
    phase, reqs = SCENARIOS[scenario]
    batch = world.batch(phase, reqs)
    tri, ref = world.backends()
    tri.prepare(batch, world.page_table)
    layer = LAYERS - 1  # one layer (the interpreter is slow); not the first, to check offsets
    q, k, v = world.qkv(len(batch.out_slots))
    out = tri.forward(q, k, v, layer, batch)
    assert out.shape == (q.shape[0], world.num_heads * world.head_dim)
    world.assert_close(out, world.reference(ref, batch, layer, q, k, v))
    world.assert_pools_equal()


# Wider than a key block and not a multiple of it (blocks hold 16 keys on CPU, 16 to 64 on GPU).
WINDOW = 21


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sliding_window_matches_torch_reference(target: Target, page_size: int,
                                                scenario: str) -> None:
    """A sliding-window layer: each query sees its last WINDOW keys (the reference is checked
    against the naive one in test_torch_reference_sliding_window)."""
    world = World(target, 8, 2, page_size)
    assert_window_matches_reference(world, world.backends()[0], scenario)


def assert_window_matches_reference(world: World, backend: AttentionBackend,
                                    scenario: str) -> None:
    """`backend` over `world`'s pool, a layer of WINDOW then a full one, equals the reference."""
    phase, reqs = SCENARIOS[scenario]
    batch = world.batch(phase, reqs)
    ref = world.backends()[1]
    backend.prepare(batch, world.page_table)
    q, k, v = world.qkv(len(batch.out_slots))
    out = backend.forward(q, k, v, 1, batch, window=WINDOW)
    world.assert_close(out, world.reference(ref, batch, 1, q, k, v, window=WINDOW))
    # The same step of a full-attention layer still sees every key.
    full = backend.forward(q, None, None, 1, batch)
    world.assert_close(full, world.reference(ref, batch, 1, q, k, v))


def test_torch_reference_sliding_window() -> None:
    """The reference backend's windows against the naive attention, both phases, and the
    full-attention mask of the same step left alone."""
    world = World(CPU, 4, 2, page_size=4)
    # The reference alone: the Triton backend of a CPU world needs the interpreter, which a GPU
    # host does not turn on.
    ref = TorchAttentionBackend(world.ref_pool, world.num_heads, world.head_dim)
    for phase, reqs in (SCENARIOS["mixed"], SCENARIOS["decode"]):
        batch = world.batch(phase, reqs)
        ref.prepare(batch, world.page_table)
        q = world.qkv(len(batch.out_slots))[0]
        kc, vc = world.ref_pool.k_cache(0), world.ref_pool.v_cache(0)
        for window in (0, 5, WINDOW):
            out = ref.forward(q, None, None, 0, batch, window).view(q.shape)
            start = 0
            for i, (prefix, n) in enumerate(reqs):
                expected = _naive_attention(q[start : start + n], kc, vc, world.page_table,
                                            int(batch.rows[i]),
                                            torch.arange(prefix, prefix + n), prefix + n, 4,
                                            window=window)
                torch.testing.assert_close(out[start : start + n], expected)
                start += n


@pytest.mark.parametrize("target", TARGETS)
def test_cuda_graph_path_matches_eager(target: Target) -> None:
    """init / prepare_for_capture / prepare_for_replay, then forward on the static batch, gives
    what prepare + forward gives; padding rows use the dummy row and output zeros."""
    world = World(target, 8, 2, page_size=4)
    tri, ref = world.backends()
    graph_bs = 4
    tri.init_cuda_graph(max_bs=6)
    static = _static_decode_batch(world, graph_bs)
    tri.prepare_for_capture(static, world.page_table)
    graph_meta = static.attn_metadata
    # Stale partials must never be read: poison the static scratch.
    graph_meta.workspace.partial_o.fill_(float("nan"))
    graph_meta.workspace.partial_lse.fill_(float("nan"))

    # Replay with the real batch (padding: length 0, zeros), then the way the engine's graph
    # runner does, with its static tensors padded by dummy requests (position 0: length 1).
    for step, (lens, padded) in enumerate([([9, 1, 40], False), ([30, 17], True)]):
        real = world.batch("decode", [(n - 1, 1) for n in lens])
        bs = real.size
        for static_t, real_t, pad in ((static.rows, real.rows, world.dummy_row),
                                      (static.positions, real.positions, 0),
                                      (static.out_slots, real.out_slots, world.pool.dummy_slot)):
            static_t[:bs] = real_t
            static_t[bs:] = pad
        if padded:
            tri.prepare_for_replay(dataclasses.replace(
                static, seq_lens=real.seq_lens + [1] * (graph_bs - bs), attn_metadata=None),
                world.page_table)
        else:
            tri.prepare_for_replay(real, world.page_table)
        assert static.attn_metadata is graph_meta  # replay reuses what was captured
        q, k, v = world.qkv(graph_bs)
        out = tri.forward(q, k, v, step, static)
        world.assert_close(out[:bs], world.reference(ref, real, step, q[:bs], k[:bs], v[:bs]))
        assert torch.all(torch.isfinite(out[bs:])) and (padded or torch.all(out[bs:] == 0))
        # The eager path on the same inputs agrees (it stores the same K/V again).
        tri.prepare(real, world.page_table)
        eager = tri.forward(q[:bs], k[:bs], v[:bs], step, real)
        world.assert_close(out[:bs], eager.float())
    with pytest.raises(RuntimeError, match="page table"):
        tri.prepare_for_replay(real, world.page_table.clone())


def _static_decode_batch(world: World, bs: int) -> Batch:
    """The batch an engine captures with: dummy rows whose K/V go to the dummy slot."""
    dev = world.target.device
    return Batch(phase="decode", rows=torch.full((bs,), world.dummy_row, device=dev),
                 input_ids=torch.zeros(bs, dtype=torch.long, device=dev),
                 positions=torch.zeros(bs, dtype=torch.long, device=dev),
                 out_slots=torch.full((bs,), world.pool.dummy_slot, device=dev),
                 extend_lens=[1] * bs, seq_lens=[1] * bs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels)")
def test_captured_cuda_graph_replays_new_batches() -> None:
    """A real capture of store + decode for 8 rows, replayed for smaller batches of new lengths."""
    world = World(GPU, 8, 2, page_size=16, num_rows=8)
    tri, ref = world.backends()
    graph_bs = 8
    tri.init_cuda_graph(max_bs=graph_bs)
    static = _static_decode_batch(world, graph_bs)
    tri.prepare_for_capture(static, world.page_table)
    q_s, k_s, v_s = (torch.zeros_like(t) for t in world.qkv(graph_bs))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles outside the capture
        tri.forward(q_s, k_s, v_s, 0, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = tri.forward(q_s, k_s, v_s, 0, static)
    for lens in ([9, 1, 64], [30, 17, 2, 5, 64, 33, 1]):
        real = world.batch("decode", [(n - 1, 1) for n in lens])
        bs = real.size
        tri.prepare_for_replay(real, world.page_table)
        static.out_slots[:bs] = real.out_slots
        static.out_slots[bs:] = world.pool.dummy_slot
        q, k, v = world.qkv(bs)
        for dst, src in ((q_s, q), (k_s, k), (v_s, v)):
            dst.zero_()
            dst[:bs] = src
        graph.replay()
        world.assert_close(out_s[:bs], world.reference(ref, real, 0, q, k, v))
        assert torch.all(out_s[bs:] == 0)


def _naive_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, row: int, q_positions: torch.Tensor,
                     seq_len: int, page_size: int, window: int = 0) -> torch.Tensor:
    """fp32 attention of q [n, heads, d] at `q_positions` to the first seq_len tokens of a row
    (with `window`: to each query's last `window` of them)."""
    pos = torch.arange(seq_len, device=q.device)
    slots = page_table[row, pos // page_size].long() * page_size + pos % page_size
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(group, 1)
    v = v_cache[slots].float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    hidden = pos[None, None, :] > q_positions[None, :, None]
    if window:
        hidden |= pos[None, None, :] <= q_positions[None, :, None] - window
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("target", TARGETS)
def test_store_kv_scatters_strided_inputs(target: Target) -> None:
    world = World(target, 6, 3, page_size=4, head_dim=target.odd_head_dim)
    slots = torch.randperm(world.pool.dummy_slot, generator=world.gen)[:7].to(target.device)
    kv = torch.randn(7, 2, 3, world.head_dim, generator=world.gen).to(target.device)
    k, v = kv[:, 0], kv[:, 1]  # strided views, fp32 (cast to the pool dtype on store)
    expected_k = world.pool.k_cache(1).clone()
    expected_v = world.pool.v_cache(1).clone()
    expected_k[slots] = k.to(target.dtype)
    expected_v[slots] = v.to(target.dtype)
    store_kv(k, v, world.pool.k_cache(1), world.pool.v_cache(1), slots)
    assert torch.equal(world.pool.k_cache(1), expected_k)
    assert torch.equal(world.pool.v_cache(1), expected_v)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_kernel_splits_padding_and_odd_shapes(target: Target, page_size: int) -> None:
    """Any split count and tile gives the same result; a length-0 request gives zeros; an odd
    head_dim and a group of 3 query heads per KV head (padded to 16 rows) work; every output is
    written (outputs and partials start as NaN). Page 16 with 16-token blocks takes the
    one-page-per-block path."""
    world = World(target, 6, 2, page_size=page_size, head_dim=target.odd_head_dim)
    dev = target.device
    rows = torch.tensor([3, 0, 5, 1], device=dev)
    lens = [33, 0, 1, 64]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = _rand((4, 6, world.head_dim), target, world.gen)
    kc, vc = world.pool.k_cache(0), world.pool.v_cache(0)
    launches = [DecodeLaunch(block_n=16), DecodeLaunch(block_n=32, num_warps=8, num_stages=3)]
    outputs = []
    # 3 splits: lengths of 64 fill two 32-token splits, the third is empty
    for splits, launch in itertools.product((1, 3), launches):
        out = torch.full_like(q, float("nan"))
        workspace = decode_workspace(4, 6, world.head_dim, splits, dev)
        workspace.partial_o.fill_(float("nan"))
        workspace.partial_lse.fill_(float("nan"))
        decode_attention(q, kc, vc, world.page_table, rows, seq_lens, page_size=page_size,
                         sm_scale=world.head_dim**-0.5, num_splits=splits, out=out,
                         workspace=workspace, launch=launch)
        outputs.append(out)
    for i, n in enumerate(lens):
        if n == 0:
            assert all(torch.all(out[i] == 0) for out in outputs)
            continue
        expected = _naive_attention(q[i : i + 1], kc, vc, world.page_table, int(rows[i]),
                                    torch.tensor([n - 1], device=dev), n, page_size)
        for out in outputs:
            world.assert_close(out[i : i + 1], expected)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("window", [5, 40])
def test_decode_kernel_sliding_window_splits(target: Target, window: int) -> None:
    """Windows narrower and wider than a block, shorter and longer than the requests, with
    one and several splits, on the one-page-per-block path (page 16)."""
    world = World(target, 6, 2, page_size=16)
    dev = target.device
    rows = torch.tensor([3, 0, 5, 1], device=dev)
    lens = [33, 0, 3, 64]
    q = _rand((4, 6, world.head_dim), target, world.gen)
    kc, vc = world.pool.k_cache(0), world.pool.v_cache(0)
    for splits in (1, 3):
        out = decode_attention(q, kc, vc, world.page_table, rows,
                               torch.tensor(lens, dtype=torch.int32, device=dev), page_size=16,
                               sm_scale=world.head_dim**-0.5, num_splits=splits,
                               launch=DecodeLaunch(block_n=16), window=window)
        for i, n in enumerate(lens):
            if n == 0:
                assert torch.all(out[i] == 0)
                continue
            expected = _naive_attention(q[i : i + 1], kc, vc, world.page_table, int(rows[i]),
                                        torch.tensor([n - 1], device=dev), n, 16, window=window)
            world.assert_close(out[i : i + 1], expected)


def test_decode_num_splits_depends_only_on_batch_size() -> None:
    assert decode_num_splits(1, 8, max_splits=16) == 16
    assert decode_num_splits(8, 8, max_splits=16) == 4
    assert decode_num_splits(256, 8, max_splits=16) == 1
    assert all(1 <= decode_num_splits(bs, 2, 5) <= 5 for bs in range(1, 300))


@pytest.mark.parametrize("target", TARGETS)
def test_extend_kernel_blocks_strided_q_and_odd_shapes(target: Target) -> None:
    """Several query and key blocks per request (16 x 16 tiles), a strided q, an odd head_dim
    and a group of 3 against the naive reference; padded query rows are never written."""
    world = World(target, 6, 2, page_size=16, head_dim=target.odd_head_dim)
    dev = target.device
    reqs = [(20, 35), (0, 3), (47, 17)]
    rows = torch.tensor([4, 1, 2], device=dev)
    tokens = sum(n for _, n in reqs)
    qkv = _rand((tokens, 2, 6, world.head_dim), target, world.gen)
    q = qkv[:, 1]
    out = torch.full_like(q, float("nan"))
    starts = [0, 35, 38]

    def as_i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=dev)

    extend_attention(q, world.pool.k_cache(1), world.pool.v_cache(1), world.page_table, rows,
                     as_i32([p + n for p, n in reqs]), as_i32(starts), as_i32([n for _, n in reqs]),
                     max_extend_len=35, page_size=16, sm_scale=world.head_dim**-0.5, out=out,
                     block_m=16, block_n=16)
    for i, (p, n) in enumerate(reqs):
        expected = _naive_attention(q[starts[i] : starts[i] + n], world.pool.k_cache(1),
                                    world.pool.v_cache(1), world.page_table, int(rows[i]),
                                    torch.arange(p, p + n, device=dev), p + n, 16)
        world.assert_close(out[starts[i] : starts[i] + n], expected)


@pytest.mark.parametrize("target", TARGETS)
def test_extend_kernel_sliding_window_blocks(target: Target) -> None:
    """16 x 16 tiles and a window of 5: query rows that see no key of a block (their running
    max stays -inf there) and loops that start past key 0."""
    world = World(target, 6, 2, page_size=4)
    dev = target.device
    reqs = [(20, 35), (0, 3), (47, 17)]
    rows = torch.tensor([4, 1, 2], device=dev)
    q = _rand((sum(n for _, n in reqs), 6, world.head_dim), target, world.gen)
    starts = [0, 35, 38]

    def as_i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=dev)

    kc, vc = world.pool.k_cache(1), world.pool.v_cache(1)
    out = extend_attention(q, kc, vc, world.page_table, rows, as_i32([p + n for p, n in reqs]),
                           as_i32(starts), as_i32([n for _, n in reqs]), max_extend_len=35,
                           page_size=4, sm_scale=world.head_dim**-0.5, block_m=16, block_n=16,
                           window=5)
    for i, (p, n) in enumerate(reqs):
        expected = _naive_attention(q[starts[i] : starts[i] + n], kc, vc, world.page_table,
                                    int(rows[i]), torch.arange(p, p + n, device=dev), p + n, 4,
                                    window=5)
        world.assert_close(out[starts[i] : starts[i] + n], expected)


def test_create_attention_backend_by_name() -> None:
    pool = PagedKVPool(1, 4, 2, 2, 16, torch.float32, torch.device("cpu"))
    if INTERPRETED:
        backend = create_attention_backend("triton", pool, 4, 16, torch.device("cpu"))
        assert isinstance(backend, TritonAttentionBackend) and backend.supports_cuda_graph
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            create_attention_backend("triton", pool, 4, 16, torch.device("cpu"))
    assert isinstance(create_attention_backend("auto", pool, 4, 16, torch.device("cpu")),
                      TorchAttentionBackend)
    with pytest.raises(ValueError, match="triton"):
        create_attention_backend("nope", pool, 4, 16, torch.device("cpu"))
