"""The engine of one tensor-parallel rank: model, KV pool, page table, token pool, sampling.

It lives in its own process and applies compact step messages from the scheduler. Because the
token pool is here, a decode step's input ids are gathered from tokens this engine sampled in the
previous step: the scheduler never has to send them back.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minisgl_backend.attention import create_attention_backend
from minisgl_backend.attention.torch_ref import token_slots
from minisgl_backend.core import MAX_LOGPROBS, Batch, Context, set_global_ctx
from minisgl_backend.device_copy import host_to_device, stack_to_device
from minisgl_backend.distributed import get_tp_info, init_process_group
from minisgl_backend.engine.config import CPU_KV_MEMORY_FRACTION, EngineConfig, resolve_dtype
from minisgl_backend.engine.controls import BatchRows, LogitControls, LogprobReport, StepLogits
from minisgl_backend.engine.cuda_graph import CudaGraphRunner
from minisgl_backend.engine.device_wait import HostWordWait
from minisgl_backend.engine.mask_buffer import MASKS_RELEASED, MaskBuffer
from minisgl_backend.engine.protocol import LogprobColumns, StepMessage, StepReply, ranges
from minisgl_backend.engine.step_times import StepTimeline
from minisgl_backend.grammar import apply_token_masks
from minisgl_backend.host_cpus import usable_cpus
from minisgl_backend.kvcache.pool import PagedKVPool, resolve_kv_dtype
from minisgl_backend.layers.fast_ops import HALF_TYPES, flashinfer_module, has_triton
from minisgl_backend.lora.config import read_adapter_config, read_adapter_configs
from minisgl_backend.lora.ops import LoraRows
from minisgl_backend.lora.weights import LoraSet
from minisgl_backend.models import ModelConfig, create_model

logger = logging.getLogger(__name__)

MAX_CPU_DEFAULT_TOKENS = 1 << 20


@dataclass
class LogitsReport:
    """Device tensors of one step's returned logits (float32): the sampled token's for the
    rows that return generation logits, every computed token's for those that return prompt
    logits (row-major, `context_counts` tokens each)."""

    logit_rows: np.ndarray  # batch indices, on cpu
    logits: torch.Tensor  # [len(logit_rows), vocab]
    context_rows: np.ndarray
    context_counts: np.ndarray
    context_logits: torch.Tensor  # [sum(context_counts), vocab]


@dataclass
class StartedStep:
    """A step whose forward is launched and whose logits await the grammar masks (if any) and
    sampling (`Engine.start` -> `Engine.finish`)."""

    msg: StepMessage
    batch: Batch
    logits: StepLogits  # through the controls up to the grammar masks
    logits_report: LogitsReport | None = None


@dataclass
class _HostBuffers:
    """Page-locked host memory a step's results are copied into without blocking: the sampled
    ids and the log-probability table. Two sets: step N+1 is launched before step N's results
    are read."""

    tokens: torch.Tensor  # int32 [rows * samples]
    logprobs: torch.Tensor  # float32 [rows * samples * LogprobColumns(MAX_LOGPROBS).width]

    @classmethod
    def allocate(cls, samples: int) -> _HostBuffers:
        width = LogprobColumns(MAX_LOGPROBS).width
        return cls(torch.empty(samples, dtype=torch.int32, pin_memory=True),
                   torch.empty(samples * width, dtype=torch.float32, pin_memory=True))

    @staticmethod
    def take(buffer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`src` copied (asynchronously, with a cast) into the front of `buffer`."""
        host = buffer[: src.numel()].view(src.shape)
        host.copy_(src, non_blocking=True)
        return host


