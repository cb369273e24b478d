"""End to end: tritonserver serving `model_repository/` (the embedded default model, greedy).

One server for the whole file (see tests/triton_fixtures.py). Requests use short max_tokens so
that the file stays within a few minutes on a 2-core CPU machine.
"""

from __future__ import annotations

import json
import queue
import re
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.tokenizer import encode_chat, encode_prompt
from tests.conftest import hf_greedy
from tests.triton_fixtures import (  # noqa: F401 - triton_server is a fixture
    GrpcStream,
    HttpResult,
    TritonServer,
    ensemble_inputs,
    grpc_generate,
    http_generate,
    http_generate_stream,
    http_status,
    metrics,
    tensor,
    triton_server,
    wait_engine_idle,
)

PROMPT = "The capital of France is"
MAX_TOKENS = 16
CHAT_QUESTION = "What is the capital of France?"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(default_model))


@pytest.fixture(scope="module")
def server(triton_server: TritonServer, default_model: Path) -> TritonServer:  # noqa: F811
    return triton_server


@pytest.fixture(scope="module")
def reference(server: TritonServer) -> HttpResult:
    """Non-streaming HTTP generate of PROMPT, prompt excluded: what every other path must match."""
    result = http_generate(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                    "exclude_input_in_output": True})
    assert result.status == 200, result.body
    assert result.text.strip() and len(result.ids) == MAX_TOKENS, result.body
    return result


def assert_one_final_last(result) -> None:  # noqa: ANN001 - a StreamResult
    assert not result.errors, result.errors
    assert result.responses, "no response"
    assert result.finals == 1, [r.final for r in result.responses]
    assert result.last.final


def good_request_succeeds(server: TritonServer) -> None:
    result = http_generate(server, {"text_input": PROMPT, "max_tokens": 4,
                                    "exclude_input_in_output": True})
    assert result.status == 200, result.body
    assert len(result.ids) == 4 and result.text.strip()
    assert http_status(f"{server.http_url}/v2/health/ready") == 200


# ----- 1. streaming over gRPC and HTTP SSE equals the non-streaming text -----------------------


def test_grpc_and_sse_streams_equal_non_streaming_text(server: TritonServer,
                                                       reference: HttpResult, tokenizer) -> None:
    grpc = grpc_generate(server, ensemble_inputs(PROMPT, MAX_TOKENS, stream=True))
    assert_one_final_last(grpc)
    assert len(grpc.responses) > 1, "streaming sent everything at once"
    assert all(not r.final for r in grpc.responses[:-1])
    assert grpc.text == reference.text
    assert grpc.ids == reference.ids
    assert not grpc.text.startswith(PROMPT)  # deltas never include the prompt

    events = http_generate_stream(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                           "return_finish_reason": True})
    assert events and not any("error" in e for e in events), events
    assert "".join(e["text_output"] for e in events) == reference.text
    sse_ids = [i for e in events for i in ([e["output_ids"]] if isinstance(e["output_ids"], int)
                                           else e["output_ids"])]
    assert sse_ids == reference.ids
    # the finish reason comes with the one final response, the last event
    assert [("finish_reason" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["finish_reason"] == "length"

    # exclude_input_in_output false: the non-streaming text starts with the prompt; unset: the
    # model's parameter decides (true in the shipped repository, as TensorRT-LLM's knob)
    full = http_generate(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                  "exclude_input_in_output": False})
    assert full.status == 200, full.body
    prompt_text = tokenizer.decode(encode_prompt(tokenizer, PROMPT), skip_special_tokens=True)
    assert full.text == prompt_text + reference.text
    assert full.ids == reference.ids
    unset = http_generate(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS})
    assert (unset.text, unset.ids) == (reference.text, reference.ids)


# ----- 2. the server equals the offline API and HF transformers -------------------------------


