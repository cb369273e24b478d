"""Two instances of the engine model in one server, and what their processes listen on.

A copy of `model_repository/` adds `minisgl_b`: another model (a tiny random Llama) on two
tensor-parallel ranks that talk over gloo, page size 16, no prefix cache. Both instances must
serve side by side, each with its own engine processes, metrics and private directory, and no
process of the server may listen on anything but loopback.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from minisgl_backend import LLM, SamplingParams
from tests.fp8_checkpoints import write_fp8_checkpoint
from tests.test_lora import make_adapter
from tests.triton_fixtures import (
    REPO_ROOT,
    TritonServer,
    _cmdline,
    descendants,
    engine_pids,
    ensemble_inputs,
    grpc_generate,
    metrics,
    start_server,
    tensor,
)

PROMPT = "The capital of France is"
MODELS = ("minisgl", "minisgl_b")
FP8_KV = "fp8_e4m3"


def _set_parameter(config: str, key: str, value: str) -> str:
    pattern = rf'(parameters {{ key: "{key}" value: {{ string_value: )"[^"]*"'
    config, count = re.subn(pattern, rf'\1"{value}"', config)
    assert count == 1, key
    return config


def two_instance_repository(root: Path, model_dir: Path, other_model_dir: Path,
                            lora_adapters: str = "") -> Path:
    repo = root / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repo,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "minisgl", repo / "minisgl_b")
    for name in ("minisgl", "minisgl_b", "preprocessing"):
        path = repo / name / "config.pbtxt"
        path.write_text(_set_parameter(path.read_text(), "model", str(model_dir)))
    path = repo / "minisgl_b" / "config.pbtxt"
    config = path.read_text().replace('name: "minisgl"', 'name: "minisgl_b"')
    for key, value in (("model", str(other_model_dir)), ("tp_size", "2"), ("page_size", "16"),
                       ("cache", "naive"), ("kv_cache_dtype", FP8_KV),
                       ("lora_adapters", lora_adapters), ("max_lora_rank", "8")):
        config = _set_parameter(config, key, value)
    path.write_text(config)
    return repo


def private_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "minisgl-*")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path,  # noqa: ANN201
           tiny_models: dict[str, Path]):
    root = tmp_path_factory.mktemp("two-instances")
    dirs_before = private_dirs()
    # The second instance serves an FP8 checkpoint, with an FP8 KV cache.
    fp8_model = write_fp8_checkpoint(tiny_models["llama"], root / "fp8", "fp8_block",
                                     [[5, 6, 7, 8]])
    adapter = make_adapter(tiny_models["llama"], root / "adapter", 4, 8, ["q_proj", "v_proj"],
                           False, seed=0)
    lora_adapters = f"tuned={adapter}"
    repository = two_instance_repository(root, default_model, fp8_model, lora_adapters)
    server = start_server(root / "server.log", repository=repository)
    server.fp8_model = fp8_model  # type: ignore[attr-defined]
    server.lora_adapters = lora_adapters  # type: ignore[attr-defined]
    server.dirs_before = dirs_before  # type: ignore[attr-defined]
    yield server
    leftovers = server.stop()
    assert not leftovers, f"processes outlived the server: {leftovers}"


def test_two_instances_serve_side_by_side(server: TritonServer) -> None:
    inputs = ensemble_inputs(PROMPT, 12, stream=True)
    results: dict[str, object] = {}

    def ask(model: str) -> None:
        results[model] = grpc_generate(server, inputs, model=model)

    threads = [threading.Thread(target=ask, args=(model,)) for model in (*MODELS, "ensemble")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    texts = {model: results[model].text for model in results}
    print(f"\nanswers: {texts}")
    assert not any(results[m].errors for m in results), {m: results[m].errors for m in results}
    assert texts["minisgl"] == texts["ensemble"] and texts["minisgl"].strip()
    assert len(results["minisgl_b"].ids) == 12  # the other model, on two ranks
    for model in MODELS:
        counts = metrics(server, model)
        assert counts["minisgl_generated_tokens_total"] >= 12, (model, counts)
    pids = {model: set(engine_pids(server.process.pid, model)) for model in MODELS}
    print(f"engine processes: {pids}")
    assert len(pids["minisgl"]) == 1 and len(pids["minisgl_b"]) == 2
    assert not pids["minisgl"] & pids["minisgl_b"]


def test_fp8_checkpoint_and_adapter_served_as_offline(server: TritonServer) -> None:
    """The FP8 instance answers what the offline API gives for the same checkpoint and
    settings, by its base model and through a LoRA adapter (`lora_name`); an unknown adapter
    is refused by name; its metrics name the scheme."""
    result = grpc_generate(server, ensemble_inputs(PROMPT, 12, stream=True), model="minisgl_b")
    assert not result.errors, result.errors
    tuned = grpc_generate(server, ensemble_inputs(PROMPT, 12, stream=True, lora_name="tuned"),
                          model="minisgl_b")
    assert not tuned.errors, tuned.errors
    unknown = grpc_generate(server, ensemble_inputs(PROMPT, 12, lora_name="nope"),
                            model="minisgl_b")
    assert unknown.errors and "lora_name: lora: unknown adapter 'nope'" in str(unknown.errors[0])
    with LLM(server.fp8_model, device="cpu", tp_size=2, page_size=16, cache="naive",
             kv_cache_dtype=FP8_KV, lora_adapters=server.lora_adapters,
             max_lora_rank=8) as llm:
        offline, offline_tuned = llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=12),
                                              lora=[None, "tuned"])
        loaded = llm.loaded
    assert result.ids == offline.token_ids
    assert tuned.ids == offline_tuned.token_ids != offline.token_ids
    assert loaded.quantization == "fp8/fp8/block16x32" and loaded.kv_cache_dtype == FP8_KV
    counts = metrics(server, "minisgl_b")
    weights = {k: v for k, v in counts.items() if k.startswith("minisgl_model_weight_bytes")}
    assert len(weights) == 1, counts
    (labels, value), = weights.items()
    assert f'quantization="{loaded.quantization}"' in labels
    assert f'kv_cache_dtype="{FP8_KV}"' in labels
    assert value == loaded.weight_bytes
    assert counts["minisgl_kv_tokens_total"] == loaded.kv_tokens


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _listening_tcp() -> dict[str, str]:
    """inode -> local address of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[fields[9]] = fields[1]
    return found


_LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1, ::1


def test_engines_and_stubs_listen_on_loopback_only(server: TritonServer) -> None:
    listening = _listening_tcp()
    own = descendants(server.process.pid) - {server.process.pid}
    checked = {}
    for pid in own:
        cmd = " ".join(_cmdline(pid))
        if "tritonserver" in cmd and "stub" not in cmd:
            continue  # Triton's own HTTP/gRPC/metrics endpoints listen where the user asked
        for inode in _socket_inodes(pid) & listening.keys():
            checked[(pid, cmd[:60])] = listening[inode]
    print(f"\nlistening sockets of stubs and engines: {checked}")
    assert checked, "the two gloo ranks of minisgl_b should listen (on loopback)"
    for (pid, cmd), address in checked.items():
        assert address.split(":")[0] in _LOOPBACK, f"{cmd} ({pid}) listens on {address}"


def test_each_instance_has_its_own_private_directory(server: TritonServer) -> None:
    """The engines' rendezvous files live in one 0700 directory per model instance."""
    new = private_dirs() - server.dirs_before  # type: ignore[attr-defined]
    print(f"\nprivate directories: {sorted(new)}")
    assert len(new) >= len(MODELS)  # (more only if another server started meanwhile)
    for path in new:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is open to others: {oct(mode)}"


# TensorRT-LLM's LoRA module ids (LoraManager.LORA_MODULE_IDS) of a Llama's projections.
TRTLLM_MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5,
                     "down_proj": 6, "up_proj": 7}


