"""Third-party clients, run for real against the real tritonserver (tests/triton_fixtures.py).

Each pip-installed client lives in its own virtual environment under `.client-venvs/` (made by
scripts/client_venv.py on first use, pinned, reused after) and runs in a subprocess of that
venv's python: a helper script under tests/clients/ prints what the client returned, and what
it sent (tensors or JSON bodies, recorded inside the client's process), as JSON. The only skip
is pip failing to reach the package index.

- LlamaIndex `NvidiaTriton` (gRPC streaming), compared with a direct request of its tensors;
- LiteLLM's `triton/` provider (HTTP generate / generate_stream), and the LiteLLM proxy in front
  of tritonserver driven by the `openai` client;
- Triton's OpenAI-compatible frontend (NVIDIA's containers only): the exact tensors it sends;
- genai-perf through scripts/genai_perf.sh.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from minisgl_backend.benchmark.tritonserver import free_ports
from minisgl_backend.tokenizer import encode_prompt
from tests.triton_fixtures import (  # noqa: F401 - triton_server is a fixture
    REPO_ROOT,
    StreamResult,
    TritonServer,
    ensemble_inputs,
    grpc_generate,
    http_generate,
    tensor,
    triton_server,
)

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from client_venv import NoNetwork, ensure_client_venv  # noqa: E402

CLIENTS_DIR = REPO_ROOT / "tests" / "clients"
PROMPT = "The capital of France is"  # continued without a chat template: " Paris..."
MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CLIENT_TIMEOUT_S = 240
PROXY_READY_TIMEOUT_S = 120


# ----- client venvs and subprocesses -----------------------------------------------------------


def client_python(name: str) -> Path:
    """The python of client `name`'s venv (installed on first use)."""
    try:
        venv = ensure_client_venv(name)
    except NoNetwork as exc:
        pytest.skip(f"pip could not reach the package index (no network?):\n{exc}")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.fail(f"could not make the {name} client venv: {exc}", pytrace=False)
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def llamaindex_python() -> Path:
    return client_python("llamaindex")


@pytest.fixture(scope="session")
def litellm_python() -> Path:
    """litellm[proxy] and openai share one venv."""
    return client_python("litellm")


def client_env(**extra: str) -> dict[str, str]:
    """The environment of a client process: none of the project venv's settings, nothing fetched
    from the Hugging Face Hub or LiteLLM's cost-map URL."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False", **extra)
    return env


def run_client(python: Path, script: str, args: dict[str, Any],
               timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """Run tests/clients/`script` with `args` (JSON) in a client venv; its JSON output."""
    command = [str(python), str(CLIENTS_DIR / script), json.dumps(args)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO_ROOT, env=client_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (
            exc.stderr or "")
        pytest.fail(f"{script} did not finish within {timeout:.0f} s\nstderr tail:\n"
                    f"{stderr[-4000:]}", pytrace=False)
    if proc.returncode != 0:
        hint = ""
        if "object has no attribute 'decode'" in proc.stderr:
            hint = ("\n(the client decodes each element of text_output as bytes: it expects the "
                    "1-D shape [1] that TensorRT-LLM's postprocessing returns, not [1, 1])")
        pytest.fail(f"{script} exited with {proc.returncode}{hint}\nstderr tail:\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replay(inputs: list[dict[str, Any]]) -> list:
    """The recorded tensors of a client's request as tritonclient inputs."""
    return [tensor(i["name"], np.array(i["values"]).reshape(i["shape"]), i["datatype"])
            for i in inputs]


@pytest.fixture(scope="module")
def server(triton_server: TritonServer, default_model: Path) -> TritonServer:  # noqa: F811
    return triton_server


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(default_model))


def generate_url(server: TritonServer) -> str:
    return f"http://localhost:{server.http_port}/v2/models/ensemble/generate"


# ----- 1. LlamaIndex NvidiaTriton ----------------------------------------------------------------