def test_server_equals_offline_api_and_hf(server: TritonServer, reference: HttpResult,
                                          default_model: Path, tokenizer) -> None:
    with LLM(default_model, device="cpu") as llm:
        offline = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert offline.text == reference.text
    assert offline.token_ids == reference.ids

    prompt_ids = encode_prompt(tokenizer, PROMPT)
    hf_ids = hf_greedy(default_model, [prompt_ids], MAX_TOKENS, stop_at_eos=True)[0]
    assert reference.ids == hf_ids
    assert reference.text == tokenizer.decode(hf_ids, skip_special_tokens=True)


def test_tensorrt_llm_sampling_inputs_equal_the_offline_api(server: TritonServer,
                                                            default_model: Path,
                                                            reference: HttpResult,
                                                            tokenizer) -> None:  # noqa: ANN001
    """The sampling inputs as TensorRT-LLM's and LlamaIndex's clients send them (beam_width 1,
    length_penalty, random_seed, top_p 0 and top_k 0 meaning off, the penalties, min_p, bad
    words and embedding bias tokenized as its preprocessing does, end_id in place of EOS) give
    exactly what the same SamplingParams give through the offline API, on both models."""
    first_word = tokenizer.decode(reference.ids[:1])
    bias = {t: -3.0 for t in tokenizer.encode(" the")}
    for t in tokenizer.encode(" a"):
        bias[t] = bias.get(t, 0.0) + 2.0
    end_id = reference.ids[5]
    cases = [
        ({"bad_words": [first_word, ""], "embedding_bias_words": [" the", " a"],
          "embedding_bias_weights": [-3.0, 2.0]},
         SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias,
                        bad_token_ids=[tokenizer.encode(first_word, add_special_tokens=False)])),
        ({"end_id": end_id},
         SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[end_id], ignore_eos=True)),
        ({"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4,
          "beam_width": 1, "length_penalty": 1.0, "top_p": 0.0, "top_k": 0},
         SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3, presence_penalty=0.5,
                        frequency_penalty=0.4)),
        ({"temperature": 0.8, "min_p": 0.1, "min_tokens": 4,
          "random_seed": tensor("random_seed", 1234, "UINT64")},
         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, min_p=0.1, min_tokens=4,
                        seed=1234)),
    ]
    with LLM(default_model, device="cpu") as llm:
        offline = llm.generate([PROMPT] * len(cases), [p for _, p in cases])
    for (options, _), expected in zip(cases, offline):
        for model in ("ensemble", "minisgl"):
            got = grpc_generate(server, ensemble_inputs(
                PROMPT, MAX_TOKENS, stream=True, exclude_input_in_output=True, **options),
                model=model)
            assert_one_final_last(got)
            assert got.ids == expected.token_ids and got.text == expected.text, (model, options)
    # HTTP generate takes them as top-level keys and inside "parameters", lists included
    bad_words_case = cases[0][0]
    for body in ({"text_input": PROMPT, "max_tokens": MAX_TOKENS, **bad_words_case},
                 {"text_input": PROMPT, "parameters": {"max_tokens": MAX_TOKENS,
                                                       **bad_words_case}}):
        got_http = http_generate(server, body)
        assert got_http.status == 200, got_http.body
        assert (got_http.ids, got_http.text) == (offline[0].token_ids, offline[0].text)
    # each case really changed the answer
    assert all(o.token_ids != reference.ids for o in offline), [o.token_ids for o in offline]
    assert offline[1].token_ids == reference.ids[:6]  # ends at end_id, which it includes
    refused = grpc_generate(server, ensemble_inputs(PROMPT, 4, beam_width=4))
    assert refused.errors and "beam_width" in str(refused.errors[0]), refused


@pytest.mark.parametrize("name, value", [
    ("lora_task_id", tensor("lora_task_id", 3, "UINT64")),
    ("lora_weights", tensor("lora_weights", np.zeros((1, 2, 4), np.float16), "FP16")),
    ("prompt_vocab_size", tensor("prompt_vocab_size", 8, "INT32")),
])
def test_inputs_of_missing_features_are_refused_by_name(server: TritonServer, name: str,
                                                        value) -> None:  # noqa: ANN001
    """Declared (so that Triton passes them on), then refused by the model with their name:
    features it does not have, and LoRA, which the shipped model leaves off."""
    got = grpc_generate(server, ensemble_inputs(PROMPT, 4, stream=True) + [value])
    assert got.errors and name in str(got.errors[0]), got
    good_request_succeeds(server)


