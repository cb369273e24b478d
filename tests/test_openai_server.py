"""The OpenAI-compatible front door, for real: `scripts/serve.sh` (the README's command) starts
tritonserver and the front door on free ports, with an API key; the `openai` SDK, raw HTTP,
LiteLLM's `openai/` provider and AIPerf (their own venvs, tests/test_clients.py's helpers) talk
to it. Teardown stops serve.sh and checks that neither server outlived it."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from minisgl_backend.benchmark.tritonserver import free_ports, http_status
from tests.test_clients import client_env, client_python, run_client
from tests.triton_fixtures import REPO_ROOT, TritonServer, wait_engine_idle

READY_TIMEOUT_S = 300.0
NAME = "smol"  # SERVED_MODEL_NAME
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@dataclass
class FrontDoor:
    triton: TritonServer  # its process is serve.sh's
    port: int
    key: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0,
                             timeout=300)

    def post(self, path: str, body: Any, key: str | None = None) -> tuple[int, dict[str, Any]]:
        """POST JSON (`body` as given when it is bytes); (status, decoded body)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method="POST",
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {self.key if key is None else key}"})
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[FrontDoor]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    key = "sk-" + secrets.token_hex(16)
    env = {**os.environ, "HTTP_PORT": str(http_port), "GRPC_PORT": str(grpc_port),
           "METRICS_PORT": str(metrics_port), "OPENAI_PORT": str(openai_port),
           "OPENAI_API_KEY": key, "SERVED_MODEL_NAME": NAME}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["./scripts/serve.sh"], cwd=REPO_ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    server = TritonServer(process, http_port, grpc_port, metrics_port, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while http_status(f"http://127.0.0.1:{openai_port}/health") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            leftovers = server.stop()
            pytest.fail(f"serve.sh's OpenAI API was not ready (exit {process.poll()}, left "
                        f"behind {leftovers}); log tail:\n{server.log_tail()}", pytrace=False)
        time.sleep(0.5)
    yield FrontDoor(server, openai_port, key)
    leftovers = server.stop()  # SIGTERM to serve.sh: tritonserver, then the front door, stop
    assert not leftovers, f"outlived serve.sh (killed now): {leftovers}\n{server.log_tail()}"
    assert process.returncode == 0, server.log_tail()


def test_serve_prints_the_url_and_lists_the_model(door: FrontDoor) -> None:
    assert f"http://localhost:{door.port}/v1" in door.triton.log_tail(100_000)
    assert [m.id for m in door.client().models.list().data] == [NAME]


def test_chat_answers_paris(door: FrontDoor) -> None:
    chat = door.client().chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=32,
                                                 temperature=0)
    assert "Paris" in chat.choices[0].message.content, chat
    assert chat.choices[0].finish_reason == "stop"
    prompt = chat.usage.prompt_tokens
    assert prompt > len(CAPITAL[0]["content"].split())  # the chat template's tokens counted


def streamed(stream: Any, chat: bool) -> tuple[dict[int, str], Any, list[str | None]]:
    """Text per choice, the usage chunk's usage, and the finish reasons seen."""
    texts: dict[int, str] = {}
    usage, reasons = None, []
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            reasons.append(choice.finish_reason)
    return texts, usage, reasons


def test_streamed_and_whole_answers_agree(door: FrontDoor) -> None:
    client = door.client()
    common = dict(model=NAME, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(messages=CAPITAL, **common)
    texts, usage, reasons = streamed(client.chat.completions.create(
        messages=CAPITAL, stream=True, stream_options={"include_usage": True}, **common), True)
    assert texts == {0: whole.choices[0].message.content}
    assert reasons.count("stop") == 1 and reasons[-1] == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # The repeated prompt came from the prefix cache; the engine says how much.
    assert usage.prompt_tokens_details.cached_tokens > 0

    prompt = "The capital of France is"
    whole = client.completions.create(prompt=prompt, **common)
    texts, usage, _ = streamed(client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **common), False)
    assert texts == {0: whole.choices[0].text} and "Paris" in whole.choices[0].text
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens == 5
    echoed = client.completions.create(prompt=prompt, echo=True, **common)
    assert echoed.choices[0].text == prompt + whole.choices[0].text