LLAMAINDEX_INPUTS = {  # name: (datatype, value), each [1, 1]; its defaults give greedy decoding
    "text_input": ("BYTES", PROMPT), "max_tokens": ("INT32", MAX_TOKENS), "top_k": ("INT32", 1),
    "top_p": ("FP32", 0.0), "temperature": ("FP32", 1.0), "length_penalty": ("FP32", 1.0),
    "repetition_penalty": ("FP32", 1.0), "random_seed": ("UINT64", 0),
    "beam_width": ("INT32", 1), "stream": ("BOOL", True),
}


def test_llamaindex_nvidia_triton(server: TritonServer, llamaindex_python: Path) -> None:
    out = run_client(llamaindex_python, "llamaindex_client.py",
                     {"server_url": server.grpc_url, "prompt": PROMPT, "tokens": MAX_TOKENS})
    # .complete() and .stream_complete() both stream (stream=True) to `ensemble`; after each, a
    # "stop signal" request (input_ids, input_lengths, request_output_len, stop) that a
    # TensorRT-LLM ensemble refuses as well: its error lands in a queue nobody reads.
    requests = [c for c in out["sent"] if any(i["name"] == "text_input" for i in c["inputs"])]
    assert len(requests) == 2, out["sent"]
    for request in requests:
        assert request["model"] == "ensemble"
        sent = {i["name"]: (i["datatype"], i["shape"], i["values"]) for i in request["inputs"]}
        assert sent == {name: (dtype, [1, 1], [value])
                        for name, (dtype, value) in LLAMAINDEX_INPUTS.items()}, sent
    stop_signals = [c for c in out["sent"] if c not in requests]
    assert all({i["name"] for i in c["inputs"]} == {"input_ids", "input_lengths",
                                                    "request_output_len", "stop"}
               for c in stop_signals), stop_signals
    assert all("unexpected inference input" in e for e in out["stream_errors"]), out

    text = out["complete"]
    assert text.strip(), out
    assert not text.startswith(PROMPT) and PROMPT not in text, text
    assert "".join(out["stream_deltas"]) == text  # the same greedy answer, streamed

    # The server answers the client's exact tensors as it answers them sent directly ...
    direct = grpc_generate(server, replay(requests[0]["inputs"]))
    assert not direct.errors, direct.errors
    assert direct.text.strip() and not direct.text.startswith(PROMPT)
    for received in out["received"]:
        assert "".join(received) == direct.text, (received, direct.text)
        # ... and the client keeps the first `tokens - 1` responses: its generator stops when
        # its counter reaches tokens - 1 (llama_index/llms/nvidia_triton/utils.py, __next__).
        assert text == "".join(received[:MAX_TOKENS - 1])


# ----- 2. LiteLLM's triton/ provider ----------------------------------------------------------


LITELLM_MESSAGES = [{"role": "user", "content": PROMPT}]


