"""Seeded fuzz of hostile requests against the running server (tests/triton_fixtures.py).

More than 300 malformed or extreme requests, over gRPC streams (streaming and not), gRPC
ModelInfer, HTTP `generate` and `generate_stream`, on both `ensemble` and `minisgl`: wrong dtypes
and shapes, missing and extra inputs, out-of-range and non-finite numbers, empty, enormous and
invalid-UTF-8 prompts, stop words that always / never match, chat JSON that is not a list of
messages, token ids outside the vocabulary, batch dimensions > 1. Every request must end with an
error (naming the field where the field is known) or a correct answer (max_tokens respected,
one final response, the greedy text where it must equal the baseline); none may be lost, the
server stays ready throughout, the KV pages come back and a good request afterwards gives the
same text as before. Valid requests generate at most 4 tokens, so the file runs in a few minutes
on a 2-core CPU machine.
"""

from __future__ import annotations

import json
import math
import queue
import random
import string
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from minisgl_backend.serving.interface import INPUTS
from minisgl_backend.tokenizer import encode_prompt
from tests.triton_fixtures import (  # noqa: F401 - triton_server is a fixture
    GrpcStream,
    TritonServer,
    http_status,
    metrics,
    triton_server,
    wait_engine_idle,
)

SEED = 20261129
NUM_CASES = 330
WORKERS = 6
REQUEST_TIMEOUT_S = 90.0
IDLE_TIMEOUT_S = 30.0
PROMPT = "The capital of France is"
MAX = 4  # tokens of every valid request (at most)
VOCAB = 49152  # the default model's vocabulary (SmolLM2-135M)
MODELS = ("ensemble", "minisgl")

# input name -> Triton datatype (as config.pbtxt declares it); list-valued inputs have shape [1, n]
SCHEMA = {i.name: i.data_type.removeprefix("TYPE_").replace("STRING", "BYTES") for i in INPUTS}
LIST_INPUTS = {"stop_words", "input_ids"}
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "FP32": np.float32, "FP64": np.float64,
         "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "UINT8": np.uint8,
         "FP16": np.float16, "INT8": np.int8}


# ----- cases ----------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    transport: str  # "grpc" (one request on its own stream), "infer" (ModelInfer), "http",
    #                 "http_stream" (generate_stream), "http_raw" (generate with a raw body)
    model: str
    fields: dict[str, Any] = field(default_factory=dict)  # value, or a ready InferInput
    raw_body: bytes = b""
    expect: str = "ok"  # "ok", "error" or "either"
    names: tuple[str, ...] = ()  # an error must name one of these (empty: any message)
    exact_len: bool = False  # an answer has exactly max_tokens tokens
    baseline: bool = False  # an answer equals the greedy baseline (PROMPT, MAX tokens)
    forbid: str = ""  # an answer's text must not contain it (a stop string)
    generate_stream_error_ok: bool = False  # HTTP generate of a stream: 200 with an error body

    @property
    def max_tokens(self) -> int:
        value = self.fields.get("max_tokens", MAX)
        return value if isinstance(value, int) else MAX


def _raw_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def _grpc_input(name: str, value: Any) -> grpcclient.InferInput:
    if isinstance(value, grpcclient.InferInput):
        return value
    datatype = SCHEMA.get(name, "INT32")
    values = list(value) if name in LIST_INPUTS else [value]
    if datatype == "BYTES":
        values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array([values], dtype=np.object_).reshape(1, len(values))
    else:
        array = np.array([values], dtype=NUMPY[datatype]).reshape(1, len(values))
    return _raw_input(name, array, datatype)