def test_perf_metrics(server: TritonServer, tokenizer) -> None:  # noqa: ANN001
    """`return_perf_metrics`: TensorRT-LLM's KV-cache and timing outputs on every response,
    consistent with each other and with the prefix cache (the same prompt again reuses pages)."""
    prompt = "Perf metrics of a prompt long enough to fill several pages. " * 6
    inputs = ensemble_inputs(prompt, 6, stream=True, return_perf_metrics=True)
    first = grpc_generate(server, inputs)
    again = grpc_generate(server, inputs)
    for got in (first, again):
        assert_one_final_last(got)
        last = got.last.outputs
        assert last["arrival_time_ns"] <= last["first_scheduled_time_ns"] <= \
            last["first_token_time_ns"] <= last["last_token_time_ns"] <= time.time_ns()
        assert abs(last["arrival_time_ns"] - time.time_ns()) < 120e9
        assert last["kv_cache_alloc_total_blocks"] == \
            last["kv_cache_alloc_new_blocks"] + last["kv_cache_reused_blocks"] > 0
        assert last["total_draft_tokens"] == 0 and last["acceptance_rate"] == [0.0]
        assert all("kv_cache_alloc_total_blocks" in r.outputs for r in got.responses)
    assert first.last.outputs["kv_cache_reused_blocks"] == 0
    assert again.last.outputs["kv_cache_reused_blocks"] > 0
    assert again.last.outputs["kv_cache_alloc_total_blocks"] == \
        first.last.outputs["kv_cache_alloc_total_blocks"]


def test_num_return_sequences_and_log_probs_equal_the_offline_api(server: TritonServer,
                                                                  default_model: Path) -> None:
    """`num_return_sequences` 3 (sampled, seeded) with `return_log_probs`: three sequences, each
    equal to the offline API's sample of that index with its log-probabilities, every response
    tagged with its `sequence_index`, one FINAL for the request; streaming and not."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=77, n=3, logprobs=0)
    with LLM(default_model, device="cpu") as llm:
        offline = llm.generate([PROMPT], params)
    options = {"temperature": 0.9, "seed": tensor("seed", 77, "UINT64"),
               "num_return_sequences": 3, "return_log_probs": True,
               "exclude_input_in_output": True}
    for stream in (True, False):
        got = grpc_generate(server, ensemble_inputs(PROMPT, 8, stream=stream, **options))
        assert_one_final_last(got)
        by_index: dict[int, list] = {0: [], 1: [], 2: []}
        for response in got.responses:
            by_index[response.outputs["sequence_index"]].append(response)
        assert len({tuple(o.token_ids) for o in offline}) > 1  # the samples differ
        for index, expected in enumerate(offline):
            responses = by_index[index]
            assert [i for r in responses for i in r.ids] == expected.token_ids, (stream, index)
            assert "".join(r.text for r in responses) == expected.text
            logprobs = [x for r in responses for x in r.outputs["output_log_probs"]]
            assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)
            assert responses[-1].outputs["cum_log_probs"][0] == pytest.approx(
                expected.cumulative_logprob, abs=1e-4)
        if not stream:
            assert len(got.responses) == 3  # one whole response per sequence


def test_context_and_generation_logits_equal_the_offline_api(server: TritonServer,
                                                             default_model: Path) -> None:
    """`return_context_logits` / `return_generation_logits`: TensorRT-LLM's shapes ([1, prompt,
    vocab] once, [1, 1, tokens, vocab] per response), the offline API's values; streaming and
    not; a request past the model's `max_logits_values` gets an error naming the input."""
    params = SamplingParams(max_tokens=4, return_context_logits=True,
                            return_generation_logits=True)
    with LLM(default_model, device="cpu") as llm:
        expected = llm.generate([PROMPT], params)[0]
    for stream in (True, False):
        got = grpc_generate(server, ensemble_inputs(
            PROMPT, 4, stream=stream, return_context_logits=True, return_generation_logits=True))
        assert_one_final_last(got)
        contexts = [r.outputs["context_logits"] for r in got.responses
                    if "context_logits" in r.outputs]
        assert len(contexts) == 1 and contexts[0].shape == (1, *expected.context_logits.shape)
        np.testing.assert_allclose(contexts[0][0], expected.context_logits, atol=1e-4)
        generation = np.concatenate([r.outputs["generation_logits"][0, 0]
                                     for r in got.responses])
        np.testing.assert_allclose(generation, expected.generation_logits, atol=1e-4)
        assert got.ids == expected.token_ids
    too_many = grpc_generate(server, ensemble_inputs(PROMPT, 2000, stream=True,
                                                     return_generation_logits=True))
    assert too_many.errors and "return_generation_logits" in str(too_many.errors[0])


