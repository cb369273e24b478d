"""The OpenAI front door without a server: requests mapped onto the engine's fields and the
`minisgl` model's declared inputs, errors naming the OpenAI parameter, tool calls parsed from
each chat template format and held back while streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl_backend.openai_server.engine import engine_error, engine_values
from minisgl_backend.openai_server.errors import OpenAIError
from minisgl_backend.openai_server.params import parse_request
from minisgl_backend.openai_server.served_model import ServedModel, load_served_model
from minisgl_backend.openai_server.tools import ToolPlan, ToolStream, parse_tool_calls, tool_plan
from minisgl_backend.serving.interface import inputs_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def model(default_model: Path) -> ServedModel:
    return load_served_model(default_model, "smol", kv_tokens=4096)


def chat(served: ServedModel, **body: object):  # noqa: ANN201
    return parse_request({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                          **body}, "chat", served)


def test_openai_controls_reach_the_sampling_params(model: ServedModel) -> None:
    gen = chat(model, max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=20,
               min_p=0.1, seed=3, presence_penalty=0.5, frequency_penalty=-0.5,
               repetition_penalty=1.1, n=2, stop=["\n"], logit_bias={"42": -100},
               ignore_eos=True, min_tokens=2, logprobs=True, top_logprobs=3)
    p = gen.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        7, 0.5, 0.9, 20, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.n, tuple(p.stop), p.logit_bias, p.ignore_eos, p.min_tokens, p.logprobs) == (
        2, ("\n",), {42: -100}, True, 2, 3)


def test_openai_defaults(model: ServedModel) -> None:
    gen = chat(model)
    assert gen.params.temperature == 1.0  # OpenAI's, not the engine's greedy default
    assert gen.params.max_tokens == 4096 - len(gen.prompt_ids)  # the rest of the context
    completion = parse_request({"model": "smol", "prompt": "Hi"}, "completions", model)
    assert completion.params.max_tokens == 16 and completion.prompt_ids == [
        *model.tokenizer.encode("Hi")]


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"n": 65}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "gpt-4"}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"best_of": 2}, "best_of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
])
def test_bad_requests_name_the_parameter(model: ServedModel, body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        chat(model, **body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_engine_inputs_follow_the_declarations(model: ServedModel) -> None:
    declared = {i.name for i in inputs_of("minisgl")}
    gen = chat(model, max_tokens=5, temperature=0.7, seed=9, n=2, stop="x",
               logit_bias={"11": 2.0}, logprobs=True, top_logprobs=2,
               response_format={"type": "json_schema",
                                "json_schema": {"name": "n", "schema": {"type": "object"}}})
    values = engine_values(gen)
    assert set(values) <= declared
    assert values["input_ids"] == gen.prompt_ids
    assert (values["max_tokens"], values["temperature"], values["seed"]) == (5, 0.7, 9)
    assert values["num_return_sequences"] == 2 and values["stop_words"] == ["x"]
    assert (values["logit_bias_token_ids"], values["logit_bias_values"]) == ([11], [2.0])
    assert values["return_log_probs"] and values["num_top_log_probs"] == 2
    assert values["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(values["guided_decoding_guide"]) == {"type": "object"}
    # Controls left at the engine's defaults are not sent (top_k's "off" is -1 here, 0 there).
    plain = engine_values(chat(model, max_tokens=5, temperature=0))
    assert not {"temperature", "top_k", "top_p", "num_return_sequences", "seed"} & set(plain)


def test_engine_errors_name_the_openai_parameter(model: ServedModel) -> None:
    gen = chat(model, max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    error = engine_error("guided_decoding_guide does not compile: bad type", gen)
    assert (error.status, error.param) == (400, "response_format.json_schema.schema")
    assert error.message.startswith("response_format.json_schema.schema does not compile")
    assert engine_error("prompt has 9000 tokens; the limit is 8191", gen).param == "messages"
    assert engine_error("the engine process died", gen).status == 500


def test_tools_are_described_when_the_template_does_not_render_them(
        model: ServedModel) -> None:
    assert not model.renders_tools and model.tool_format == "hermes"
    gen = chat(model, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    prompt = model.tokenizer.decode(gen.prompt_ids)
    assert "<tools>" in prompt and "\"get_weather\"" in prompt
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<tool_call>\n{call}" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert gen.tools is not None and gen.tools.forced is None


def test_a_named_or_required_tool_choice_is_enforced_by_a_schema() -> None:
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.guide == TIME["function"]["parameters"]
    required = tool_plan([WEATHER, TIME], "required")
    assert required is not None and required.guide["type"] == "array"
    names = [c["properties"]["name"]["const"] for c in required.guide["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert tool_plan([WEATHER], "none") is None and tool_plan(None, None) is None


def calls_of(text: str, plan: ToolPlan, fmt: str = "hermes") -> list[tuple[str, dict]]:
    content, calls = parse_tool_calls(text, plan, fmt)  # type: ignore[arg-type]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_tool_calls_are_parsed_in_each_format() -> None:
    auto = ToolPlan([WEATHER, TIME], None)
    hermes = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
              '</tool_call>')
    assert calls_of(hermes, auto) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_tool_calls(hermes, auto, "hermes")[0] == "Let me check."
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert calls_of(llama, auto, "llama3") == [("get_weather", {"city": "Oslo"})]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    assert [n for n, _ in calls_of(two, auto, "llama3")] == ["get_time", "get_weather"]
    # Not a call of an offered function, or not JSON: plain content.
    for text, fmt in (('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "hermes"),
                      ("<tool_call>{oops</tool_call>", "hermes"), ("Paris.", "llama3"),
                      ('{"city": "Paris"}', "llama3")):
        assert parse_tool_calls(text, auto, fmt) == (text, []), text  # type: ignore[arg-type]
    forced = ToolPlan([WEATHER], "get_weather")
    assert calls_of('{"city": "Rome"}', forced) == [("get_weather", {"city": "Rome"})]
    required = ToolPlan([WEATHER, TIME], "required")
    assert calls_of('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', required) == [
        ("get_time", {"zone": "UTC"})]


def test_a_stream_holds_back_what_may_start_a_tool_call() -> None:
    stream = ToolStream(ToolPlan([WEATHER], None), "hermes")
    sent = [stream.feed(piece) for piece in
            ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {}}",
             "\n</tool_call>"]]
    assert sent == ["Sure", ". ", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    plain = ToolStream(ToolPlan([WEATHER], None), "hermes")
    assert plain.feed("a <b") == "a <b" and plain.feed(" <tool") == " "
    assert plain.finish() == ("<tool", [])
    llama = ToolStream(ToolPlan([WEATHER], None), "llama3")
    assert llama.feed("The answer") == "The answer"
    forced = ToolStream(ToolPlan([WEATHER], "get_weather"), "hermes")
    assert forced.feed('{"city": "Rome"}') == ""
    assert forced.finish()[1][0]["function"]["arguments"] == '{"city": "Rome"}'