def test_n_samples_and_logprobs(door: FrontDoor) -> None:
    client = door.client()
    chat = client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=8, n=2,
                                          temperature=1.0, seed=7, logprobs=True,
                                          top_logprobs=3)
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        for token in content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 3
            best = [t.logprob for t in token.top_logprobs]
            assert best == sorted(best, reverse=True) and token.logprob <= best[0] + 1e-5
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)

    texts, usage, reasons = streamed(client.chat.completions.create(
        model=NAME, messages=CAPITAL, max_tokens=8, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True}), True)
    assert sorted(texts) == [0, 1] and texts[0] == texts[1]
    assert sum(r is not None for r in reasons) == 2

    completion = client.completions.create(model=NAME, prompt="The capital of France is",
                                           max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_json_schema_response_format_gives_valid_json(door: FrontDoor) -> None:
    text = {"type": "string", "maxLength": 24}  # bounded: a tiny model may ramble in one
    schema = {"type": "object", "properties": {"city": text, "country": text},
              "required": ["city", "country"], "additionalProperties": False}
    chat = door.client().chat.completions.create(
        model=NAME, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)


def test_a_named_tool_choice_gives_a_parseable_call(door: FrontDoor) -> None:
    client = door.client()
    request = dict(model=NAME, max_tokens=48, temperature=0, tools=[WEATHER],
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chat = client.chat.completions.create(**request)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    calls, reasons = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert [c.function.arguments for c in calls] == [call.function.arguments]
    assert reasons[-1] == "tool_calls"


BAD_REQUESTS = [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": [1]}, "temperature"),
    ({"model": "gpt-4o"}, "model"),
    ({"n": 1000}, "n"),
    ({"frobnicate": True}, "frobnicate"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": "hello"}, "messages"),
    ({"max_tokens": 100_000}, "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_400s_naming_the_field(door: FrontDoor, stream: bool) -> None:
    for change, param in BAD_REQUESTS:
        body = {"model": NAME, "messages": CAPITAL, "max_tokens": 4, "stream": stream, **change}
        status, answer = door.post("/chat/completions", body)
        assert status == 400, (change, answer)
        assert answer["error"]["param"] == param, (change, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    assert door.post("/chat/completions", b"{not json")[0] == 400
    status, answer = door.post("/chat/completions", {"model": NAME, "messages": CAPITAL,
                                                     "max_tokens": 4})
    assert status == 200 and answer["choices"][0]["message"]["content"]  # still serving


def test_the_api_key_is_required(door: FrontDoor) -> None:
    body = {"model": NAME, "messages": CAPITAL, "max_tokens": 4}
    for key in ("", "sk-wrong"):
        status, answer = door.post("/chat/completions", body, key=key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=door.base_url, api_key="sk-wrong").models.list()
    assert http_status(f"http://127.0.0.1:{door.port}/health") == 200  # no key needed


def test_a_client_that_leaves_mid_stream_frees_its_request(door: FrontDoor) -> None:
    server = door.triton
    assert wait_engine_idle(server) == {"minisgl_kv_pages_in_use": 0,
                                        "minisgl_requests_running": 0,
                                        "minisgl_requests_waiting": 0}
    conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": NAME, "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 4000, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {door.key}"})
    response = conn.getresponse()
    events = 0
    while events < 4:  # the role, then three tokens
        events += response.fp.readline().startswith(b"data: ")
    running = server.model_metrics()
    assert running["minisgl_requests_running"] == 1 and running["minisgl_kv_pages_in_use"] > 0
    conn.sock.shutdown(2)
    conn.close()
    closed = time.monotonic()
    idle = wait_engine_idle(server, timeout=1.0)
    assert idle["minisgl_requests_running"] == 0 and idle["minisgl_kv_pages_in_use"] == 0, (
        f"{time.monotonic() - closed:.2f} s after the client left: {idle}")
    assert 'outcome="cancelled"' in front_door_metrics(door)


def front_door_metrics(door: FrontDoor) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{door.port}/metrics", timeout=10) as resp:
        return resp.read().decode()


async def sse_stream(port: int, key: str, i: int) -> tuple[int, list[str]]:
    """One raw streamed chat request; (HTTP status, its `data:` payloads)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": NAME, "max_tokens": 4, "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Count to {i}."}]}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " + key.encode() +
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    raw = await reader.read()  # until the server closes: the whole chunked response
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), [line[6:] for line in rest.decode().splitlines()
                                  if line.startswith("data: ")]


def test_100_concurrent_streams_each_end_with_one_done(door: FrontDoor) -> None:
    async def all_streams() -> list[tuple[int, list[str]]]:
        return await asyncio.wait_for(asyncio.gather(
            *(sse_stream(door.port, door.key, i) for i in range(100))), timeout=600)

    results = asyncio.run(all_streams())
    for status, events in results:
        assert status == 200 and events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("stop", "length")
        assert all("error" not in c for c in chunks)
    assert wait_engine_idle(door.triton)["minisgl_requests_running"] == 0


def test_front_door_metrics_and_request_ids(door: FrontDoor) -> None:
    status, answer = door.post("/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2})
    assert status == 200
    text = front_door_metrics(door)
    assert 'minisgl_openai_requests_total{endpoint="completions",outcome="ok"}' in text
    assert "minisgl_openai_completion_tokens_total" in text
    assert "minisgl_requests_running" in text  # the engine's, next to the front door's
    deadline = time.monotonic() + 5
    while answer["id"] not in door.triton.log_tail(1_000_000) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"{answer['id']} completions: ok" in door.triton.log_tail(1_000_000)


def test_litellm_openai_provider(door: FrontDoor) -> None:
    out = run_client(client_python("litellm"), "litellm_client.py",
                     {"api_base": door.base_url, "api_key": door.key, "model": f"openai/{NAME}",
                      "messages": CAPITAL, "max_tokens": 32, "temperature": 0})
    assert "Paris" in out["text"], out
    assert "".join(out["stream_deltas"]) == out["text"]
    whole = door.client().chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=32,
                                                  temperature=0)
    assert out["usage"]["completion_tokens"] == whole.usage.completion_tokens  # the server's
    assert out["stream_usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_aiperf_profile_chat_streaming(door: FrontDoor, tmp_path: Path,
                                       default_model: Path) -> None:
    python = client_python("aiperf")
    requests = 8
    command = [str(python.parent / "aiperf"), "profile", "--model", NAME, "--url",
               f"http://127.0.0.1:{door.port}", "--api-key", door.key,
               "--endpoint-type", "chat", "--streaming", "--tokenizer", str(default_model),
               "--apply-chat-template", "--isl", "48", "--isl-stddev", "0", "--osl", "12",
               "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true", "--concurrency", "2",
               "--request-count", str(requests), "--random-seed", "1", "--ui-type", "none",
               "--artifact-dir", str(tmp_path)]
    env = {k: v for k, v in client_env().items()  # a local tokenizer folder is read offline
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == requests and not result.get("error_summary")
    # AIPerf's own check: server and client token counts within 10% on every request.
    assert result["usage_discrepancy_count"]["avg"] == 0, {
        k: result.get(k) for k in ("usage_prompt_tokens_diff_pct",
                                   "usage_completion_tokens_diff_pct")}
    assert result["usage_completion_tokens"]["avg"] == 12