class StepHandle:
    """A launched step. On a GPU its sampled ids (and log-probabilities or logits, if any row
    asked) are copied to pinned host memory without blocking; `wait()` blocks until they are
    there. The handle keeps the step's inputs alive."""

    def __init__(self, tokens: torch.Tensor, host: _HostBuffers | None, batch: Batch,
                 logprobs: LogprobReport | None = None,
                 logits: LogitsReport | None = None) -> None:
        self.batch = batch
        self._lp_rows = logprobs.batch_rows if logprobs is not None else None
        self._logits = logits
        table = logprobs.table if logprobs is not None else None
        logit_parts = [logits.logits, logits.context_logits] if logits is not None else []
        self._event: torch.cuda.Event | None = None
        if host is None:  # CPU: the step already ran
            self._tokens = tokens.to(torch.int32).numpy()
            self._table = table.numpy() if table is not None else None
            self._logit_parts = [t.numpy() for t in logit_parts]
            return
        self._tokens = host.take(host.tokens, tokens)
        self._table = host.take(host.logprobs, table) if table is not None else None
        self._logit_parts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for t in logit_parts]
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> StepReply:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            # Copies of what lies in the engine's host buffers: they serve the step after next.
            self._tokens = self._tokens.numpy().copy()
            if self._table is not None:
                self._table = self._table.numpy().copy()
            self._logit_parts = [t.numpy() for t in self._logit_parts]
        reply = StepReply(self._tokens)
        if self._lp_rows is not None:
            reply.lp_rows = self._lp_rows.astype(np.int32)
            reply.logprobs = self._table
        if self._logits is not None:
            reply.logit_rows = self._logits.logit_rows.astype(np.int32)
            reply.context_rows = self._logits.context_rows.astype(np.int32)
            reply.context_counts = self._logits.context_counts.astype(np.int32)
            reply.logits, reply.context_logits = self._logit_parts
        return reply


