"""Served throughput: a workload through tritonserver + perf_analyzer, next to the offline API.

`offline`'s workloads (default: the anchor) go to the decoupled `minisgl` model by perf_analyzer
over gRPC streaming at each `--concurrency` C, with one perf_analyzer thread, which fills every
free slot with the next request (its default 16 threads each own a fixed share of the requests
and leave slots idle in the tail). Compared with the offline API at the same concurrency
(`max_running_requests=C`, the next request submitted when one ends; "all": every request at
once), run first; then a tritonserver serving a copy of `model_repository/minisgl` with this
model and these engine settings as parameters. One engine at a time, each warmed up.

From perf_analyzer's profile export: seconds = first request sent -> last response; TTFT = sent
-> first response; ITL = (last - first response) / (tokens - 1); mean in flight = the requests'
latencies summed / seconds. Output tokens are the requested ones, checked against the server's
own count (`minisgl_generated_tokens_total` on /metrics). `--url HOST:PORT` measures a running
server's `minisgl` model instead (no offline rows, no token check). tritonserver and
perf_analyzer come from PATH, else from `scripts/triton_env.sh`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minisgl_backend.benchmark import cli
from minisgl_backend.benchmark.offline import add_workload_args, make_workload
from minisgl_backend.benchmark.tritonserver import (REPO_ROOT, Tritonserver, set_parameters,
                                                    triton_environment)
from minisgl_backend.benchmark.workloads import Workload, fixed_workload

HEADER = ("concurrency", "path", "requests", "output tokens", "seconds", "output tok/s",
          "vs offline", "mean TTFT ms", "mean ITL ms", "mean in flight")
OFFLINE, SERVER, MODEL = "offline API", "tritonserver + perf_analyzer", "minisgl"
GENERATED = "minisgl_generated_tokens_total"  # the model's counter on /metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_model_args(parser)
    cli.add_llm_args(parser)
    add_workload_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--url", help="a running server's gRPC HOST:PORT (no offline rows)")


@dataclass
class Run:
    """Per-request times in seconds on one clock: sent, first token, last token; tokens."""

    concurrency: str
    path: str
    sent: list[float]
    first: list[float]
    last: list[float]
    tokens: list[int]

    @property
    def seconds(self) -> float:
        return max(self.last) - min(self.sent)

    def row(self, versus: str) -> list[str]:
        gaps = [(b - a) / (k - 1) for a, b, k in zip(self.first, self.last, self.tokens) if k > 1]
        ttft = statistics.fmean(f - s for f, s in zip(self.first, self.sent))
        in_flight = sum(b - a for a, b in zip(self.sent, self.last)) / self.seconds
        return [self.concurrency, self.path, str(len(self.tokens)), str(sum(self.tokens)),
                f"{self.seconds:.3f}", f"{sum(self.tokens) / self.seconds:.1f}", versus,
                f"{1e3 * ttft:.1f}", f"{1e3 * statistics.fmean(gaps):.2f}" if gaps else "-",
                f"{in_flight:.1f}"]


def run_offline(llm: Any, workload: Workload, concurrency: int, label: str) -> Run:
    """`workload` through `llm`'s scheduler, the next request submitted when one of the
    `concurrency` in flight ends."""
    n = len(workload)
    sent, first, last, tokens, errors = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n, []
    slots, finished = threading.Semaphore(concurrency), threading.Semaphore(0)

    def callback_for(i: int):  # noqa: ANN202 - a closure over the request's index
        def on_output(out: Any) -> None:  # on the scheduler thread
            now = time.perf_counter()
            if out.token_ids:
                first[i], last[i] = first[i] or now, now
                tokens[i] += len(out.token_ids)
            if out.finished:
                if out.error:
                    errors.append(f"request {i}: {out.error}")
                slots.release()
                finished.release()

        return on_output

    for i in range(n):
        slots.acquire()
        sent[i] = time.perf_counter()
        llm.scheduler.submit(workload.prompts[i], workload.params[i], callback_for(i))
    for _ in range(n):
        finished.acquire()
    if errors or tokens != [p.max_tokens for p in workload.params]:
        raise RuntimeError(f"offline API: not every request got its tokens; {errors[:5]}")
    return Run(label, OFFLINE, sent, first, last, tokens)


def offline_runs(args: argparse.Namespace, folder: Path, workload: Workload,
                 warmup: Workload) -> dict[str, Run]:
    """"all" and each concurrency; one engine per max_running_requests value, in turn."""
    plans = {"all": (args.max_running_requests or 256, len(workload)),
             **{str(c): (c, min(c, len(workload))) for c in args.concurrency}}
    runs: dict[str, Run] = {}
    for running in dict.fromkeys(m for m, _ in plans.values()):
        with cli.make_llm(args, folder, max_running_requests=running) as llm:
            run_offline(llm, warmup, len(warmup), "warmup")
            measured: dict[int, Run] = {}
            for name, (m, in_flight) in plans.items():
                if m == running:
                    if in_flight not in measured:  # "all" and C = every request: one run
                        measured[in_flight] = run_offline(llm, workload, in_flight, name)
                    runs[name] = replace(measured[in_flight], concurrency=name)
                    print(f"offline API, {name}: {runs[name].seconds:.3f} s", flush=True)
    return runs


def input_data(workload: Workload, path: Path) -> Path:
    """perf_analyzer `--input-data`: one entry per request, in order."""
    entries = [{"input_ids": {"content": prompt, "shape": [len(prompt)]},
                "max_tokens": [p.max_tokens], "temperature": [p.temperature],
                "ignore_eos": [p.ignore_eos], "stream": [True]}
               for prompt, p in zip(workload.prompts, workload.params)]
    path.write_text(json.dumps({"data": entries}))
    return path


def perf_analyzer(url: str, env: dict[str, str], data: Path, concurrency: int, count: int,
                  work: Path, name: str) -> Path:
    """One perf_analyzer measurement of exactly `count` requests; its profile export."""
    export = work / f"{name}.export.json"
    export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
    command = ["perf_analyzer", "-m", MODEL, "-u", url, "-i", "grpc", "--streaming",
               "--input-data", str(data), "--concurrency-range", f"{concurrency}:{concurrency}",
               "--request-count", str(count), "--max-threads", "1",
               "--profile-export-file", str(export)]
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        if subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"perf_analyzer failed: {' '.join(command)}\nlog {log}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
    return export


def read_export(export: Path, concurrency: int, workload: Workload) -> Run:
    """The export's requests, matched to the workload's entries by prompt (it lists them per
    worker thread); each entry must have gone out once. Its output values are unusable (one
    garbage scalar per output tensor), so tokens are the requested ones."""
    requests = [r for e in json.loads(export.read_text())["experiments"] for r in e["requests"]]
    index = {tuple(p): i for i, p in enumerate(workload.prompts)}

    def prompt(request: dict[str, Any]) -> tuple[int, ...]:
        ids = (request.get("request_inputs") or {}).get("input_ids")
        ids = ids.get("content") if isinstance(ids, dict) else ids
        return tuple(ids if isinstance(ids, list) else [ids])

    order = [index.get(prompt(r)) for r in requests]
    if sorted(i for i in order if i is not None) != list(range(len(workload))):
        raise RuntimeError(f"concurrency {concurrency}: the data entries did not go out once "
                           f"each ({len(requests)} requests for {len(workload)} entries)")
    stamps = [r["response_timestamps"] for r in requests]
    return Run(str(concurrency), SERVER, [r["timestamp"] / 1e9 for r in requests],
               [ts[0] / 1e9 for ts in stamps], [ts[-1] / 1e9 for ts in stamps],
               [workload.params[i].max_tokens for i in order])


def server_runs(args: argparse.Namespace, folder: Path, workload: Workload, warmup: Workload,
                work: Path) -> dict[str, Run]:
    env = triton_environment()
    data, warmup_data = input_data(workload, work / "input.json"), input_data(
        warmup, work / "warmup.json")
    server = None
    if args.url is None:
        repository = work / "model_repository"
        shutil.copytree(REPO_ROOT / "model_repository" / MODEL, repository / MODEL,
                        ignore=shutil.ignore_patterns("__pycache__"))
        config = repository / MODEL / "config.pbtxt"
        config.write_text(set_parameters(config.read_text(), server_parameters(args, folder)))
        server = Tritonserver.start(repository, work / "server.log", env)
        print(f"tritonserver pid {server.process.pid}, log {server.log_path}", flush=True)
    url = args.url or server.grpc_url
    runs = {}
    try:
        if server is not None:
            server.wait_ready(900.0)
        perf_analyzer(url, env, warmup_data, len(warmup), len(warmup), work, "warmup")
        for c in args.concurrency:
            for attempt in range(2):  # perf_analyzer has (rarely) exited 0, its export empty
                before = server.model_metrics()[GENERATED] if server else 0
                export = perf_analyzer(url, env, data, c, len(workload), work, f"c{c}")
                generated = server.model_metrics()[GENERATED] - before if server else None
                if generated not in (None, workload.output_tokens):
                    raise RuntimeError(f"concurrency {c}: the server generated {generated:.0f} "
                                       f"tokens, the workload asks for {workload.output_tokens}")
                if export.stat().st_size > 0:
                    break
            runs[str(c)] = read_export(export, c, workload)
            print(f"tritonserver, concurrency {c}: {runs[str(c)].seconds:.3f} s", flush=True)
    except BaseException:
        if server is not None:
            print(f"tritonserver log tail:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
    return runs


def server_parameters(args: argparse.Namespace, folder: Path) -> dict[str, str]:
    """The `minisgl` model's parameters: the offline rows' engine settings."""
    return {"model": str(folder.resolve()), **{
        key: str(value).lower() if isinstance(value, bool) else str(value)
        for key, value in cli.llm_kwargs(args).items()}}


def run(args: argparse.Namespace) -> None:
    args.concurrency = list(dict.fromkeys(args.concurrency))
    with cli.model_folder(args, tokenizer=False) as (folder, config), \
            tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        work = Path(tmp)
        workload = make_workload(args, folder, config["vocab_size"])
        warmup = fixed_workload(config["vocab_size"], 8, 32, 8, seed=args.seed + 1)
        offline = {} if args.url else offline_runs(args, folder, workload, warmup)
        served = server_runs(args, folder, workload, warmup, work)
    rows = [offline["all"].row("-")] if offline else []
    for c in map(str, args.concurrency):
        if offline:
            rows.append(offline[c].row("-"))
        rate = sum(served[c].tokens) / served[c].seconds
        rows.append(served[c].row(f"{rate * offline[c].seconds / sum(offline[c].tokens):.1%}"
                                  if offline else "-"))
    cli.report(args, f"{args.workload} workload ({len(workload)} requests, "
               f"{workload.output_tokens} output tokens) through the server's minisgl model "
               f"against the offline API at the same concurrency ('all': every request at "
               f"once); server parameters {server_parameters(args, folder)}"
               if not args.url else f"{args.workload} workload through the server at "
               f"{args.url}", HEADER, rows, config)