def _dtype_value(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([[b"7"]], dtype=np.object_)
    return np.array([[1]], dtype=NUMPY[datatype])


def _rand_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


def _valid(**fields: Any) -> dict[str, Any]:
    """Fields of a valid request (PROMPT, MAX greedy tokens, prompt left out), then `fields`."""
    base: dict[str, Any] = {"text_input": PROMPT, "max_tokens": MAX,
                            "exclude_input_in_output": True}
    base.update(fields)
    return base


def _transport(rng: random.Random, *, grpc: bool = True, http: bool = True) -> str:
    options = (["grpc"] * 3 if grpc else []) + (["http"] * 2 if http else [])
    return rng.choice(options)


def make_case(rng: random.Random, kind: str, input_ids_of_prompt: list[int]) -> Case:
    model = rng.choice(MODELS)
    stream = rng.random() < 0.5

    def case(transport: str | None = None, **kw: Any) -> Case:
        transport = transport or _transport(rng)
        fields = kw.pop("fields")
        if transport == "http":
            fields.pop("stream", None)  # /generate takes one response: see its own kind
        elif transport == "http_stream":
            fields["stream"] = True
        elif "stream" not in fields:
            fields["stream"] = stream
        return Case(kind=kind, transport=transport, model=kw.pop("model", model), fields=fields,
                    **kw)

    if kind == "max_tokens_bad":
        value = rng.choice([0, -1, -(2**31), 8193, 10**6, 2**31 - 1, 8192])
        return case(fields=_valid(max_tokens=value), expect="error",
                    names=("max_tokens",))
    if kind == "missing":
        name = rng.choice(["max_tokens", "text_input", "max_tokens", "text_input", "both"])
        fields = _valid()
        for missing in ("max_tokens", "text_input") if name == "both" else (name,):
            del fields[missing]
        return case(fields=fields, expect="error", names=() if name == "both" else (name,))
    if kind == "wrong_dtype":
        name = rng.choice(["max_tokens", "temperature", "top_k", "top_p", "seed", "stream",
                           "text_input", "stop_words", "end_id", "min_length", "ignore_eos",
                           "apply_chat_template", "return_finish_reason"])
        datatype = rng.choice([t for t in ("BYTES", "BOOL", "FP32", "FP64", "INT32", "INT64",
                                           "UINT64", "UINT8", "FP16", "INT8")
                               if t != SCHEMA[name]])
        fields = _valid()
        fields[name] = _raw_input(name, _dtype_value(datatype), datatype)
        return case("grpc", fields=fields, expect="error", names=(name,))
    if kind == "wrong_shape":
        name = rng.choice(["max_tokens", "temperature", "text_input", "top_k", "seed",
                           "ignore_eos"])
        shape = rng.choice([(1, 2), (1,), (1, 1, 1), (1, 3)])
        datatype = SCHEMA[name]
        if datatype == "BYTES":
            array = np.full(shape, b"hello", dtype=np.object_)
        else:
            array = np.ones(shape, dtype=NUMPY[datatype])
        fields = _valid()
        fields[name] = _raw_input(name, array, datatype)
        return case("grpc", fields=fields, expect="error", names=(name,))
    if kind == "batch":  # batch dimension > 1 (every input, or one input only)
        n = rng.choice([2, 3, 8])
        every = rng.random() < 0.6
        fields = _valid(stream=stream)
        for name in list(fields) if every else ["max_tokens"]:
            datatype = SCHEMA[name]
            value = fields[name]
            if datatype == "BYTES":
                array = np.array([[value.encode()]] * n, dtype=np.object_)
            else:
                array = np.array([[value]] * n, dtype=NUMPY[datatype])
            fields[name] = _raw_input(name, array, datatype)
        if rng.random() < 0.3:
            body = json.dumps({"text_input": [PROMPT] * n, "max_tokens": [MAX] * n}).encode()
            return case("http_raw", fields={}, raw_body=body, expect="error")
        return case("grpc", fields=fields, expect="error",
                    names=("text_input",) if every else ())
    if kind == "extra_input":
        fields = _valid()
        if rng.random() < 0.5:
            # an unknown input: gRPC (Triton) rejects it; HTTP passes it on as a request
            # parameter, which the model refuses by name (never silently ignored)
            name = rng.choice(["bogus", "max_new_tokens", "prompt", "num_beams"])
            transport = _transport(rng)
            fields[name] = 1 if transport == "http" else _raw_input(
                name, np.array([[1]], dtype=np.int32), "INT32")
            return case(transport, fields=fields, expect="error", names=(name,))
        duplicate = _raw_input("max_tokens", np.array([[MAX]], dtype=np.int32), "INT32")
        inputs = [_grpc_input(k, v) for k, v in fields.items()] + [duplicate]
        return case("grpc", fields={f"#{i}": inp for i, inp in enumerate(inputs)},
                    expect="error", names=("max_tokens",))
    if kind == "nonfinite":
        name = rng.choice(["temperature", "top_p"])
        value = rng.choice([math.nan, math.inf, -math.inf])
        transport = _transport(rng)
        if transport == "http":
            literal = {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, "NaN")
            body = json.dumps(_valid(**{name: 0.5}))
            body = body.replace(f'"{name}": 0.5', f'"{name}": {literal}')
            return case("http_raw", fields={}, raw_body=body.encode(), expect="error")
        return case("grpc", fields=_valid(**{name: value}), expect="error",
                    names=(name,))
    if kind == "sampling_bad":
        name, value = rng.choice([("temperature", -0.5), ("temperature", -1e30),
                                  ("top_p", -0.1), ("top_p", 1.0001),
                                  ("top_p", 1e30), ("top_k", -1), ("top_k", -(2**31))])
        return case(fields=_valid(**{name: value}), expect="error",
                    names=(name,))
    if kind == "sampling_extreme":
        choice = rng.randrange(8)
        if choice == 0:  # greedy whatever top_k
            return case(fields=_valid(top_k=2**31 - 1), baseline=True)
        if choice == 1:  # top_p keeps only the top token: greedy
            return case(fields=_valid(temperature=1.0, top_p=1e-6,
                                      seed=rng.getrandbits(64)), baseline=True)
        if choice == 2:  # top_k 1: greedy whatever the temperature
            return case(fields=_valid(temperature=50.0, top_k=1),
                        baseline=True)
        if choice == 3:  # a tiny (normal) temperature: greedy
            return case(fields=_valid(temperature=1e-30), baseline=True)
        if choice == 4:
            return case(fields=_valid(temperature=1e30, ignore_eos=True,
                                      seed=rng.getrandbits(64)), exact_len=True)
        if choice == 5:
            seed = rng.choice([0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1])
            return case(fields=_valid(temperature=1.0, seed=seed,
                                      top_k=2**31 - 1, ignore_eos=True), exact_len=True)
        if choice == 6:  # min_length: EOS cannot end it early
            return case(fields=_valid(min_length=MAX, temperature=0.8,
                                      seed=rng.getrandbits(64)), exact_len=True)
        return case(fields=_valid(max_tokens=1, ignore_eos=True),
                    exact_len=True)
    if kind == "empty_prompt":
        text = rng.choice(["", " ", "\n\t  ", "\u3000", " " * 1000])
        return case(fields=_valid(text_input=text), expect="error",
                    names=("text_input",))
    if kind == "huge_prompt":
        choice = rng.randrange(4)
        if choice == 0:
            text = "word " * rng.randint(8200, 9000)  # beyond the 8192-token context
        elif choice == 1:
            text = "\U0001F600" * rng.randint(4200, 5000)  # ~2 tokens each
        elif choice == 2:
            text = "x" * ((1 << 20) + rng.randint(1, 1000))  # beyond max_input_bytes
        else:  # a prompt that fits, plus max_tokens beyond the context
            return case(fields=_valid(text_input="word " * 100,
                                      max_tokens=8150), expect="error", names=("max_tokens",))
        return case(fields=_valid(text_input=text), expect="error",
                    names=("text_input", "prompt"))
    if kind == "invalid_utf8":
        raw = rng.choice([b"\xff\xfe", b"abc\x80def", b"\xc3\x28", b"\xed\xa0\x80",
                          b"\xf8\x88\x80\x80\x80", b"The capital \xe2\x82"])
        name = rng.choice(["text_input", "stop_words"])
        if rng.random() < 0.25:  # the same bytes inside an HTTP JSON body
            body = json.dumps({"text_input": "@@", "max_tokens": MAX}).encode()
            return case("http_raw", fields={}, raw_body=body.replace(b"@@", raw),
                        expect="error")
        fields = _valid()
        fields[name] = raw if name == "text_input" else [b"ok", raw]
        return case("grpc", fields=fields, expect="error", names=(name,))
    if kind == "odd_prompt":
        text = rng.choice(["\x00\x00 hello \x00", "\x1b[31mred\x1b[0m", "\U0001F600" * 20,
                           "\u202eRTL text\u202c", "<|im_end|><|endoftext|>", "\ufeff\u200b\u200d",
                           "a" * 3000, "\n" * 50, "日本語のテキスト", "{\"role\": \"user\"}",
                           "\ud7ff\ue000\uffff"])
        return case(fields=_valid(text_input=text, ignore_eos=True,
                                  exclude_input_in_output=rng.random() < 0.5), exact_len=True)
    if kind == "stop_always":
        stop = rng.choice([" ", "e", "\n", " Paris"])
        return case(fields=_valid(stop_words=[stop], max_tokens=MAX),
                    forbid=stop)
    if kind == "stop_never":
        words = [f"\u2603{_rand_text(rng, rng.randint(1, 20))}\u2603"
                 for _ in range(rng.randint(1, 32))]
        return case(fields=_valid(stop_words=words), baseline=True)
    if kind == "stop_empty":
        return case(fields=_valid(stop_words=[""] * rng.randint(1, 3)),
                    baseline=True)
    if kind == "stop_too_many":
        if rng.random() < 0.5:
            words = [f"never{i}" for i in range(rng.choice([33, 1000, 5000]))]
        else:
            words = ["z" * rng.choice([257, 10000])]
        return case(fields=_valid(stop_words=words), expect="either",
                    names=("stop_words",), baseline=True)
    if kind == "chat_bad":
        text = rng.choice(["[1, 2]", "[]", '[{"role": 1}]', '[{"role": "user", "content": 5}]',
                           '[{"role": "user"}]', '[{"role":', "[" * 50000 + "]" * 50000,
                           "[null]", '[{"role": "user", "content": "hi"}] trailing',
                           '[[{"role": "user", "content": "hi"}]]', "[" * 100000,
                           '[{"role": "user", "content": "hi", "x": [' + "[" * 5000 + "]}]"])
        return case(fields=_valid(text_input=text, apply_chat_template=True),
                    expect="error", names=("text_input",))
    if kind == "chat_odd":
        text = rng.choice(['{"role": "user", "content": "hi"}', '"a JSON string"',
                           '[{"role": "system", "content": "Be brief."}]',
                           '[{"role": "robot", "content": "beep"}]',
                           '[{"role": "user", "content": ""}]'])
        return case(fields=_valid(text_input=text, apply_chat_template=True,
                                  ignore_eos=True), exact_len=True)
    if kind == "end_id":
        value = rng.choice([2**31 - 1, VOCAB, VOCAB + 1, -1, -100, 2, 0])
        if value >= VOCAB:
            return case(fields=_valid(end_id=value,
                                      min_length=rng.randint(0, MAX)),
                        expect="error", names=("end_id",))
        return case(fields=_valid(end_id=value,
                                  min_length=rng.randint(0, MAX)))
    if kind == "min_length_bad":
        value = rng.choice([MAX + 1, 2**31 - 1, -1, -(2**31)])
        return case(fields=_valid(min_length=value), expect="error",
                    names=("min_length",))
    if kind == "input_ids":
        choice = rng.randrange(6)
        fields = _valid()
        del fields["text_input"]
        if choice == 0:  # the ensemble has no such input
            fields["input_ids"] = input_ids_of_prompt
            return case("grpc", model="ensemble", fields=fields, expect="error",
                        names=("input_ids",))
        if choice == 1:  # what preprocessing sends: the baseline
            fields["input_ids"] = input_ids_of_prompt
            return case("grpc", model="minisgl", fields=fields, baseline=True)
        if choice == 2:
            fields["input_ids"] = input_ids_of_prompt
            fields["text_input"] = PROMPT
            return case("grpc", model="minisgl", fields=fields, expect="error",
                        names=("input_ids",))
        if choice == 3:
            fields["input_ids"] = _raw_input("input_ids", np.zeros((1, 0), np.int32), "INT32")
            return case("grpc", model="minisgl", fields=fields, expect="error",
                        names=("input_ids",))
        bad = rng.choice([-1, -(2**31), VOCAB, VOCAB + 7, 2**31 - 1])
        ids = list(input_ids_of_prompt)
        ids.insert(rng.randrange(len(ids) + 1), bad)
        fields["input_ids"] = ids
        return case("grpc", model="minisgl", fields=fields, expect="error",
                    names=("input_ids",))
    if kind == "return_flags":
        return case(fields=_valid(return_num_input_tokens=True,
                                  return_num_output_tokens=True, return_finish_reason=True,
                                  return_cached_tokens=True), baseline=True)
    if kind == "grpc_infer":  # ModelInfer: decoupled models refuse it
        return case("infer", fields=_valid(), expect="error")
    if kind == "http_stream_on_generate":
        fields = _valid(stream=True, max_tokens=rng.randint(2, MAX),
                        ignore_eos=True)
        return Case(kind=kind, transport="http", model=model, fields=fields, expect="error",
                    generate_stream_error_ok=True)
    if kind == "http_bad_json":
        body = rng.choice([b"{not json", b"[]", b"null", b"", b'"text"',
                           b'{"text_input": null, "max_tokens": 4}',
                           b'{"text_input": "hi", "max_tokens": "4"}',
                           b'{"text_input": "hi", "max_tokens": 1.5}',
                           b'{"text_input": "hi", "max_tokens": true}',
                           b'{"text_input": {"a": 1}, "max_tokens": 4}',
                           b'{"text_input": "hi", "max_tokens": 99999999999999999999}',
                           b'{"text_input": "hi", "max_tokens": 4, "stop_words": [1, 2]}',
                           b'{"text_input": "hi", "max_tokens": 4, "temperature": "hot"}',
                           b'{"text_input": "hi", "max_tokens": 4, "seed": -1}',
                           b'{"text_input": ["hi", ["nested"]], "max_tokens": 4}',
                           b'{"text_input": "hi", "max_tokens": 4' + b", " * 10000 + b"}"])
        return case("http_raw", fields={}, raw_body=body, expect="error")
    if kind == "sse":
        if rng.random() < 0.5:
            return case("http_stream", fields=_valid(ignore_eos=True),
                        exact_len=True)
        name, value = rng.choice([("max_tokens", 0), ("top_p", 2.0), ("text_input", ""),
                                  ("min_length", 99)])
        return case("http_stream", fields=_valid(**{name: value}),
                    expect="error", names=(name,))
    assert kind == "good", kind
    return case(fields=_valid(), baseline=True)


KINDS = {  # kind -> weight
    "max_tokens_bad": 20, "missing": 14, "wrong_dtype": 25, "wrong_shape": 15, "batch": 12,
    "extra_input": 12, "nonfinite": 15, "sampling_bad": 15, "sampling_extreme": 24,
    "empty_prompt": 8, "huge_prompt": 8, "invalid_utf8": 14, "odd_prompt": 14,
    "stop_always": 10, "stop_never": 8, "stop_empty": 5, "stop_too_many": 6, "chat_bad": 18,
    "chat_odd": 8, "end_id": 12, "min_length_bad": 8, "input_ids": 18, "return_flags": 6,
    "grpc_infer": 6, "http_stream_on_generate": 5, "http_bad_json": 16, "sse": 8, "good": 8,
}


def make_cases(seed: int, count: int, input_ids_of_prompt: list[int]) -> list[Case]:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    chosen = list(kinds) + rng.choices(kinds, weights=weights, k=count - len(kinds))
    rng.shuffle(chosen)
    return [make_case(rng, kind, input_ids_of_prompt) for kind in chosen]


# ----- sending --------------------------------------------------------------------------------


@dataclass
class Outcome:
    error: str | None = None
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    finals: int = 0
    after_final: int = 0  # responses that arrived after the final one
    outputs: dict[str, Any] = field(default_factory=dict)
    lost: bool = False
    problem: str = ""  # transport-level violation (not valid UTF-8, a 2xx error, ...)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add_outputs(self, outputs: dict[str, Any]) -> None:
        """A response's optional outputs: the latest value of each, except num_output_tokens,
        which counts the response's own tokens and so adds up over a stream."""
        counted = self.outputs.get("num_output_tokens", 0) + outputs.get("num_output_tokens", 0)
        self.outputs.update(outputs)
        if "num_output_tokens" in self.outputs:
            self.outputs["num_output_tokens"] = counted


def _grpc_inputs(case: Case) -> list[grpcclient.InferInput]:
    return [_grpc_input(name, value) for name, value in case.fields.items()]


def send_grpc(server: TritonServer, case: Case) -> Outcome:
    outcome = Outcome()
    stream = GrpcStream(server)
    ended = False
    try:
        stream.send(_grpc_inputs(case), "fuzz", model=case.model)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            try:
                _, response, error = stream.next_event(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                outcome.lost = True
                return outcome
            except UnicodeDecodeError as exc:
                outcome.problem = f"text_output is not UTF-8: {exc}"
                return outcome
            if error is not None:
                outcome.error = error.message()
                break
            outcome.texts.append(response.text)
            outcome.ids.extend(response.ids)
            outcome.add_outputs(response.outputs)
            if response.final:
                outcome.finals += 1
                break
        ended = True
        while True:  # nothing may follow the final response or the error
            try:
                stream.next_event(0.05)
                outcome.after_final += 1
            except queue.Empty:
                break
            except UnicodeDecodeError:
                outcome.after_final += 1
    finally:
        # Cancel only a request that did not end (closing would wait for it): Triton 2.51 leaks
        # the model of a request it rejected (unknown input, wrong dtype or shape) when its
        # stream is then cancelled, and cannot unload that model at exit.
        stream.close(cancel_requests=not ended)
    return outcome


def send_infer(server: TritonServer, case: Case) -> Outcome:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer(case.model, _grpc_inputs(case), client_timeout=REQUEST_TIMEOUT_S)
        return Outcome(problem="ModelInfer answered a decoupled model")
    except grpcclient.InferenceServerException as exc:
        if "Deadline" in str(exc.status()):
            return Outcome(lost=True)
        return Outcome(error=exc.message())
    finally:
        client.close()


def _http_json(case: Case) -> bytes:
    body = {}
    for name, value in case.fields.items():
        body[name] = value.decode("utf-8") if isinstance(value, bytes) else value
    return json.dumps(body).encode()


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def send_http(server: TritonServer, case: Case) -> Outcome:
    endpoint = "generate_stream" if case.transport == "http_stream" else "generate"
    url = f"{server.http_url}/v2/models/{case.model}/{endpoint}"
    data = case.raw_body if case.transport == "http_raw" else _http_json(case)
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (TimeoutError, OSError) as exc:
        if "timed out" in str(exc):
            return Outcome(lost=True)
        return Outcome(problem=f"HTTP request failed: {exc!r}")
    if endpoint == "generate_stream" and (status == 200 or raw.startswith(b"data:")):
        outcome = _sse_outcome(raw)  # an error may come as an event, with status 200 or 4xx
        if status != 200 and outcome.error is None:
            outcome.problem = f"HTTP {status} without an error event: {raw[:200]!r}"
        return outcome
    try:
        body = json.loads(raw)
    except ValueError:
        return Outcome(problem=f"HTTP {status}: not JSON: {raw[:200]!r}")
    if status >= 400:
        if not isinstance(body, dict) or not isinstance(body.get("error"), str):
            return Outcome(problem=f"HTTP {status} without a JSON error: {body}")
        return Outcome(error=body["error"])
    if "error" in body:
        problem = "" if case.generate_stream_error_ok else f"HTTP {status} with an error body"
        return Outcome(error=body["error"], problem=problem)
    outputs = {k: body[k] for k in ("num_input_tokens", "num_output_tokens", "cached_tokens",
                                    "finish_reason") if k in body}
    return Outcome(texts=[body.get("text_output")], ids=_as_ids(body.get("output_ids")),
                   finals=1, outputs=outputs)


def _sse_outcome(raw: bytes) -> Outcome:
    outcome = Outcome()
    for line in raw.decode("utf-8").splitlines():
        if not line.startswith("data:"):
            continue
        event = json.loads(line[len("data:"):])
        if outcome.error is not None or outcome.finals:
            outcome.after_final += 1
        if "error" in event:
            outcome.error = event["error"]
            continue
        outcome.texts.append(event["text_output"])
        outcome.ids.extend(_as_ids(event.get("output_ids")))
        outcome.add_outputs({k: event[k] for k in ("finish_reason", "num_output_tokens")
                             if k in event})
    if outcome.error is None:
        outcome.finals = 1  # SSE has no final flag: the stream ended
        outcome.after_final = 0
    return outcome


def send(server: TritonServer, case: Case) -> Outcome:
    if case.transport == "grpc":
        return send_grpc(server, case)
    if case.transport == "infer":
        return send_infer(server, case)
    return send_http(server, case)


# ----- judging --------------------------------------------------------------------------------


@dataclass
class Baseline:
    text: str
    ids: list[int]


def judge(case: Case, outcome: Outcome, baseline: Baseline) -> tuple[str, str]:
    """("error" | "answer" | "lost" | "wrong", why)."""
    if outcome.lost:
        return "lost", "no final response"
    if outcome.problem:
        return "wrong", outcome.problem
    if outcome.after_final:
        return "wrong", f"{outcome.after_final} responses after the final one"
    if outcome.error is not None:
        if case.expect == "ok":
            return "wrong", f"an error for a valid request: {outcome.error[:300]}"
        if case.names and not any(name in outcome.error for name in case.names):
            return "wrong", f"the error does not name {case.names}: {outcome.error[:300]}"
        if "Traceback" in outcome.error or "\n  File " in outcome.error:
            return "wrong", f"a traceback as the error: {outcome.error[:300]}"
        return "error", ""
    if case.expect == "error":
        return "wrong", f"an answer where an error was due: {outcome.text[:100]!r}"
    if outcome.finals != 1:
        return "wrong", f"{outcome.finals} final responses"
    if not isinstance(outcome.text, str):
        return "wrong", f"text_output {outcome.text!r}"
    limit = case.max_tokens
    if len(outcome.ids) > limit or (case.exact_len and len(outcome.ids) != limit):
        return "wrong", f"{len(outcome.ids)} tokens for max_tokens {limit}"
    if not outcome.ids:
        return "wrong", "no token"
    if case.baseline and case.fields.get("exclude_input_in_output", True) is True:
        if (outcome.text, outcome.ids) != (baseline.text, baseline.ids):
            return "wrong", f"{outcome.text!r} {outcome.ids} != baseline {baseline.text!r}"
    if case.forbid and case.forbid in outcome.text:
        return "wrong", f"stop string {case.forbid!r} in {outcome.text!r}"
    outputs = outcome.outputs
    if case.fields.get("return_num_output_tokens") and \
            outputs.get("num_output_tokens") != len(outcome.ids):
        return "wrong", f"num_output_tokens {outputs} for {len(outcome.ids)} ids"
    if case.fields.get("return_finish_reason") and \
            outputs.get("finish_reason") not in ("length", "stop"):
        return "wrong", f"finish_reason {outputs}"
    if case.fields.get("return_num_input_tokens") and not outputs.get("num_input_tokens"):
        return "wrong", f"num_input_tokens {outputs}"
    return "answer", ""


# ----- the test -------------------------------------------------------------------------------


class ReadyWatch:
    """Polls the server's and both models' readiness in the background."""

    def __init__(self, server: TritonServer) -> None:
        self.urls = [f"{server.http_url}/v2/health/ready"] + \
            [f"{server.http_url}/v2/models/{m}/ready" for m in MODELS]
        self.polls = 0
        self.failures: list[tuple[str, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for url in self.urls:
                status = http_status(url)
                self.polls += 1
                if status != 200:
                    self.failures.append((url, status))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def baseline_of(server: TritonServer, model: str) -> Baseline:
    case = Case(kind="baseline", transport="http", model=model,
                fields={"text_input": PROMPT, "max_tokens": MAX, "exclude_input_in_output": True})
    outcome = send(server, case)
    assert outcome.error is None and not outcome.problem and not outcome.lost, outcome
    return Baseline(outcome.text, outcome.ids)


@pytest.fixture(scope="module")
def server(triton_server: TritonServer, default_model: Path) -> TritonServer:  # noqa: F811
    return triton_server


def test_hostile_requests(server: TritonServer, default_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model))
    assert len(tokenizer) == VOCAB
    baseline = baseline_of(server, "ensemble")
    assert len(baseline.ids) == MAX and baseline.text.strip(), baseline
    assert baseline_of(server, "minisgl") == baseline

    cases = make_cases(SEED, NUM_CASES, encode_prompt(tokenizer, PROMPT))
    assert len(cases) >= 300
    watch = ReadyWatch(server)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            outcomes = list(pool.map(lambda c: send(server, c), cases))
    finally:
        watch.stop()
    elapsed = time.monotonic() - started

    verdicts = [judge(c, o, baseline) for c, o in zip(cases, outcomes)]
    counts = Counter(v for v, _ in verdicts)
    wrong = [(c.kind, c.transport, c.model, why) for c, (v, why) in zip(cases, verdicts)
             if v == "wrong"]
    lost = [(c.kind, c.transport, c.model) for c, (v, _) in zip(cases, verdicts) if v == "lost"]
    idle = wait_engine_idle(server, IDLE_TIMEOUT_S)
    after = baseline_of(server, "ensemble")
    after_direct = baseline_of(server, "minisgl")
    ready = http_status(f"{server.http_url}/v2/health/ready")

    transports = Counter(c.transport for c in cases)
    models = Counter(c.model for c in cases)
    print(f"\nhostile input fuzz (seed {SEED}, {WORKERS} at a time, {elapsed:.1f} s):")
    print(f"  requests sent:        {len(cases)}  ({dict(transports)}; {dict(models)})")
    print(f"  errors returned:      {counts['error']}")
    print(f"  correct answers:      {counts['answer']}")
    print(f"  wrong outcomes:       {counts['wrong']}")
    print(f"  requests lost:        {counts['lost']}")
    print(f"  readiness polls:      {watch.polls}, not ready: {len(watch.failures)}")
    print(f"  KV pages in use once idle: {idle['minisgl_kv_pages_in_use']} "
          f"(running {idle['minisgl_requests_running']}, "
          f"waiting {idle['minisgl_requests_waiting']})")
    print(f"  good request after: same text as before: {after == baseline == after_direct}")
    for item in wrong[:20]:
        print("  WRONG", item)

    assert not lost, f"requests without a final response: {lost}"
    assert not wrong, f"{len(wrong)} wrong outcomes, e.g. {wrong[:10]}"
    assert counts["error"] + counts["answer"] == len(cases)
    assert counts["error"] > 0 and counts["answer"] > 0
    assert not watch.failures and watch.polls > 0, watch.failures[:10]
    assert ready == 200
    assert all(v == 0 for v in idle.values()), f"engine not idle after the fuzz: {idle}"
    assert after == baseline, (after, baseline)
    assert after_direct == baseline, (after_direct, baseline)


def test_denormal_temperature_acts_greedy(server: TritonServer) -> None:
    baseline = baseline_of(server, "minisgl")
    case = Case(kind="denormal", transport="grpc", model="minisgl",
                fields={"text_input": PROMPT, "max_tokens": MAX, "exclude_input_in_output": True,
                        "temperature": 1e-40, "stream": False})
    outcome = send(server, case)
    assert judge(case, outcome, baseline) == ("answer", "")
    assert (outcome.text, outcome.ids) == (baseline.text, baseline.ids)