def litellm_bodies(sent: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    """The requests to tritonserver; the only others are LiteLLM's Hugging Face Hub look-ups of
    a chat template for the model name ("ensemble"), which the recorder refuses (as offline)."""
    others = [s for s in sent if not s["url"].startswith(url)]
    assert all(s.get("blocked") and s["url"].startswith("https://huggingface.co/")
               for s in others), others
    return [s for s in sent if s["url"].startswith(url)]


def expected_litellm_bodies(url: str) -> list[dict[str, Any]]:
    # No chat template (the Hub look-up fails, so it joins the messages' contents), max_tokens
    # inside "parameters", "stream" top-level; streaming goes to generate_stream.
    return [
        {"method": "POST", "url": url,
         "body": {"text_input": PROMPT, "parameters": {"max_tokens": MAX_TOKENS},
                  "stream": False}},
        {"method": "POST", "url": url + "_stream",
         "body": {"text_input": PROMPT, "parameters": {"max_tokens": MAX_TOKENS},
                  "stream": True}},
    ]


@pytest.fixture(scope="module")
def litellm_reference(server: TritonServer) -> str:
    """What tritonserver answers to LiteLLM's (non-streaming) body."""
    result = http_generate(server, expected_litellm_bodies("")[0]["body"])
    assert result.status == 200, result.body
    return result.text


def test_litellm_provider(server: TritonServer, litellm_python: Path,
                          litellm_reference: str) -> None:
    url = generate_url(server)
    out = run_client(litellm_python, "litellm_client.py",
                     {"api_base": url, "messages": LITELLM_MESSAGES, "max_tokens": MAX_TOKENS})
    assert litellm_bodies(out["sent"], url) == expected_litellm_bodies(url)

    # LiteLLM takes text_output as the whole answer: no prompt in front of it (the model's
    # exclude_input_in_output default), the same text streamed and not.
    text = out["text"]
    assert text.strip(), out
    assert not text.startswith(PROMPT) and PROMPT not in text, text
    assert text == litellm_reference
    assert "".join(out["stream_deltas"]) == text

    # LiteLLM reads no token counts from Triton: non-streaming usage is all zeros, streaming
    # usage is its own count (tiktoken) of the prompt and the streamed text.
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 0
    assert out["stream_usage"]["completion_tokens"] > 0, out["stream_usage"]


# ----- 3. the LiteLLM proxy + the openai client -----------------------------------------------


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def litellm_proxy(server: TritonServer, litellm_python: Path,
                  tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """`litellm --model triton/ensemble --api_base .../generate --port P` (through
    tests/clients/litellm_proxy.py, which records what it sends); yields (base URL, key, record)."""
    work = tmp_path_factory.mktemp("litellm-proxy")
    record, log_path = work / "sent.jsonl", work / "proxy.log"
    (port,) = free_ports(1)
    key = "sk-" + secrets.token_hex(32)  # the proxy refuses to start without a master key
    command = [str(litellm_python), str(CLIENTS_DIR / "litellm_proxy.py"),
               "--model", "triton/ensemble", "--api_base", generate_url(server),
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=client_env(LITELLM_MASTER_KEY=key, CLIENT_RECORD=str(record)))
    try:
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while not _http_ok(f"http://127.0.0.1:{port}/health/liveliness"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the LiteLLM proxy did not start (exit {proc.poll()}); log tail:\n"
                            f"{log_path.read_text(errors='replace')[-4000:]}", pytrace=False)
            time.sleep(0.5)
        yield f"http://localhost:{port}/v1", key, record
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_litellm_proxy_with_openai_client(server: TritonServer, litellm_python: Path,
                                          litellm_proxy, litellm_reference: str) -> None:
    base_url, key, record = litellm_proxy
    out = run_client(litellm_python, "openai_client.py",
                     {"base_url": base_url, "api_key": key, "model": "triton/ensemble",
                      "messages": LITELLM_MESSAGES, "prompt": PROMPT, "max_tokens": MAX_TOKENS})
    url = generate_url(server)
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    # chat.completions, then completions (LiteLLM turns the prompt into one user message): the
    # same two bodies as the provider's each time
    assert litellm_bodies(sent, url) == expected_litellm_bodies(url) * 2

    for kind in ("chat", "completion"):
        result = out[kind]
        assert result["text"] == litellm_reference, (kind, result)
        assert not result["text"].startswith(PROMPT), (kind, result)
        assert "".join(result["stream_deltas"]) == result["text"], (kind, result)
        # Usage is LiteLLM's, not the server's (see test_litellm_provider): zeros without
        # streaming, its own tiktoken count of the streamed text with include_usage.
        assert result["usage"]["completion_tokens"] == 0, (kind, result["usage"])
        assert result["stream_usage"]["completion_tokens"] > 0, (kind, result)
    assert (out["chat"]["stream_usage"]["completion_tokens"]
            == out["completion"]["stream_usage"]["completion_tokens"])


# ----- 4. Triton's OpenAI-compatible frontend: the tensors it sends ---------------------------


def frontend_inputs(prompt: str, stream: bool, echo: bool | None = None,
                    max_tokens: int = MAX_TOKENS) -> list:
    """What python/openai's _create_trtllm_generate_request sends (no sampling options set):
    text_input, stream, max_tokens, return_num_input_tokens / return_num_output_tokens true,
    and exclude_input_in_output = not echo only when the request has `echo` (chat never)."""
    inputs = ensemble_inputs(prompt, max_tokens, stream=stream, return_num_input_tokens=True,
                             return_num_output_tokens=True)
    if echo is not None:
        inputs.append(tensor("exclude_input_in_output", not echo))
    return inputs


def assert_frontend_usage(full: StreamResult, streamed: StreamResult, prompt_tokens: int) -> None:
    """The frontend's checks: non-streaming is one or two responses, the last final; usage is
    num_input_tokens and num_output_tokens (streaming: their sum over the responses)."""
    for result in (full, streamed):
        assert not result.errors, result.errors
        assert result.finals == 1 and result.last.final
    assert 1 <= len(full.responses) <= 2, len(full.responses)
    counted = [r for r in full.responses if "num_output_tokens" in r.outputs]
    assert [r.outputs["num_input_tokens"] for r in counted] == [prompt_tokens] * len(counted)
    completion_tokens = sum(r.outputs["num_output_tokens"] for r in counted)
    assert completion_tokens == len(full.ids) > 0
    streamed_tokens = sum(r.outputs.get("num_output_tokens", 0) for r in streamed.responses)
    assert streamed_tokens == completion_tokens, [r.outputs for r in streamed.responses]
    assert all(r.outputs["num_input_tokens"] == prompt_tokens
               for r in streamed.responses if "num_input_tokens" in r.outputs)
    assert streamed.ids == full.ids


def test_openai_frontend_chat_tensors(server: TritonServer, tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    full = grpc_generate(server, frontend_inputs(prompt, stream=False))
    streamed = grpc_generate(server, frontend_inputs(prompt, stream=True))
    assert_frontend_usage(full, streamed, len(encode_prompt(tokenizer, prompt)))

    content = full.text
    assert content.strip(), full.responses
    # no prompt: neither the question nor the template's system message, in any form
    assert CHAT[0]["content"] not in content, content
    assert "You are a helpful AI assistant" not in content, content
    assert not content.lstrip().startswith(("system", "<|im_start|>")), content
    assert "Paris" in content, content
    assert streamed.text == content
    assert len(streamed.responses) > 1, "streaming sent everything at once"


def test_openai_frontend_completion_tensors(server: TritonServer, tokenizer: Any) -> None:
    prompt_tokens = len(encode_prompt(tokenizer, PROMPT))
    default = grpc_generate(server, frontend_inputs(PROMPT, stream=False))  # `echo` unset
    no_echo = grpc_generate(server, frontend_inputs(PROMPT, stream=False, echo=False))
    echo = grpc_generate(server, frontend_inputs(PROMPT, stream=False, echo=True))
    streamed = grpc_generate(server, frontend_inputs(PROMPT, stream=True))
    for full in (default, no_echo, echo):
        assert_frontend_usage(full, streamed, prompt_tokens)

    assert default.text.strip() and not default.text.startswith(PROMPT), default.text
    assert no_echo.text == default.text
    prompt_text = tokenizer.decode(encode_prompt(tokenizer, PROMPT), skip_special_tokens=True)
    assert echo.text == prompt_text + default.text  # echo: the prompt, then the same answer
    assert streamed.text == default.text


# ----- 6. genai-perf through scripts/genai_perf.sh --------------------------------------------


def test_genai_perf_script(server: TritonServer) -> None:
    env = dict(os.environ, GRPC_URL=server.grpc_url, CONCURRENCY="1", REQUESTS="4",
               INPUT_TOKENS="16", OUTPUT_TOKENS="8", WARMUP="0")
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "genai_perf.sh")], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=540,
                          stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    if proc.returncode == 3:  # scripts/client_venv.py: pip could not reach the index
        pytest.skip(f"pip could not reach the package index:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert "LLM Metrics" in output, output[-6000:]
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) >= 2:
            rows[cells[0]] = cells[1:]
    throughput = rows.get("Output Token Throughput (tokens/sec)")
    assert throughput, output[-6000:]
    assert float(throughput[0].replace(",", "")) > 0, throughput
    assert float(rows["Request Count (count)"][0]) == 4, rows
    # genai-perf counts output tokens by re-tokenizing the text: about OUTPUT_TOKENS (min_length)
    assert 4 <= float(rows["Output Sequence Length (tokens)"][0]) <= 12, rows
