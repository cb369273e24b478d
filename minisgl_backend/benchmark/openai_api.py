"""The OpenAI front door's overhead: the same requests through it and straight to `minisgl`.

One tritonserver serves a copy of `model_repository/minisgl` (`--model`'s checkpoint and the
engine settings given as its parameters) and one front door (`python -m
minisgl_backend.openai_server`) stands in front of it. A fixed workload (random token-id
prompts, greedy, exactly `--output-tokens` each)
goes at `--concurrency` (the next request sent when one ends), streamed, both ways: to
`/v1/completions` (prompts as token ids, SSE with the usage chunk) and to the `minisgl` model over
tritonclient's asyncio gRPC streaming, one stream per request as the front door opens them.
Output tok/s = tokens the engine reports (usage; `output_ids`) / (first request sent -> last
response). The two paths alternate `--repeats` times after a warmup of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.serving import server_parameters
from minisgl_backend.benchmark.tritonserver import (REPO_ROOT, Tritonserver, free_ports,
                                                    http_status, set_parameters,
                                                    triton_environment)
from minisgl_backend.benchmark.workloads import Workload, fixed_workload

HEADER = ("path", "concurrency", "requests", "output tokens", "seconds", "output tok/s",
          "vs gRPC")
GRPC, FRONT_DOOR = "minisgl over gRPC", "OpenAI front door"
NAME = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")


async def grpc_request(client: Any, prompt: list[int], max_tokens: int, rid: str) -> int:
    """One streamed request to `minisgl`; the tokens it generated."""
    from minisgl_backend.openai_server.engine import MODEL, tensor

    inputs = [tensor("input_ids", prompt), tensor("max_tokens", max_tokens),
              tensor("ignore_eos", True), tensor("stream", True)]
    ended = asyncio.Event()

    async def requests() -> Any:
        yield {"model_name": MODEL, "inputs": inputs, "request_id": rid,
               "parameters": {"triton_enable_empty_final_response": True}}
        await ended.wait()

    tokens = 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(str(error))
        ids = result.as_numpy("output_ids")
        tokens += 0 if ids is None else ids.size
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    ended.set()
    return tokens


async def front_door_request(http: aiohttp.ClientSession, url: str, prompt: list[int],
                             max_tokens: int) -> int:
    """One streamed completion; the tokens its usage chunk reports."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens, done = 0, 0
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done += 1
            elif line.startswith(b"data: "):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    if done != 1:
        raise RuntimeError(f"a stream ended with {done} [DONE]")
    return tokens


async def timed(workload: Workload, concurrency: int,
                send: Callable[[int], Awaitable[int]]) -> tuple[float, int]:
    """(seconds, output tokens) of the workload, `concurrency` requests in flight."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with slots:
            return await send(i)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(len(workload))))
    return time.perf_counter() - start, sum(tokens)


async def measure(args: argparse.Namespace, grpc_url: str, openai_url: str,
                  workload: Workload, warmup: Workload) -> dict[str, list[tuple[float, int]]]:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)
    runs: dict[str, list[tuple[float, int]]] = {GRPC: [], FRONT_DOOR: []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        def sender(path: str, load: Workload) -> Callable[[int], Awaitable[int]]:
            def send(i: int) -> Awaitable[int]:
                max_tokens = load.params[i].max_tokens
                if path == GRPC:
                    return grpc_request(client, load.prompts[i], max_tokens, f"bench-{i}")
                return front_door_request(http, openai_url, load.prompts[i], max_tokens)
            return send

        for path in runs:
            await timed(warmup, args.concurrency, sender(path, warmup))
        for _ in range(args.repeats):
            for path in runs:
                runs[path].append(await timed(workload, args.concurrency,
                                              sender(path, workload)))
                print(f"{path}: {runs[path][-1][0]:.2f} s", flush=True)
    await client.close()
    return runs


def start_front_door(grpc_url: str, metrics_url: str, work: Path) -> tuple[subprocess.Popen,
                                                                           str]:
    (port,) = free_ports(1)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("OPENAI_API_KEY", None)
    with open(work / "openai.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "minisgl_backend.openai_server", "--triton-url", grpc_url,
             "--metrics-url", metrics_url, "--port", str(port), "--host", "127.0.0.1",
             "--served-model-name", NAME, "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while http_status(f"http://127.0.0.1:{port}/health") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the front door did not start: {work / 'openai.log'}")
        time.sleep(0.5)
    return process, f"http://127.0.0.1:{port}/v1/completions"


def run(args: argparse.Namespace) -> None:
    with cli.model_folder(args) as (folder, config), \
            tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        work = Path(tmp)
        vocab = config["vocab_size"]
        workload = fixed_workload(vocab, args.requests, args.prompt_tokens, args.output_tokens,
                                  seed=args.seed)
        warmup = fixed_workload(vocab, args.concurrency, 32, 8, seed=args.seed + 1)
        repository = work / "model_repository"
        shutil.copytree(REPO_ROOT / "model_repository" / "minisgl", repository / "minisgl",
                        ignore=shutil.ignore_patterns("__pycache__"))
        config_path = repository / "minisgl" / "config.pbtxt"
        config_path.write_text(set_parameters(config_path.read_text(),
                                              server_parameters(args, folder)))
        server = Tritonserver.start(repository, work / "server.log", triton_environment())
        door = None
        try:
            server.wait_ready(900.0)
            door, url = start_front_door(server.grpc_url, server.metrics_url, work)
            runs = asyncio.run(measure(args, server.grpc_url, url, workload, warmup))
        except BaseException:
            print(f"tritonserver log tail:\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            if door is not None:
                door.terminate()
                door.wait(timeout=30)
            server.stop()
    rates = {path: [tokens / seconds for seconds, tokens in results]
             for path, results in runs.items()}
    best = {path: max(values) for path, values in rates.items()}
    rows = []
    for path, results in runs.items():
        seconds, tokens = min(results)
        rows.append([path, str(args.concurrency), str(len(workload)), str(tokens),
                     f"{seconds:.2f}", f"{best[path]:.1f}",
                     f"{best[path] / best[GRPC]:.2f}x"])
    cli.report(args, f"{len(workload)} requests of {args.prompt_tokens} prompt tokens and "
               f"exactly {args.output_tokens} output tokens, streamed, through the OpenAI front "
               f"door (/v1/completions, SSE) against straight to the minisgl model over gRPC; "
               f"best of {args.repeats} alternating runs each",
               HEADER, rows, config, notes=[f"runs (tok/s): {rates}"],
               json_path=args.json, results=rates)
