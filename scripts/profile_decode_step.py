"""Where one decode step's time goes, in one engine process (no scheduler, no pipes).

For each attention backend and batch size it prints: the device time of one CUDA-graph replay
(the GPU-bound floor), the host time of `Engine.launch` (what overlap must hide), one step run
serially (launch + wait), and steps pipelined the way overlap runs them (launch N+1, then wait
for N). With --trace, torch.profiler's top host-side ops and GPU kernels of ten steps follow,
then the host ops of one request's (eager) prefill.

    python scripts/profile_decode_step.py --shape qwen3-0.6b --batch-sizes 1 64
    python scripts/profile_decode_step.py --shape qwen3-0.6b --batch-sizes 256 --prompt-len 800 \
        --temperature 0.6 --backends triton --trace    # like the offline workload's middle
    python scripts/profile_decode_step.py --backends triton --temperature 0.7 \
        --controls none repetition_penalty logprobs    # what a sampling control costs a step

`--controls` names configurations of scripts/bench_sampling_controls.py (none, all, or one
control); every request of a configuration uses it, admitted as the scheduler admits it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl_backend.benchmark.cli import markdown_table
from minisgl_backend.benchmark.shapes import shape_config, write_config
from minisgl_backend.core import Req, SamplingParams
from minisgl_backend.distributed import destroy_process_group
from minisgl_backend.engine.config import EngineConfig
from minisgl_backend.engine.engine import Engine
from minisgl_backend.engine.protocol import StepMessage
from minisgl_backend.scheduler.scheduler import add_admission

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampling_controls import configurations

PROMPT_LEN = 32


def step_messages(engine: Engine, bs: int, steps: int, prompt_len: int = PROMPT_LEN,
                  temperature: float = 0.0, controls: dict[str, Any] | None = None
                  ) -> tuple[StepMessage, list[StepMessage]]:
    """A prefill admitting `bs` requests (each with the SamplingParams fields `controls`),
    then `steps` decode steps (pages added as needed)."""
    ps = engine.page_size
    pages_per_req = -(-(prompt_len + steps + 1) // ps)
    page_of = {r: list(range(r * pages_per_req, (r + 1) * pages_per_req)) for r in range(bs)}
    first = -(-prompt_len // ps)
    prompts = [[(7 * r + i) % 1000 + 5 for i in range(prompt_len)] for r in range(bs)]
    prefill = StepMessage(
        is_prefill=True, rows=list(range(bs)), starts=[0] * bs, extend_lens=[prompt_len] * bs,
        tokens=[t for prompt in prompts for t in prompt],
        page_rows=list(range(bs)), page_counts=[first] * bs,
        new_pages=[p for r in range(bs) for p in page_of[r][:first]])
    params = SamplingParams(temperature=temperature, max_tokens=steps + 1, **(controls or {}))
    for r, prompt in enumerate(prompts):
        req = Req(uid=r, input_ids=prompt, prompt_len=prompt_len, sampling_params=params,
                  seed=r, table_idx=r)
        req.bans = tuple(tuple(seq) for seq in params.bad_token_ids)
        add_admission(prefill, req, [])
    decodes = []
    for step in range(steps):
        length = prompt_len + step + 1  # tokens with KV after this step
        msg = StepMessage(is_prefill=False, rows=list(range(bs)))
        if (length - 1) % ps == 0 and length > prompt_len:  # this token opens a new page
            page = (length - 1) // ps
            msg.page_rows, msg.page_counts = list(range(bs)), [1] * bs
            msg.new_pages = [page_of[r][page] for r in range(bs)]
        decodes.append(StepMessage.from_bytes(msg.to_bytes()))
    return StepMessage.from_bytes(prefill.to_bytes()), decodes


def start_requests(engine: Engine, bs: int, steps: int, args: argparse.Namespace
                   ) -> tuple[StepMessage, list[StepMessage]]:
    """Clear the engine's page mappings, prefill `bs` fresh requests (waited for) and return
    that prefill's message and the `steps` decode messages that follow it."""
    engine.page_table.fill_(engine.kv_pool.dummy_page)
    engine.row_pages[:] = 0
    prefill, decodes = step_messages(engine, bs, steps, args.prompt_len, args.temperature,
                                     args.control_settings)
    engine.launch(prefill).wait()
    return prefill, decodes


