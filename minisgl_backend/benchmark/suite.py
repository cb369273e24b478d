"""The GPU suite: the GPU tests, then the benchmarks, one after another, each bounded in time.

Every step runs with its own time limit and logs into OUT/<step>.log (its tail is echoed; the
benchmarks' engines write their device timelines into OUT/steps). A step that would not fit in
what is left of `--budget-s` is skipped and says so, and so is one whose needs (tritonserver and
perf_analyzer, two GPUs) are missing. The kernels are compiled first (`kernels --warm`:
FlashInfer JIT-compiles on first use, minutes on a fresh machine).
`--steps` picks groups: tests, offline, decode, mechanisms, controls, structured, speculative,
fp8, lora, kernels, serving, tp. A step's command may name the logs' folder as `{out}` (JSON
results).

On a GPU host without a package index, what it lacks travels in `.carry/` (git-ignored):
`site.tar.xz` (built by the `pack` subcommand from pinned wheels) is unpacked once into
/tmp/site and put on PYTHONPATH, and tritonserver is prepared from its wheel
(`scripts/install_triton.py --no-install`) when none is on PATH; `kernel-cache.tar.xz` (what
`--save-kernels` wrote into OUT) restores compiled kernels.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from minisgl_backend.benchmark.cli import REPO_ROOT

GROUPS = ("tests", "offline", "decode", "mechanisms", "controls", "structured", "speculative",
          "fp8", "lora", "kernels", "serving", "tp")
KERNEL_TESTS = ("test_triton_attention.py test_qkv_prologue.py test_fused_moe.py "
                "test_activation.py test_sampling_kernel.py test_gemv.py test_logit_edits.py "
                "test_penalties.py test_logprob_kernel.py test_token_masks_kernel.py "
                "test_kernel_launch.py test_fp8_kernels.py test_fp8_kv_cache.py "
                "test_lora_kernel.py")
ENGINE_TESTS = ("test_gpu_engine.py test_gpu_sampling_controls.py test_gpu_speculative.py "
                "test_sliding_window_gpu.py test_gpu_architectures.py test_device_wait.py "
                "test_gpu_fp8.py")
# Llama 3's tokens at their own vocabulary size: xgrammar's accepts slow with ids missing.
JSON = "--tokenizer llama-3 --vocab-size 128256 --max-total-tokens 65536 --batch-sizes 1 64 256"


@dataclass
class Step:
    group: str
    name: str
    limit_s: int
    command: str  # a subcommand's arguments ({out}: the logs' folder), or "tests FILE ... [-k X]"
    needs: str = ""  # "triton": tritonserver and perf_analyzer; "2gpu": two GPUs

    def argv(self, out: Path) -> list[str]:
        words = [word.replace("{out}", str(out)) for word in shlex.split(self.command)]
        if words[0] == "tests":
            return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    *(f"tests/{w}" if w.endswith(".py") else w for w in words[1:])]
        return [sys.executable, "-m", "minisgl_backend.benchmark", *words]


STEPS = [
    Step("kernels", "warm", 900, "kernels --warm --page-sizes 16 1"),
    Step("tests", "tests-kernels", 600, f"tests {KERNEL_TESTS}"),
    Step("tests", "tests-engine", 900, f"tests {ENGINE_TESTS}"),
    Step("tests", "tests-lora", 300, "tests test_lora.py -k gpu"),
    *(Step("offline", f"offline-{s}", 300, f"offline --shape {s} --page-size 64 --detokenize both")
      for s in ("qwen3-0.6b", "llama-3.1-8b")),
    Step("decode", "decode-llama-3.1-8b", 600,
         "decode --shape llama-3.1-8b --batch-sizes 1 8 64 256 --repeats 1"),
    Step("decode", "decode-qwen3-0.6b", 300, "decode --shape qwen3-0.6b --batch-sizes 1 2 4 "
         "--vary cuda_graph_max_bs=0 --vary fused_gemv_max_bs=0"),
    Step("mechanisms", "mechanisms-anchor", 300, "offline --shape qwen3-0.6b --num-requests 64 "
         "--vary cuda_graph_max_bs=0 --vary overlap=false"),
    Step("mechanisms", "mechanisms-prefix", 180,
         "offline --shape qwen3-0.6b --workload shared-prefix --vary cache=naive"),
    Step("mechanisms", "mechanisms-kv-events", 240,
         "offline --shape qwen3-0.6b --num-requests 64 --page-size 16 "
         "--vary kv_events_endpoint=ipc:///tmp/minisgl-kv-events"),
    *(Step("controls", f"controls-{s}", 240, f"controls --shape {s} --batch-sizes 1 64 256")
      for s in ("qwen3-0.6b", "llama-3.1-8b")),
    *(Step("structured", f"structured-{s}", 300, f"structured --shape {s} {JSON}")
      for s in ("qwen3-0.6b", "llama-3.1-8b")),
    Step("speculative", "speculative-llama-3.1-8b", 420,
         "speculative --shape llama-3.1-8b --max-tokens 128 --attention-backend triton"),
    Step("fp8", "fp8-accuracy", 240, "fp8 --parts accuracy --json {out}/fp8-accuracy.json"),
    Step("fp8", "fp8-llama-3.1-8b", 480,
         "fp8 --shape llama-3.1-8b --repeats 1 --json {out}/fp8-llama-3.1-8b.json"),
    *(Step("lora", f"lora-{s}", 300, f"lora --shape {s} --batch-sizes 1 64 --repeats 1")
      for s in ("qwen3-0.6b", "llama-3.1-8b")),
    Step("kernels", "kernels", 300, "kernels --batch-sizes 1 8 64 256 --page-sizes 16 64"),
    Step("serving", "serving-qwen3-0.6b", 600, "serving --shape qwen3-0.6b --page-size 64",
         "triton"),
    Step("serving", "openai-front-door", 600, "openai_api --concurrency 16 --requests 256",
         "triton"),
    Step("tp", "offline-llama-3.1-8b-tp2", 300,
         "offline --shape llama-3.1-8b --page-size 64 --tp-size 2", "2gpu"),
    Step("tp", "decode-llama-3.1-8b-tp2", 240,
         "decode --shape llama-3.1-8b --batch-sizes 1 --tp-size 2", "2gpu"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, nargs="?", default=Path("gpu-logs"),
                        help="the logs' folder (default: ./gpu-logs)")
    parser.add_argument("--budget-s", type=int, default=3000,
                        help="seconds for the whole suite; steps that would not fit are skipped")
    parser.add_argument("--steps", nargs="+", choices=GROUPS, default=list(GROUPS))
    parser.add_argument("--no-warm", action="store_true", help="do not compile kernels first")
    parser.add_argument("--save-kernels", action="store_true",
                        help="write the compiled kernels to OUT/kernel-cache.tar.xz")


def shell_environment(script: str, env: dict[str, str]) -> dict[str, str]:
    """`env` as the bash lines `script` leave it."""
    out = subprocess.run(["bash", "-c", f"{script} >&2 && env -0"], env=env, check=True,
                         stdout=subprocess.PIPE).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def environment(out: Path) -> dict[str, str]:
    """This environment, with what `.carry/` holds, NVLink multicast off, output unbuffered."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    paths = [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    site, carry = Path("/tmp/site"), REPO_ROOT / ".carry"
    if (carry / "site.tar.xz").is_file():
        if not (site / ".unpacked").exists():  # once per machine (a warm one keeps /tmp)
            site.mkdir(parents=True, exist_ok=True)
            subprocess.run(["tar", "-I", "xz -T0", "-xf", str(carry / "site.tar.xz"), "-C",
                            str(site)], check=True)
            (site / ".unpacked").touch()
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if (carry / "kernel-cache.tar.xz").is_file():
        subprocess.run(["tar", "-I", "xz -T0", "-xf", str(carry / "kernel-cache.tar.xz"), "-C",
                        str(Path.home())], check=True)
    if not shutil.which("tritonserver"):
        with open(out / "install_triton.log", "wb") as log:
            done = subprocess.run([sys.executable, "scripts/install_triton.py", "--no-install",
                                   "--prefix", "/tmp/triton"], cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode == 0
        if done:
            env = shell_environment(". /tmp/triton/env.sh", env)
    return env


def run_step(step: Step, env: dict[str, str], out: Path) -> int:
    """The step's exit code (124: stopped at its limit, with every process it started)."""
    with open(out / f"{step.name}.log", "wb") as log:
        process = subprocess.Popen(step.argv(out), cwd=REPO_ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124


def run(args: argparse.Namespace) -> None:
    import torch

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start, gpus, env = time.monotonic(), torch.cuda.device_count(), None
    print(f"== {gpus} GPU(s); steps: {' '.join(args.steps)}; budget {args.budget_s} s", flush=True)
    for step in STEPS:
        if step.group not in args.steps or (step.name == "warm" and args.no_warm):
            continue
        if time.monotonic() - start + step.limit_s > args.budget_s:
            print(f"== {step.name}: skipped (budget)", flush=True)
            continue
        env = env or environment(out)
        triton = all(shutil.which(tool, path=env.get("PATH"))
                     for tool in ("tritonserver", "perf_analyzer"))
        if {"triton": not triton, "2gpu": gpus < 2}.get(step.needs, False):
            print(f"== {step.name}: skipped (needs {step.needs})", flush=True)
            continue
        extra = {} if step.needs == "2gpu" else {"CUDA_VISIBLE_DEVICES": "0"}
        if step.group != "tests":  # the engines' device timelines, beside the tables
            extra["MINISGL_STEP_TIMES_DIR"] = str(out / "steps")
        code = run_step(step, {**env, **extra}, out)
        tail = (out / f"{step.name}.log").read_text(errors="replace").splitlines()[-12:]
        print(f"== {step.name}: exit {code} at {time.monotonic() - start:.0f} s", *tail,
              sep="\n", flush=True)
    if args.save_kernels:
        cached = [p for p in (".cache/flashinfer", ".triton/cache") if (Path.home() / p).exists()]
        subprocess.run(["tar", "-I", "xz -T0 -3", "-cf", str(out / "kernel-cache.tar.xz"), "-C",
                        str(Path.home()), *cached], check=True)
    print(f"== done at {time.monotonic() - start:.0f} s; logs in {out}")