WEATHER_TOOL = {"type": "object", "properties": {
    "location": {"type": "string", "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"]}


def test_guided_decoding_inputs(server: TritonServer, tokenizer) -> None:  # noqa: ANN001
    """TensorRT-LLM's guided-decoding inputs over gRPC streaming and HTTP generate, and the
    tensors Triton's OpenAI frontend sends for a tool call with a named tool_choice (the
    tool's parameters schema as `json_schema`, the chat prompt rendered by the frontend): the
    output is in the language; a guide that does not compile gets an error naming the input."""
    import jsonschema

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        add_generation_prompt=True, tokenize=False)
    drafts_before = metrics(server).get("minisgl_spec_draft_tokens_total", 0)
    tool_call = grpc_generate(server, ensemble_inputs(
        chat, 64, stream=True, return_num_input_tokens=True, return_num_output_tokens=True,
        return_perf_metrics=True, guided_decoding_guide_type="json_schema",
        guided_decoding_guide=json.dumps(WEATHER_TOOL)))
    assert_one_final_last(tool_call)
    jsonschema.validate(json.loads(tool_call.text), WEATHER_TOOL)
    # Jump-forward (on in the shipped config) verified the schema's fixed keys as drafts.
    perf = tool_call.last.outputs
    assert perf["total_draft_tokens"] >= perf["total_accepted_draft_tokens"] > 0
    assert 0 < perf["acceptance_rate"][0] <= 1
    deadline = time.monotonic() + 5  # the gauges and this counter are sent every 20 ms
    while metrics(server).get("minisgl_spec_draft_tokens_total", 0) <= drafts_before:
        assert time.monotonic() < deadline, "minisgl_spec_draft_tokens_total did not grow"
        time.sleep(0.05)
    for kind, guide, valid in (
            ("regex", "[0-9]{3}-[0-9]{4}", lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
            ("ebnf_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
            ("json", None, lambda t: isinstance(json.loads(t), dict))):
        options = {"guided_decoding_guide_type": kind}
        if guide is not None:
            options["guided_decoding_guide"] = guide
        streamed = grpc_generate(server, ensemble_inputs(CHAT_QUESTION, 48, stream=True,
                                                         apply_chat_template=True,
                                                         return_finish_reason=True, **options))
        assert_one_final_last(streamed)
        if kind == "json" and streamed.last.outputs["finish_reason"] == "length":
            assert streamed.text.startswith("{"), streamed.text  # an object, cut short
        else:
            assert valid(streamed.text), (kind, streamed.text)
        over_http = http_generate(server, {"text_input": CHAT_QUESTION, "max_tokens": 48,
                                           "apply_chat_template": True, **options})
        assert over_http.status == 200, over_http.body
        assert over_http.text == streamed.text
    bad = grpc_generate(server, ensemble_inputs(PROMPT, 8, stream=True,
                                                guided_decoding_guide_type="regex",
                                                guided_decoding_guide="a(b"))
    assert bad.errors and "guided_decoding_guide" in str(bad.errors[0]), bad
    good_request_succeeds(server)


def test_engine_model_takes_the_ensembles_inputs(server: TritonServer, reference: HttpResult,
                                                 tokenizer) -> None:
    """`minisgl` called directly with `text_input` answers like the ensemble; with token ids
    from preprocessing too; both at once is an error naming the field."""
    direct = grpc_generate(server, ensemble_inputs(PROMPT, MAX_TOKENS, stream=True,
                                                   exclude_input_in_output=True), model="minisgl")
    assert_one_final_last(direct)
    assert direct.text == reference.text and direct.ids == reference.ids
    ids = encode_prompt(tokenizer, PROMPT)
    by_ids = grpc_generate(server, [tensor("input_ids", ids, "INT32"),
                                    tensor("max_tokens", MAX_TOKENS, "INT32")], model="minisgl")
    assert_one_final_last(by_ids)
    assert by_ids.ids == reference.ids
    both = grpc_generate(server, ensemble_inputs(PROMPT, 4) + [tensor("input_ids", ids, "INT32")],
                         model="minisgl")
    assert both.errors and "input_ids" in str(both.errors[0]), both


# ----- 3. chat template ---------------------------------------------------------------------


CHAT_OPTIONS = {"max_tokens": 24, "apply_chat_template": True, "exclude_input_in_output": True,
                "return_num_input_tokens": True, "return_num_output_tokens": True,
                "return_finish_reason": True, "return_cached_tokens": True}


@pytest.fixture(scope="module")
def chat_results(server: TritonServer) -> tuple[HttpResult, HttpResult]:
    as_user = http_generate(server, {"text_input": CHAT_QUESTION, **CHAT_OPTIONS})
    messages = json.dumps([{"role": "user", "content": CHAT_QUESTION}])
    as_messages = http_generate(server, {"text_input": messages, **CHAT_OPTIONS})
    return as_user, as_messages


def test_chat_template_answers_paris(chat_results, tokenizer) -> None:  # noqa: ANN001
    as_user, as_messages = chat_results
    for result in (as_user, as_messages):
        assert result.status == 200, result.body
        assert "Paris" in result.text, result.text
        assert "<|im_start|>" not in result.text and "assistant" not in result.text
    assert as_messages.text == as_user.text
    assert as_messages.ids == as_user.ids
    expected_prompt = encode_chat(tokenizer, [{"role": "user", "content": CHAT_QUESTION}])
    assert as_user.body["num_input_tokens"] == len(expected_prompt)
    assert as_messages.body["num_input_tokens"] == len(expected_prompt)


def test_chat_template_streaming_and_full_text(server: TritonServer, chat_results,
                                              tokenizer) -> None:  # noqa: ANN001
    as_user, _ = chat_results
    streamed = grpc_generate(server, ensemble_inputs(CHAT_QUESTION, 24, stream=True,
                                                     apply_chat_template=True))
    assert_one_final_last(streamed)
    assert streamed.text == as_user.text
    full = http_generate(server, {"text_input": CHAT_QUESTION, "max_tokens": 24,
                                  "apply_chat_template": True, "exclude_input_in_output": False})
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": CHAT_QUESTION}])
    assert full.text == tokenizer.decode(prompt_ids, skip_special_tokens=True) + as_user.text
    # the chat answer alone, as Triton's OpenAI frontend (which sends no
    # exclude_input_in_output) must get it: the shipped model excludes the prompt by default
    answer = http_generate(server, {"text_input": CHAT_QUESTION, "max_tokens": 24,
                                    "apply_chat_template": True})
    assert answer.text == as_user.text


# ----- 4. concurrent streams ------------------------------------------------------------------


CONCURRENT_PROMPTS = [
    "The capital of France is", "My favorite fruit is", "Once upon a time, there was",
    "The quick brown fox", "Water boils at", "The largest planet in the solar system is",
    "In 1492, Columbus", "A healthy breakfast includes", "The best way to learn Python is",
    "Photosynthesis is the process", "The speed of light is", "Cats and dogs are",
    "To make a cup of tea, first", "The Eiffel Tower is located in", "Mount Everest is",
    "The meaning of life is",
]


CONCURRENT_MAX_TOKENS = 12


def test_concurrent_grpc_streams(server: TritonServer) -> None:
    assert len(CONCURRENT_PROMPTS) == 16
    streams = [GrpcStream(server) for _ in CONCURRENT_PROMPTS]
    try:
        for i, (stream, prompt) in enumerate(zip(streams, CONCURRENT_PROMPTS)):
            stream.send(ensemble_inputs(prompt, CONCURRENT_MAX_TOKENS, stream=True), f"c{i}")
        results = [stream.collect([f"c{i}"], timeout=300)[f"c{i}"]
                   for i, stream in enumerate(streams)]
        time.sleep(0.5)
        late = {i: s.events.qsize() for i, s in enumerate(streams) if not s.events.empty()}
        assert not late, f"responses after the final one, per stream: {late}"
    finally:
        for stream in streams:
            stream.close()
    for prompt, result in zip(CONCURRENT_PROMPTS, results):
        assert_one_final_last(result)
        assert len(result.ids) == CONCURRENT_MAX_TOKENS or result.ids[-1:] == [2], \
            (prompt, result.ids)

    for prompt, result in zip(CONCURRENT_PROMPTS, results):  # one at a time
        alone = http_generate(server, {"text_input": prompt, "max_tokens": CONCURRENT_MAX_TOKENS,
                                       "exclude_input_in_output": True})
        assert alone.status == 200, alone.body
        assert (result.text, result.ids) == (alone.text, alone.ids), prompt


# ----- 6. bad inputs ------------------------------------------------------------------------


BAD_HTTP_REQUESTS = [
    ({"text_input": "", "max_tokens": 4}, "text_input"),
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 4, "top_p": -0.5}, "top_p"),
    ({"text_input": PROMPT, "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"text_input": PROMPT, "max_tokens": 4, "temperature": -0.5}, "temperature"),
    ({"text_input": "word " * 10000, "max_tokens": 4}, "prompt"),
    ({"text_input": '[{"role": 1}]', "max_tokens": 4, "apply_chat_template": True},
     "text_input"),
    # keys that are no input arrive as request parameters: refused by name, never ignored
    ({"text_input": PROMPT, "max_tokens": 4, "temprature": 0.5}, "did you mean temperature"),
    ({"text_input": PROMPT, "parameters": {"max_tokens": 4, "guided_json": "{}"}},
     "guided_json"),
]


@pytest.mark.parametrize("body,field", BAD_HTTP_REQUESTS,
                         ids=["empty-text", "max-tokens-0", "max-tokens-huge", "top-p-negative",
                              "top-p-1.5", "negative-temperature", "prompt-too-long",
                              "bad-chat-json", "misspelled-input", "unknown-parameter"])
def test_bad_http_request_names_the_field(server: TritonServer, body: dict, field: str) -> None:
    result = http_generate(server, body)
    assert 400 <= result.status < 500, (result.status, result.body)
    assert result.error and field in result.error, result.body


def test_bad_grpc_requests_name_the_field(server: TritonServer) -> None:
    cases = [
        (ensemble_inputs(PROMPT, 4) [:1] + [tensor("max_tokens", 4.0, "FP32")], "max_tokens"),
        (ensemble_inputs(b"\xff\xfe", 4), "text_input"),
        (ensemble_inputs(PROMPT, 4, stream=True, top_p=1.5), "top_p"),
    ]
    for inputs, field in cases:
        with GrpcStream(server) as stream:
            stream.send(inputs, "bad")
            result = stream.collect(["bad"], timeout=60)["bad"]
            assert not result.responses, [r.text for r in result.responses]
            assert len(result.errors) == 1 and field in result.errors[0].message(), result.errors
            with pytest.raises(queue.Empty):  # nothing follows the error
                stream.next_event(timeout=0.3)


def test_wrong_json_type_is_rejected(server: TritonServer) -> None:
    # Triton's HTTP frontend parses the JSON before any model sees it; its message
    # ("attempt to access JSON non-number as double") does not name the input.
    result = http_generate(server, {"text_input": PROMPT, "max_tokens": 4, "temperature": "hot"})
    assert result.status >= 400 and result.error, (result.status, result.body)


def test_server_healthy_after_bad_requests(server: TritonServer) -> None:
    good_request_succeeds(server)


# ----- 7. multi-byte characters while streaming ---------------------------------------------


# Chat-templated prompts the model answers with CJK characters / emoji (one character is 2-3
# byte-level tokens). max_tokens ends each answer on a character boundary: a request cut inside
# a character ends with U+FFFD in both the streamed and the whole text, as tokenizer.decode does.
MULTIBYTE_PROMPTS = [
    ("Translate 'thank you' into Chinese. Answer with the Chinese characters only.", 14),
    ("Reply with a single emoji that means happy.", 15),  # 🌟 x 5, 3 tokens each
]


def test_multibyte_output_streams_whole_characters(server: TritonServer) -> None:
    with GrpcStream(server) as stream:
        for i, (prompt, max_tokens) in enumerate(MULTIBYTE_PROMPTS):
            stream.send(ensemble_inputs(prompt, max_tokens, stream=True,
                                        apply_chat_template=True), f"s{i}")
        streamed = stream.collect([f"s{i}" for i in range(len(MULTIBYTE_PROMPTS))])
    for i, (prompt, max_tokens) in enumerate(MULTIBYTE_PROMPTS):
        result = streamed[f"s{i}"]
        assert_one_final_last(result)
        deltas = [r.text for r in result.responses]
        assert not any(REPLACEMENT in d for d in deltas), deltas
        assert any(ord(ch) > 0x2E7F for ch in result.text), result.text  # CJK or emoji
        # characters split over several tokens: their first tokens' responses carry no text
        assert any(r.ids and r.text == "" for r in result.responses), deltas
        whole = http_generate(server, {"text_input": prompt, "max_tokens": max_tokens,
                                       "apply_chat_template": True,
                                       "exclude_input_in_output": True})
        assert whole.status == 200, whole.body
        assert result.text == whole.text
        assert result.ids == whole.ids


# ----- 8. return_* outputs ------------------------------------------------------------------


def test_return_flags_stop_and_length(server: TritonServer, chat_results,  # noqa: ANN001
                                      tokenizer) -> None:
    as_user, _ = chat_results
    body = as_user.body
    assert body["finish_reason"] == "stop", body  # EOS before max_tokens
    assert len(as_user.ids) < 24 and as_user.ids[-1] == tokenizer.eos_token_id
    assert body["num_output_tokens"] == len(as_user.ids)

    result = http_generate(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                    "exclude_input_in_output": True,
                                    "return_num_input_tokens": True,
                                    "return_num_output_tokens": True,
                                    "return_finish_reason": True})
    assert result.status == 200, result.body
    assert result.body["finish_reason"] == "length"
    assert result.body["num_output_tokens"] == len(result.ids) == MAX_TOKENS
    assert result.body["num_input_tokens"] == len(encode_prompt(tokenizer, PROMPT))
    assert "cached_tokens" not in result.body  # not asked for

    plain = http_generate(server, {"text_input": PROMPT, "max_tokens": 2})
    assert plain.status == 200
    assert not {"finish_reason", "num_input_tokens", "num_output_tokens",
                "cached_tokens"} & set(plain.body), plain.body


def test_return_flags_streaming(server: TritonServer) -> None:
    result = grpc_generate(server, ensemble_inputs(
        PROMPT, 6, stream=True, return_num_input_tokens=True, return_num_output_tokens=True,
        return_finish_reason=True))
    assert_one_final_last(result)
    assert [("finish_reason" in r.outputs) for r in result.responses] == \
        [False] * (len(result.responses) - 1) + [True]
    assert result.last.outputs["finish_reason"] == "length"
    # each response counts its own tokens (TensorRT-LLM's, vLLM's and the OpenAI frontend's
    # reading): they add up to the whole output
    counts = [r.outputs["num_output_tokens"] for r in result.responses]
    assert counts == [len(r.ids) for r in result.responses]
    assert sum(counts) == len(result.ids) == 6


def test_cached_tokens_on_repeated_long_prompt(server: TritonServer, tokenizer) -> None:
    prompt = ("Zebras of the northern savanna keep a strict ledger of every watering hole, "
              "noting the depth, the taste and the crocodiles seen there. ") * 8
    n_prompt = len(encode_prompt(tokenizer, prompt))
    assert n_prompt > 200
    body = {"text_input": prompt, "max_tokens": 4, "exclude_input_in_output": True,
            "return_cached_tokens": True, "return_num_input_tokens": True,
            "return_num_output_tokens": True}
    before = metrics(server)
    first = http_generate(server, body)
    second = http_generate(server, body)
    after = metrics(server)
    assert first.status == second.status == 200, (first.body, second.body)
    assert first.body["num_input_tokens"] == second.body["num_input_tokens"] == n_prompt
    assert first.body["cached_tokens"] == 0
    assert 0 < second.body["cached_tokens"] < n_prompt
    assert second.body["cached_tokens"] >= n_prompt - 16
    assert (second.text, second.ids) == (first.text, first.ids)
    # the counters moved by exactly these two requests
    assert after["minisgl_prompt_tokens_cached_total"] - \
        before["minisgl_prompt_tokens_cached_total"] == second.body["cached_tokens"]
    assert after["minisgl_generated_tokens_total"] - before["minisgl_generated_tokens_total"] == \
        first.body["num_output_tokens"] + second.body["num_output_tokens"]
    assert after["minisgl_time_to_first_token_seconds_count"] - \
        before["minisgl_time_to_first_token_seconds_count"] == 2


# ----- 5. cancellation ----------------------------------------------------------------------


def cancel_long_stream(server: TritonServer, model: str, inputs: list) -> None:
    stream = GrpcStream(server)
    try:
        stream.send(inputs, "long", model=model)
        for _ in range(3):  # a few tokens, then cancel
            _, response, error = stream.next_event(timeout=120)
            assert error is None, error
            assert not response.final, "the long request ended before it was cancelled"
    finally:
        stream.close(cancel_requests=True)
    events = []
    while True:
        try:
            events.append(stream.next_event(timeout=0.5))
        except queue.Empty:
            break
    errors = [e for _, _, e in events if e is not None]
    assert errors and errors[-1].status() == "StatusCode.CANCELLED", events
    assert not any(r is not None and r.final for _, r, _ in events), events


def test_cancel_engine_model_stream_frees_the_engine(server: TritonServer) -> None:
    """Cancelling a stream sent with the ensemble's inputs to the decoupled `minisgl` model."""
    inputs = ensemble_inputs("Tell me a very long story about a dragon.", 400, stream=True,
                             ignore_eos=True)
    cancel_long_stream(server, "minisgl", inputs)
    idle = wait_engine_idle(server)
    assert all(v == 0 for v in idle.values()), f"engine still busy 5 s after cancel: {idle}"
    good_request_succeeds(server)


@pytest.mark.xfail(strict=True, reason=(
    "Triton 2.51 does not pass a client's cancellation to a decoupled step already running "
    "inside an ensemble (it cancels only between steps), so the engine never sees it; "
    "clients that cancel mid-stream call `minisgl` directly (test above)"))
def test_cancel_ensemble_stream_frees_the_engine(server: TritonServer) -> None:
    """Cancelling a stream sent to the public `ensemble` model."""
    inputs = ensemble_inputs("Tell me a very long story about a dragon.", 200, stream=True,
                             ignore_eos=True)
    cancel_long_stream(server, "ensemble", inputs)
    try:
        idle = wait_engine_idle(server)
        assert all(v == 0 for v in idle.values()), f"engine still busy 5 s after cancel: {idle}"
    finally:  # an uncancelled request runs to its end before the server is stopped
        wait_engine_idle(server, timeout=600)
    good_request_succeeds(server)
