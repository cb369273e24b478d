"""The offline anchor workload through tritonserver + perf_analyzer, next to the offline API.

Issue 4, benchmark 4: the same requests as `bench_offline.py` (`anchor_workload`: 256 requests,
input and output lengths uniform in [100, 1024], temperature 0.6, ignore_eos), sent to the
decoupled `minisgl` model by perf_analyzer over gRPC streaming at each `--concurrency`, as a
ratio to the offline API's throughput at the same concurrency. Target: at least 90% at
concurrency 64.

One run, in this order (never two engines at once):

1. offline API: `LLM.generate`'s scheduler with every request at once (`max_running_requests`
   as given, LLM's default 256), then per concurrency C with `max_running_requests=C` and C
   requests in flight (the next one is submitted when one finishes, as perf_analyzer does);
   each LLM is warmed up (8 short requests) and shut down before the next starts;
2. tritonserver serving only `minisgl` (a copy of `model_repository/minisgl` whose parameters
   are `model` = the shape's dummy folder, `load_format` = dummy and the engine settings
   below), on free ports, log in the work folder; after a warm-up (the same 8 requests),
   `perf_analyzer -m minisgl -i grpc --streaming --concurrency-range C:C --request-count N`
   per C, with one `--input-data` entry per request (`input_ids`, `max_tokens`,
   `temperature`, `ignore_eos`, `stream`), and the server is stopped whatever happens.

From perf_analyzer's profile export: seconds = first request sent -> last response, TTFT =
request sent -> first response, ITL = (last - first response) / (tokens - 1) per request,
mean in flight = sum of request latencies / seconds; output tokens = the requested ones (the
export's output values are unusable), checked against the server's own count of generated
tokens (`minisgl_generated_tokens_total` on /metrics) around each run. The model streams a
request's tokens as they come, several in one response when they queued up meanwhile.
Each data entry must have gone out exactly once (matched by prompt: perf_analyzer's threads
take entries t, t+T, t+2T, ... and split --request-count between them). By default
perf_analyzer runs one thread (`--pa-max-threads 1`), which fills every free slot with the
next request, as the offline rows do: with its default 16 threads each thread owns a fixed
share of the requests and slots sit idle in the tail (47.7-49.3 requests in flight on average
at C=64 against 56-57; benchmark/RESULTS.md). The offline rows are timed the same way on the
scheduler's callbacks.

    python scripts/bench_triton_offline.py                      # Llama-3.1-8B shape on the GPU
    python scripts/bench_triton_offline.py --shape qwen3-0.6b --concurrency 64 256
    python scripts/bench_triton_offline.py --device cpu --shape tiny-qwen3 --num-requests 4 \\
        --min-len 4 --max-len 12 --concurrency 2                # CPU smoke test

`tritonserver` and `perf_analyzer` come from PATH when both are there (`TRITON_BACKEND_DIR`,
when set, is the server's backend directory), else from `scripts/triton_env.sh`.
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

from minisgl_backend.benchmark.cli import (
    add_llm_args,
    add_model_args,
    engine_dtype,
    llm_kwargs,
    markdown_table,
    model_folder,
    print_header,
)
from minisgl_backend.benchmark.tritonserver import (
    REPO_ROOT,
    Tritonserver,
    set_parameters,
    triton_environment,
)
from minisgl_backend.benchmark.workloads import (
    Workload,
    anchor_workload,
    fixed_workload,
)

HEADER = ("concurrency", "path", "requests", "output tokens", "seconds", "output tok/s",
          "vs offline", "mean TTFT ms", "mean ITL ms", "mean in flight")
OFFLINE, SERVER = "offline API", "tritonserver + perf_analyzer"
MODEL = "minisgl"
GENERATED = "minisgl_generated_tokens_total"  # counter of the model on /metrics
EXPORT_ATTEMPTS = 2  # perf_analyzer runs per concurrency when its export comes back empty


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_llm_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256],
                        help="requests in flight (perf_analyzer --concurrency-range C:C)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="input and output lengths")
    parser.add_argument("--max-len", type=int, default=1024, help="input and output lengths")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra tritonserver option, e.g. "
                             "--server-arg=--allow-gpu-metrics=false (repeatable)")
    parser.add_argument("--pa-max-threads", type=int, default=1,
                        help="perf_analyzer --max-threads; 1 (default): one thread serves "
                             "every slot in request order, as the offline rows do; 0: "
                             "perf_analyzer's own default (16 threads, each owning a fixed "
                             "share of the requests, which leaves slots idle in the tail)")
    parser.add_argument("--server-timeout", type=float, default=900.0,
                        help="seconds for tritonserver to become ready")
    parser.add_argument("--keep-dir", type=Path, default=None,
                        help="keep the model repository, perf_analyzer data, profile exports "
                             "and logs in this folder")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.num_requests < 1:
        parser.error("--concurrency and --num-requests must be >= 1")
    return args


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

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(f - s for f, s in zip(self.first, self.sent))

    @property
    def mean_itl_s(self) -> float | None:
        gaps = [(b - a) / (k - 1) for a, b, k in zip(self.first, self.last, self.tokens) if k > 1]
        return statistics.fmean(gaps) if gaps else None

    @property
    def mean_in_flight(self) -> float:
        """Requests sent and not finished, averaged over the run."""
        return sum(b - a for a, b in zip(self.sent, self.last)) / self.seconds


def check_tokens(what: str, tokens: list[int], workload: Workload) -> None:
    wrong = [f"request {i}: {got} of {p.max_tokens}" for i, (got, p)
             in enumerate(zip(tokens, workload.params)) if got != p.max_tokens]
    if wrong:
        raise RuntimeError(f"{what}: {len(wrong)} requests did not get all their tokens: "
                           + ", ".join(wrong[:8]))


# ----- offline API ----------------------------------------------------------------------------


def run_offline(llm: Any, workload: Workload, concurrency: int, label: str) -> Run:
    """`workload` through `llm`'s scheduler with at most `concurrency` requests submitted and
    unfinished (the next one goes in when one ends, as perf_analyzer does)."""
    n = len(workload)
    sent, first, last = [0.0] * n, [0.0] * n, [0.0] * n
    tokens, errors = [0] * n, []
    state = {"next": 0, "finished": 0}
    lock = threading.RLock()  # a request refused at once calls back inside submit
    done = threading.Event()

    def submit_next() -> None:
        with lock:
            i = state["next"]
            if i >= n:
                return
            state["next"] = i + 1
        sent[i] = time.perf_counter()
        llm.scheduler.submit(workload.prompts[i], workload.params[i], callback_for(i))

    def callback_for(i: int):  # noqa: ANN202
        def on_output(out: Any) -> None:  # on the scheduler thread
            now = time.perf_counter()
            if out.token_ids:
                first[i] = first[i] or now
                last[i] = now
                tokens[i] += len(out.token_ids)
            if out.finished:
                if out.error:
                    errors.append(f"request {i}: {out.error}")
                with lock:
                    state["finished"] += 1
                    if state["finished"] == n:
                        done.set()
                submit_next()

        return on_output

    for _ in range(min(concurrency, n)):
        submit_next()
    done.wait()
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    check_tokens("offline API", tokens, workload)
    return Run(label, OFFLINE, sent, first, last, tokens)


def offline_runs(args: argparse.Namespace, folder: Path, workload: Workload,
                 warmup: Workload) -> dict[str, Run]:
    """"all" and each concurrency; one LLM per max_running_requests value, one at a time."""
    from minisgl_backend import LLM

    n = len(workload)
    plans = {"all": (args.max_running_requests or 256, n)}  # (max running, in flight)
    for c in args.concurrency:
        plans[str(c)] = (c, min(c, n))
    runs: dict[str, Run] = {}
    for max_running in dict.fromkeys(m for m, _ in plans.values()):
        with LLM(folder, **llm_kwargs(args, max_running_requests=max_running)) as llm:
            run_offline(llm, warmup, len(warmup), "warmup")
            measured: dict[int, Run] = {}
            for name, (m, in_flight) in plans.items():
                if m != max_running:
                    continue
                if in_flight not in measured:  # e.g. "all" and 256 with 256 requests: one run
                    measured[in_flight] = run_offline(llm, workload, in_flight, name)
                    print(f"offline API, max_running_requests {m}, {in_flight} in flight: "
                          f"{measured[in_flight].seconds:.3f} s", flush=True)
                runs[name] = replace(measured[in_flight], concurrency=name)
    return runs


# ----- tritonserver + perf_analyzer -----------------------------------------------------------


def server_parameters(args: argparse.Namespace, folder: Path) -> dict[str, str]:
    """The `minisgl` model's parameters: the LLM settings of the offline runs."""
    params = {"model": str(folder.resolve())}
    for key, value in llm_kwargs(args).items():
        params[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return params


def model_repository(root: Path, parameters: dict[str, str]) -> Path:
    """`root/model_repository` holding only a copy of `model_repository/minisgl`."""
    repo = root / "model_repository"
    shutil.rmtree(repo, ignore_errors=True)  # --keep-dir of an earlier run
    shutil.copytree(REPO_ROOT / "model_repository" / MODEL, repo / MODEL,
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / MODEL / "config.pbtxt"
    config.write_text(set_parameters(config.read_text(), parameters))
    return repo


def input_data(workload: Workload, path: Path) -> Path:
    """perf_analyzer `--input-data`: one entry per request, in order."""
    entries = [{"input_ids": {"content": prompt, "shape": [len(prompt)]},
                "max_tokens": [p.max_tokens], "temperature": [p.temperature],
                "ignore_eos": [p.ignore_eos], "stream": [True]}
               for prompt, p in zip(workload.prompts, workload.params)]
    path.write_text(json.dumps({"data": entries}))
    return path


def run_perf_analyzer(args: argparse.Namespace, server: Tritonserver, env: dict[str, str],
                      data: Path, concurrency: int, count: int, work: Path, name: str) -> Path:
    """One perf_analyzer measurement of exactly `count` requests; its profile export."""
    export = work / f"{name}.export.json"
    export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
    command = ["perf_analyzer", "-m", MODEL, "-u", server.grpc_url, "-i", "grpc", "--streaming",
               "--input-data", str(data), "--concurrency-range", f"{concurrency}:{concurrency}",
               "--request-count", str(count), "--profile-export-file", str(export)]
    if args.pa_max_threads:
        command += ["--max-threads", str(args.pa_max_threads)]
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        text = log.read_text(errors="replace")
        errors = [line for line in text.splitlines() if "error" in line.lower()][:10]
        raise RuntimeError(f"perf_analyzer failed ({code}): {' '.join(command)}\n"
                           + "\n".join(errors) + f"\nlog {log}, tail:\n{text[-3000:]}")
    return export


def _as_list(value: Any) -> list[Any]:
    """A tensor of a profile export: a list, {"content": [...]}, or a bare scalar."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def read_export(export: Path, concurrency: int, workload: Workload) -> Run:
    """The requests of a profile export, matched to the workload's entries by prompt (the export
    lists them per worker thread); checks that each entry went out exactly once. Its output
    values are not usable (perf_analyzer 2.51 records one garbage scalar per output tensor), so
    tokens are the requested ones; `server_runs` checks their total on the server's metrics."""
    requests = [r for e in json.loads(export.read_text())["experiments"] for r in e["requests"]]
    what = f"perf_analyzer at concurrency {concurrency}"
    if len(requests) != len(workload):
        raise RuntimeError(f"{what}: {len(requests)} requests, expected {len(workload)}")
    index = {tuple(p): i for i, p in enumerate(workload.prompts)}
    order = [index.get(tuple(_as_list((r.get("request_inputs") or {}).get("input_ids"))))
             for r in requests]
    if sorted(i for i in order if i is not None) != list(range(len(workload))):
        missing = sorted(set(range(len(workload))) - set(order))
        raise RuntimeError(f"{what}: the data entries did not go out once each (missing "
                           f"{missing[:10]}{'...' if len(missing) > 10 else ''})")
    stamps = [r["response_timestamps"] for r in requests]
    return Run(str(concurrency), SERVER, [r["timestamp"] / 1e9 for r in requests],
               [ts[0] / 1e9 for ts in stamps], [ts[-1] / 1e9 for ts in stamps],
               [workload.params[i].max_tokens for i in order])


def server_runs(args: argparse.Namespace, folder: Path, workload: Workload, warmup: Workload,
                work: Path) -> dict[str, Run]:
    env = triton_environment()
    repository = model_repository(work, server_parameters(args, folder))
    data = input_data(workload, work / "input.json")
    warmup_data = input_data(warmup, work / "warmup.json")
    server = Tritonserver.start(repository, work / "server.log", env,
                                extra_args=tuple(args.server_arg))
    print(f"tritonserver pid {server.process.pid}, gRPC {server.grpc_url}, log "
          f"{server.log_path}", flush=True)
    runs = {}
    try:
        server.wait_ready(args.server_timeout)
        run_perf_analyzer(args, server, env, warmup_data, len(warmup), len(warmup), work,
                          "warmup")
        for c in args.concurrency:
            for attempt in range(EXPORT_ATTEMPTS):
                before = server.model_metrics()[GENERATED]
                export = run_perf_analyzer(args, server, env, data, c, len(workload), work,
                                           f"c{c}")
                generated = server.model_metrics()[GENERATED] - before
                if generated != workload.output_tokens:
                    raise RuntimeError(f"concurrency {c}: the server generated {generated:.0f} "
                                       f"tokens, the workload asks for {workload.output_tokens}")
                # perf_analyzer has (rarely) exited 0 with its export file left empty.
                if export.stat().st_size > 0 or attempt == EXPORT_ATTEMPTS - 1:
                    break
                print(f"concurrency {c}: perf_analyzer left its export empty; measuring again",
                      flush=True)
            runs[str(c)] = read_export(export, c, workload)
            print(f"tritonserver, concurrency {c}: {runs[str(c)].seconds:.3f} s", flush=True)
    except BaseException:
        print(f"tritonserver log tail:\n{server.log_tail(6000)}", file=sys.stderr)
        raise
    finally:
        server.stop()
    return runs


# ----- report ---------------------------------------------------------------------------------


def table_rows(args: argparse.Namespace, offline: dict[str, Run],
               served: dict[str, Run]) -> list[list[str]]:
    def row(run: Run, ratio: str) -> list[str]:
        itl = run.mean_itl_s
        return [run.concurrency, run.path, str(len(run.tokens)), str(sum(run.tokens)),
                f"{run.seconds:.3f}", f"{run.tokens_per_s:.1f}", ratio,
                f"{1e3 * run.mean_ttft_s:.1f}", "-" if itl is None else f"{1e3 * itl:.2f}",
                f"{run.mean_in_flight:.1f}"]

    rows = [row(offline["all"], "-")]
    for c in map(str, args.concurrency):
        rows.append(row(offline[c], "-"))
        rows.append(row(served[c], f"{served[c].tokens_per_s / offline[c].tokens_per_s:.1%}"))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.concurrency = list(dict.fromkeys(args.concurrency))
    with model_folder(args) as (folder, config), \
            tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        work = args.keep_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        workload = anchor_workload(config["vocab_size"], args.num_requests, args.min_len,
                                   args.max_len, args.seed, args.temperature)
        warmup = fixed_workload(config["vocab_size"], 8, 32, 8, seed=args.seed + 1)
        offline = offline_runs(args, folder, workload, warmup)
        served = server_runs(args, folder, workload, warmup, work)
    print()
    print_header(args, config, engine_dtype(args, config))
    print(f"anchor workload: {len(workload)} requests, lengths uniform in [{args.min_len}, "
          f"{args.max_len}], seed {args.seed}, temperature {args.temperature}, "
          f"{workload.input_tokens} input / {workload.output_tokens} output tokens")
    settings = {k: v for k, v in server_parameters(args, folder).items() if k != "model"}
    print(f"engine settings (LLM and the minisgl model's parameters): {settings}")
    print("offline 'all': every request submitted at once; offline C: max_running_requests=C "
          "and C requests in flight; tritonserver: one server for every C (max_running_requests "
          "as above, default 256). vs offline: tok/s over the offline API's at the same C.")
    print()
    print(markdown_table(HEADER, table_rows(args, offline, served)))


if __name__ == "__main__":
    main()