def trtllm_lora_tensors(adapter: Path) -> tuple[np.ndarray, np.ndarray]:
    """A PEFT adapter as TensorRT-LLM's `lora_weights` / `lora_config` request tensors, as its
    `hf_lora_convert.py` lays them out: per (module, layer) one row holding A [r, in] then
    B [out, r] times alpha / r, flattened, zero-padded to the longest row; a config row
    (module id, layer, r) each."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    rank, scale = config["r"], config["lora_alpha"] / config["r"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    rows, configs = [], []
    for name in sorted(tensors):
        if ".lora_A." not in name:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        module = name.split(".lora_A.")[0].rsplit(".", 1)[1]
        a, b = tensors[name], tensors[name.replace("lora_A", "lora_B")] * scale
        rows.append(np.concatenate([a.numpy().ravel(), b.numpy().ravel()]))
        configs.append([TRTLLM_MODULE_IDS[module], layer, rank])
    width = max(len(row) for row in rows)
    weights = np.stack([np.pad(row, (0, width - len(row))) for row in rows]).astype(np.float16)
    return weights[None], np.asarray(configs, dtype=np.int32)[None]


def test_tensorrt_llm_lora_task_equals_the_adapter_by_name(server: TritonServer) -> None:
    """The first request of a task brings the adapter in TensorRT-LLM's layout, later ones
    its id alone: both answer as the same adapter by name; an unknown task without weights
    and weights that do not fit are refused by name; the model keeps serving."""
    adapter = Path(server.lora_adapters.split("=", 1)[1])
    weights, config = trtllm_lora_tensors(adapter)
    by_name = grpc_generate(server, ensemble_inputs(PROMPT, 12, lora_name="tuned"),
                            model="minisgl_b")
    task = [tensor("lora_task_id", 7, "UINT64")]
    first = grpc_generate(server, ensemble_inputs(
        PROMPT, 12, lora_weights=tensor("lora_weights", weights, "FP16"),
        lora_config=tensor("lora_config", config, "INT32"), lora_task_id=task[0]),
        model="minisgl_b")
    later = grpc_generate(server, ensemble_inputs(PROMPT, 12, lora_task_id=task[0]),
                          model="minisgl_b")
    assert not by_name.errors and not first.errors and not later.errors
    assert first.ids == later.ids == by_name.ids
    unknown = grpc_generate(server, ensemble_inputs(
        PROMPT, 4, lora_task_id=tensor("lora_task_id", 8, "UINT64")), model="minisgl_b")
    assert unknown.errors and "lora_task_id: unknown task 8" in str(unknown.errors[0])
    bad_config = config.copy()
    bad_config[0, 0, 0] = 0  # attn_qkv: a fused module the engine does not take
    bad = grpc_generate(server, ensemble_inputs(
        PROMPT, 4, lora_weights=tensor("lora_weights", weights, "FP16"),
        lora_config=tensor("lora_config", bad_config, "INT32"),
        lora_task_id=tensor("lora_task_id", 9, "UINT64")), model="minisgl_b")
    assert bad.errors and "lora_config: module id 0" in str(bad.errors[0])
    again = grpc_generate(server, ensemble_inputs(PROMPT, 12), model="minisgl_b")
    assert not again.errors and len(again.ids) == 12


def test_lora_metrics_follow_the_requests(server: TritonServer) -> None:
    """While a request runs under an adapter its running gauge is 1 and vLLM's
    lora_requests_info (Triton's metric API takes the name) names it; afterwards 0, the adapter
    still resident."""
    import urllib.request

    def scrape() -> str:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
            return resp.read().decode()

    running = 'minisgl_lora_requests_running{adapter="tuned",model="minisgl_b"}'
    done = threading.Event()
    worker = threading.Thread(target=lambda: (grpc_generate(server, ensemble_inputs(
        PROMPT, 300, lora_name="tuned", ignore_eos=True), model="minisgl_b"), done.set()))
    worker.start()

    def current_info(text: str) -> str:
        """vLLM's info sample with the newest time (earlier label sets stay, as in vLLM)."""
        lines = [line for line in text.splitlines()
                 if line.startswith("vllm:lora_requests_info")]
        return max(lines, key=lambda line: float(line.rsplit(" ", 1)[1])) if lines else ""

    seen = ""
    while not done.is_set() and not (f"{running} 1" in seen and 'running_lora_adapters="tuned"'
                                     in current_info(seen)):
        seen = scrape()
    worker.join(timeout=300)
    assert f"{running} 1" in seen, seen[-3000:]
    assert 'running_lora_adapters="tuned"' in current_info(seen)
    deadline = time.monotonic() + 5  # the gauges follow the scheduler's snapshots
    while f"{running} 0" not in (after := scrape()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"{running} 0" in after
    resident = re.search(r'minisgl_lora_adapters_resident\{model="minisgl_b"\} (\S+)', after)
    assert resident and float(resident.group(1)) >= 1  # tuned (and any task adapter)