class Engine:
    def __init__(self, config: EngineConfig, rank: int, init_file: str) -> None:
        self.config = config
        self.reports = rank == 0  # only rank 0 answers steps (tokens, log-probabilities)
        device_type = config.device_type
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(max(1, usable_cpus() // config.tp_size))
            self.device = torch.device("cpu")
        backend = "nccl" if device_type == "cuda" else "gloo"
        init_process_group(rank, config.tp_size, init_file, backend)
        self._mask_buffer: MaskBuffer | None = None  # the scheduler's (`attach_masks`)
        self._masks_wait: HostWordWait | None = None  # the device's wait for them, on a GPU
        self.model_config = ModelConfig.from_folder(config.model_dir)
        self.dtype = resolve_dtype(config.dtype, device_type, self.model_config.torch_dtype)
        free_before = self._free_memory()
        self.model = create_model(config.model_dir, self.model_config, self.device, self.dtype,
                                  load_format=config.load_format,
                                  quantization=config.quantization)
        self.lora = self._load_adapters(config)
        self.page_size = config.page_size
        self.num_pages = self._decide_num_pages(free_before)
        mc = self.model_config
        self.max_seq_len = min(mc.max_position_embeddings, self.num_pages * self.page_size)
        num_local_kv = self.model.model.layers[0].self_attn.qkv_proj.num_local_kv_heads
        num_local_heads = self.model.model.layers[0].self_attn.qkv_proj.num_local_heads
        attn = [layer.self_attn for layer in self.model.model.layers]
        self.kv_pool = PagedKVPool(mc.num_layers, self.num_pages, self.page_size, num_local_kv,
                                   mc.head_dim, self.dtype, self.device, kv_dtype=self.kv_dtype,
                                   k_scales=[a.k_scale for a in attn],
                                   v_scales=[a.v_scale for a in attn])
        if self.reports:
            logger.info("KV cache: %s, %d tokens (%d pages of %d)", self.kv_pool.kv_dtype,
                        self.kv_pool.capacity, self.num_pages, self.page_size)
        self._init_tables(config.max_running_requests + 1)
        self.attn_backend = create_attention_backend(
            config.attention_backend, self.kv_pool, num_local_heads, mc.head_dim, self.device,
            max_pages_per_request=self.page_table.shape[1],
        )
        if self.device.type == "cuda" and self.dtype in HALF_TYPES and rank == 0 \
                and flashinfer_module() is None:
            logger.warning("flashinfer is not importable here: norms, activations and prefill "
                           "attention fall back to slower kernels (sys.path: %s)", sys.path)
        fused_gemvs = self.device.type == "cuda" and config.tp_size == 1 and has_triton()
        self.ctx = Context(self.page_size, self.kv_pool, self.attn_backend,
                           fused_gemv_max_rows=config.fused_gemv_max_bs if fused_gemvs else 0)
        set_global_ctx(self.ctx)
        self.timeline = StepTimeline.from_env(self.device)  # MINISGL_STEP_TIMES_DIR
        self.graph_runner: CudaGraphRunner | None = None
        # MoE layers need the fused Triton path: the torch one reads expert ids on the host.
        if (self.device.type == "cuda" and config.cuda_graph_max_bs > 0
                and self.attn_backend.supports_cuda_graph
                and (self.model_config.num_experts == 0 or has_triton())):
            self.graph_runner = CudaGraphRunner(
                self.model, self.ctx, self.attn_backend,
                min(config.cuda_graph_max_bs, config.max_samples), self.page_table,
                self.token_pool, dummy_page=self.kv_pool.dummy_page, page_size=self.page_size,
                lora_slots=config.max_loras if self.lora is not None else 0)

    def _load_adapters(self, config: EngineConfig) -> LoraSet | None:
        """The LoRA slots, with the adapters of `lora_adapters` read for this rank (ids 1, 2,
        ... in order); None where LoRA is off."""
        if not config.lora_enabled:
            return None
        lora = LoraSet(self.model, config.max_loras, config.max_lora_rank, self.device,
                       self.dtype)
        for i, adapter in enumerate(read_adapter_configs(config.lora_adapters,
                                                         config.max_lora_rank)):
            lora.read(i + 1, adapter)
        return lora

    def _apply_adapters(self, msg: StepMessage) -> None:
        """Adapters first used at run time (read from their folders), then slot loads."""
        assert self.lora is not None, "an adapter message for an engine without LoRA"
        for adapter_id in msg.lora_drop_ids:
            self.lora.drop(int(adapter_id))
        ends = np.cumsum(msg.lora_read_path_lens)
        for adapter_id, end, length in zip(msg.lora_read_ids, ends, msg.lora_read_path_lens):
            folder = bytes(msg.lora_read_paths[end - length:end]).decode()
            self.lora.read(int(adapter_id), read_adapter_config(
                f"#{adapter_id}", Path(folder), self.config.max_lora_rank))
        for slot, adapter_id in zip(msg.lora_load_slots, msg.lora_load_ids):
            self.lora.load(int(slot), int(adapter_id))

    def _init_tables(self, num_rows: int) -> None:
        """Page table and token pool: one row per running request plus the dummy row (last)."""
        dev = self.device
        max_pages = -(-self.max_seq_len // self.page_size)
        self.page_table = torch.full((num_rows, max_pages), self.kv_pool.dummy_page,
                                     dtype=torch.int32, device=dev)
        # Its copy on the host, from which each step's KV slots are computed without a kernel.
        self.host_page_table = np.full((num_rows, max_pages), self.kv_pool.dummy_page,
                                       dtype=np.int32)
        # +1 column: the token sampled after the last position still has a place to go.
        self.token_pool = torch.zeros((num_rows, self.max_seq_len + 1), dtype=torch.int32,
                                      device=dev)
        self.row_pages = np.zeros(num_rows, dtype=np.int64)  # pages mapped per row (on cpu)
        self.row_len = np.zeros(num_rows, dtype=np.int64)  # tokens with KV per row (on cpu)
        self.row_lora = np.full(num_rows, -1, dtype=np.int64)  # adapter slot per row (-1: none)
        self.row_long = np.zeros(num_rows, dtype=bool)  # KV in LongRoPE's long frequencies
        # Every row's sampling settings and the logits controls' state.
        self.controls = LogitControls(num_rows, self.model_config.vocab_size, self.token_pool)
        self.num_launched = 0
        if self.device.type == "cuda":
            self._host_buffers = [_HostBuffers.allocate(num_rows * self.config.samples_per_row)
                                  for _ in range(2)]

    def _free_memory(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.mem_get_info(self.device)[0]

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pool stores (the `kv_cache_dtype` setting)."""
        return resolve_kv_dtype(self.config.kv_cache_dtype, self.dtype)

    def _decide_num_pages(self, free_before: int) -> int:
        mc, cfg = self.model_config, self.config
        tp = get_tp_info().size
        kv_heads = max(1, mc.num_kv_heads // tp)
        page_bytes = PagedKVPool.bytes_per_page(mc.num_layers, self.page_size, kv_heads,
                                                mc.head_dim, self.kv_dtype)
        if cfg.max_total_tokens is not None:
            return -(-cfg.max_total_tokens // self.page_size)
        if self.device.type == "cuda":
            model_bytes = free_before - self._free_memory()
            budget = int(cfg.kv_memory_fraction * free_before) - model_bytes
            pages = torch.tensor([budget // page_bytes], device=self.device)
            if tp > 1:
                torch.distributed.all_reduce(pages, op=torch.distributed.ReduceOp.MIN)
            return int(pages.item())
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        tokens = min(int(CPU_KV_MEMORY_FRACTION * ram) // (page_bytes // self.page_size),
                     MAX_CPU_DEFAULT_TOKENS)
        return max(1, tokens // self.page_size)

    def launch(self, msg: StepMessage, waited: float = 0.0) -> StepHandle:
        """Apply one step message and launch its forward and sampling (asynchronous on a GPU:
        the next message can be applied while this step runs). `waited`: seconds this rank
        waited for the message (for the step timeline)."""
        return self.finish(self.start(msg, waited))

    @torch.inference_mode()
    def start(self, msg: StepMessage, waited: float = 0.0) -> StartedStep:
        """The first half of `launch`: apply the message, run (launch) the forward and every
        logits control except the grammar masks, which `finish` takes."""
        if self.timeline is not None:
            self.timeline.begin(waited)
        rows = np.asarray(msg.rows, dtype=np.int64)
        if len(msg.lora_load_slots):
            self._apply_adapters(msg)
        if len(msg.admit_rows):
            self._admit(msg)
        if len(msg.long_rope_rows):
            self._start_long_rope(msg)
        new_pages = self._map_new_pages(np.asarray(msg.page_rows, dtype=np.int64),
                                        np.asarray(msg.page_counts, dtype=np.int64),
                                        np.asarray(msg.new_pages, dtype=np.int64))
        batch, rows, graphed = self._make_batch(rows, msg, new_pages)
        if self.timeline is not None:
            self.timeline.forward()
        if graphed:
            assert self.graph_runner is not None
            logits = self.graph_runner.run(batch)
        else:
            self.attn_backend.prepare(batch, self.page_table)
            with self.ctx.forward_batch(batch):
                logits = self.model()
        # The sampled token's position (a row's length once it is appended): it seeds
        # sampling and is where the token pool keeps it.
        next_positions = batch.seq_lens_device
        if next_positions is None:
            next_positions = host_to_device(batch.seq_lens, self.device, torch.int64)
        report = self._logits_report(logits, rows, msg, batch) if self.reports else None
        rows_of = BatchRows(rows, batch.rows, next_positions,
                            np.asarray(batch.seq_lens, dtype=np.int64))
        return StartedStep(msg, batch, self.controls.start(
            logits, rows_of, guided=bool(len(msg.guide_rows)), reports=self.reports), report)

    def attach_masks(self, buffer: MaskBuffer) -> None:
        """The scheduler's mask buffer, page-locked on a GPU (its masks are then copied to the
        device straight from it)."""
        if self.device.type == "cuda" and not buffer.lock_pages():
            logger.warning("the guide mask buffer could not be page-locked: masks are copied "
                           "through pinned memory")
        self._mask_buffer = buffer
        if buffer.page_locked:
            self._masks_wait = HostWordWait(buffer.ready_address)

    def wait_for_masks_on_device(self, msg: StepMessage) -> bool:
        """For a step sent with `masks_follow`: queue the device's wait for its masks (the
        scheduler marks them ready in the mask buffer), so that `finish` may launch its sampling
        now and the host go on to the next step. False where the device cannot wait: the host
        then waits for the MASKS message before `finish`."""
        if self._masks_wait is None or not len(msg.mask_seq):
            return False
        if self._masks_wait.enqueue(int(msg.mask_seq[0])):
            return True
        self._masks_wait = None  # the driver cannot: the host waits from now on
        return False

    def release_mask_waits(self) -> None:
        """Let every device wait for masks go on (the scheduler stopped before writing some:
        the steps' tokens are dropped), so that the device does not wait forever."""
        if self._masks_wait is not None and self._mask_buffer is not None:
            self._mask_buffer.mark_ready(MASKS_RELEASED)

    @torch.inference_mode()
    def finish(self, step: StartedStep) -> StepHandle:
        """The second half of `launch`: the guided rows' token masks (`step.msg.guide_rows`;
        they must be in the mask buffer by now), sampling, and the copy of the sampled ids to
        the host."""
        batch = step.batch
        if self.timeline is not None:
            self.timeline.sampling()
        if len(step.msg.guide_rows):
            msg, buffer = step.msg, self._mask_buffer
            assert buffer is not None, "guided rows before the mask buffer came"
            apply_token_masks(step.logits.logits, np.asarray(msg.guide_rows, dtype=np.int64),
                              buffer.view(int(msg.mask_half[0]), len(msg.guide_rows)),
                              page_locked=buffer.page_locked)
        sampled = self.controls.sample(step.logits)
        next_tokens = sampled.to(torch.int32)
        self.token_pool[batch.rows, step.logits.batch.next_positions] = next_tokens
        # The controls index with the int64 ids as sampled: no cast back from int32.
        report = self.controls.finish(step.logits, sampled)
        host = None
        if self.device.type == "cuda":
            host = self._host_buffers[self.num_launched % 2]
        self.num_launched += 1
        handle = StepHandle(next_tokens, host, batch, report, step.logits_report)
        if self.timeline is not None:
            self.timeline.end(batch.phase, len(sampled))
        return handle

    def _logits_report(self, logits: torch.Tensor, rows: np.ndarray, msg: StepMessage,
                       batch: Batch) -> LogitsReport | None:
        """Copies of the logits rows return (before any control edits them), or None."""
        gen = np.nonzero(self.controls.params.return_generation_logits[rows])[0]
        context = batch.token_logits
        if not len(gen) and context is None:
            return None
        empty = logits.new_zeros((0, logits.shape[-1]), dtype=torch.float32)
        context_rows = np.asarray(msg.context_rows, dtype=np.int64)
        return LogitsReport(
            logit_rows=gen,
            logits=logits[host_to_device(gen, self.device)].float() if len(gen) else empty,
            context_rows=context_rows if context is not None else context_rows[:0],
            context_counts=(np.asarray(batch.extend_lens, dtype=np.int64)[context_rows]
                            if context is not None else context_rows[:0]),
            context_logits=context.float() if context is not None else empty)

    def _admit(self, msg: StepMessage) -> None:
        rows = np.asarray(msg.admit_rows, dtype=np.int64)
        self.row_pages[rows] = self.row_len[rows] = 0
        self.row_long[rows] = False
        self.row_lora[rows] = -1
        self.row_lora[np.asarray(msg.lora_rows, dtype=np.int64)] = msg.lora_slots
        self.controls.admit(msg)

    def _start_long_rope(self, msg: StepMessage) -> None:
        """Rows whose KV is computed in LongRoPE's long frequencies from this step on; a
        restarted row's page list starts over (its new pages follow in this message)."""
        rows = np.asarray(msg.long_rope_rows, dtype=np.int64)
        self.row_long[rows] = True
        self.row_pages[rows] = 0
        self.controls.count_from(rows, np.asarray(msg.long_rope_lens, dtype=np.int64))

    def _map_new_pages(self, rows: np.ndarray, counts: np.ndarray,
                       pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Enter the new pages in the host page table. Returns the entries the device table
        still needs: flat indices into it and page ids (`_upload_pages`)."""
        row_of_page = np.repeat(rows, counts)
        cols = ranges(self.row_pages[rows], counts)
        self.host_page_table[row_of_page, cols] = pages
        np.add.at(self.row_pages, rows, counts)
        return row_of_page * self.page_table.shape[1] + cols, pages

    def _upload_pages(self, new_pages: tuple[np.ndarray, np.ndarray]) -> None:
        if len(new_pages[0]):
            self._enter_pages(*stack_to_device(new_pages, self.device))

    def _enter_pages(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """Page-table entries on the device: flat indices into the table, page ids (int64)."""
        if len(index):
            self.page_table.view(-1)[index] = pages.to(torch.int32)

    def _make_batch(self, rows: np.ndarray, msg: StepMessage,
                    new_pages: tuple[np.ndarray, np.ndarray]) -> tuple[Batch, np.ndarray, bool]:
        """The step's batch, the table row of each of its entries (on cpu), and whether it
        replays a CUDA graph (then the graph runner has staged its inputs)."""
        # The first len(starts) rows send their tokens from a start position (prompt chunks;
        # in decode steps, a last sampled token and its drafts); the others compute the token
        # the engine sampled last for them, from its token pool.
        starts = np.asarray(msg.starts, dtype=np.int64)
        lens = np.asarray(msg.extend_lens, dtype=np.int64)
        given, others = rows[: len(starts)], rows[len(starts):]
        num_given = int(lens.sum())
        token_rows = np.concatenate([np.repeat(given, lens), others]) if len(starts) else rows
        positions = (np.concatenate([ranges(starts, lens), self.row_len[others]])
                     if len(starts) else self.row_len[rows])
        self.row_len[given] = starts + lens
        self.row_len[others] += 1
        out_slots = token_slots(self.host_page_table, token_rows, positions, self.page_size)
        # Each token's adapter slot (-1: none); None where no token takes an adapter.
        lora_slots = self.row_lora[token_rows] if self.lora is not None else None
        if lora_slots is not None and not (lora_slots >= 0).any():
            lora_slots = None
        if msg.is_prefill:
            batch = self._prefill_batch(rows, msg, new_pages, token_rows, positions, out_slots,
                                        num_given)
            batch.lora = None if lora_slots is None else LoraRows.of(lora_slots, self.device)
            return batch, rows, False
        # A decode step. Each token is a decode row of its own (its table row repeated),
        # attending to the row's tokens up to itself: the tokens' KV is stored before attention
        # runs, so with drafts this is causal attention on the decode kernels and CUDA graphs.
        seq_lens = positions + 1
        runner = self.graph_runner
        graphed = (runner is not None and runner.fits(len(token_rows))
                   and runner.fits(len(new_pages[0])))
        host = [token_rows, positions, out_slots, seq_lens]
        lora = None
        if graphed:
            assert runner is not None
            rows_t, positions_t, slots_t, seq_lens_t, *pages_t = runner.stage(
                host, *new_pages, lora_slots=lora_slots)
            self._enter_pages(*pages_t)
            if lora_slots is not None:
                lora = runner.staged_lora
        else:
            if lora_slots is not None:
                lora = LoraRows.of(lora_slots, self.device)
            self._upload_pages(new_pages)
            rows_t, positions_t, slots_t, seq_lens_t = stack_to_device(host, self.device)
        if num_given:
            tokens = host_to_device(np.asarray(msg.tokens, dtype=np.int64), self.device,
                                    torch.int32)
            self.token_pool[rows_t[:num_given], positions_t[:num_given]] = tokens
        # A replayed graph gathers its input ids itself.
        input_ids = (runner.input_ids[: len(token_rows)] if graphed and runner is not None
                     else self.token_pool[rows_t, positions_t].long())
        return Batch(phase="decode", rows=rows_t, input_ids=input_ids, positions=positions_t,
                     out_slots=slots_t, extend_lens=[1] * len(token_rows),
                     seq_lens=seq_lens.tolist(), seq_lens_device=seq_lens_t,
                     lora=lora), token_rows, graphed

    def _prefill_batch(self, rows: np.ndarray, msg: StepMessage,
                       new_pages: tuple[np.ndarray, np.ndarray], token_rows: np.ndarray,
                       positions: np.ndarray, out_slots: np.ndarray, num_given: int) -> Batch:
        dev = self.device
        self._upload_pages(new_pages)
        lens = np.asarray(msg.extend_lens, dtype=np.int64)
        others = rows[len(lens):]
        tokens = np.concatenate([np.asarray(msg.tokens, dtype=np.int64),
                                 np.zeros(len(others), np.int64)])
        row_of_token, positions_t, tokens_t, slots_t = stack_to_device(
            [token_rows, positions, tokens, out_slots], dev)
        given_tokens = tokens_t[:num_given].to(torch.int32)
        self.token_pool[row_of_token[:num_given], positions_t[:num_given]] = given_tokens
        input_ids = torch.cat([given_tokens, self.token_pool[row_of_token[num_given:],
                                                             positions_t[num_given:]]])
        batch = Batch(phase="prefill", rows=host_to_device(rows, dev),
                      input_ids=input_ids.long(), positions=positions_t, out_slots=slots_t,
                      extend_lens=lens.tolist() + [1] * len(others),
                      seq_lens=self.row_len[rows].tolist(), long_rope=self.row_long[rows])
        if len(msg.context_rows):  # their prompt tokens' logits too
            picked = np.asarray(msg.context_rows, dtype=np.int64)
            offsets = np.cumsum(lens) - lens
            batch.logit_tokens = host_to_device(ranges(offsets[picked], lens[picked]), dev)
        return batch