def profile(engine: Engine, bs: int, args: argparse.Namespace) -> list[str]:
    _, decodes = start_requests(engine, bs, args.steps, args)
    warm, timed = decodes[:10], decodes[10:]
    for msg in warm:
        engine.launch(msg).wait()
    # Serial: each step to its end before the next.
    half = len(timed) // 2
    start = time.perf_counter()
    launch_time = 0.0
    for msg in timed[:half]:
        t = time.perf_counter()
        handle = engine.launch(msg)
        launch_time += time.perf_counter() - t
        handle.wait()
    serial = (time.perf_counter() - start) / half
    # Pipelined like overlap: launch N+1, then wait for N.
    start = time.perf_counter()
    pending = None
    for msg in timed[half:]:
        handle = engine.launch(msg)
        if pending is not None:
            pending.wait()
        pending = handle
    pending.wait()
    pipelined = (time.perf_counter() - start) / (len(timed) - half)
    replay = graph_replay_ms(engine, bs)
    if args.trace:
        print_trace(engine, bs, args)
    return [str(bs), f"{replay:.3f}" if replay else "-", f"{launch_time / half * 1e3:.3f}",
            f"{serial * 1e3:.3f}", f"{pipelined * 1e3:.3f}", f"{bs / pipelined:,.0f}"]


def graph_replay_ms(engine: Engine, bs: int, repeats: int = 50) -> float | None:
    runner = engine.graph_runner
    if runner is None or bs > runner.max_bs:
        return None
    size = runner.sizes[int(np.searchsorted(runner.sizes, bs))]
    graph = runner.graphs[size]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def print_prefill_trace(engine: Engine, args: argparse.Namespace) -> None:
    """Host ops of one request's prefill (`--prompt-len` tokens, eager: no CUDA graph), the step
    a newly arrived request costs the device's other requests under continuous batching."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prefill, _ = start_requests(engine, 1, 1, args)  # its first run warms up
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        handle = engine.launch(prefill)
        timings.append(time.perf_counter() - start)
        handle.wait()
    print(f"one request's prefill of {args.prompt_len} tokens: launch host "
          f"{min(timings) * 1e3:.2f} ms (best of 5)")
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.launch(prefill).wait()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def print_trace(engine: Engine, bs: int, args: argparse.Namespace) -> None:
    _, decodes = start_requests(engine, bs, 30, args)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for msg in decodes[20:]:
            engine.launch(msg).wait()
    averages = prof.key_averages()
    print(f"10 decode steps at batch {bs}, controls {args.control_name}: host ops by own CPU "
          "time")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20))
    print(f"10 decode steps at batch {bs}, controls {args.control_name}: GPU kernels "
          "(CUDA-graph replays included)")
    print(averages.table(sort_by="self_device_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--backends", nargs="+", default=["flashinfer", "triton"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                        help="context of every request before its decode steps")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--controls", nargs="+", default=["none"],
                        choices=list(configurations(1000, each=True)),
                        help="sampling-control configurations of bench_sampling_controls.py")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(shape_config(args.shape), Path(tmp) / "model")
        for backend in args.backends:
            config = EngineConfig(
                model_dir=str(folder), page_size=args.page_size, load_format="dummy",
                attention_backend=backend, max_running_requests=max(args.batch_sizes),
                max_total_tokens=max(args.batch_sizes) * (args.prompt_len + args.steps + 64),
                cuda_graph_max_bs=args.cuda_graph_max_bs)
            engine = Engine(config, 0, str(Path(tmp) / f"store-{backend}"))
            known = configurations(engine.model_config.vocab_size, each=True)
            for name in args.controls:
                args.control_name, args.control_settings = name, known[name]
                for bs in args.batch_sizes:
                    rows.append([backend, name, *profile(engine, bs, args)])
            if args.trace:
                print_prefill_trace(engine, args)
            del engine
            destroy_process_group()
    sampling = f"temperature {args.temperature}" if args.temperature > 0 else "greedy"
    print(f"shape {args.shape}, page size {args.page_size}, {sampling}, prompt "
          f"{args.prompt_len} tokens, {args.steps} steps")
    print(markdown_table(["backend", "controls", "batch", "graph replay ms", "launch host ms",
                          "serial step ms", "pipelined step ms", "pipelined tok/s"], rows))


if __name__ == "__main__":
    main()
