"""Triton request parsing and model settings, without a server: errors name the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from minisgl_backend.serving.request import (
    RequestError,
    chat_messages,
    parse_engine_request,
)
from minisgl_backend.serving.settings import engine_settings, resolve_model_dir


def getter(**inputs: object):  # noqa: ANN201
    arrays = {k: np.asarray(v) for k, v in inputs.items()}
    return arrays.get


def parse(**inputs: object):  # noqa: ANN201
    base = {"input_ids": [[5, 6, 7]], "max_tokens": [[8]]}
    return parse_engine_request(getter(**{**base, **inputs}), max_tokens_limit=100)


def test_defaults_follow_the_tensorrt_llm_convention() -> None:
    req = parse()
    assert req.prompt_ids == [5, 6, 7]
    assert req.params.max_tokens == 8 and req.params.is_greedy
    assert req.params.top_k == -1 and req.params.top_p == 1.0
    assert not req.stream and not req.exclude_input


def test_sampling_inputs_reach_the_params() -> None:
    req = parse(temperature=np.array([[0.7]], dtype=np.float32),
                top_k=np.array([[40]], dtype=np.int32), top_p=np.array([[0.9]], np.float32),
                seed=np.array([[2**64 - 1]], dtype=np.uint64),
                stop_words=np.array([[b"\n\n", b"END"]], dtype=object),
                end_id=np.array([[2]], dtype=np.int32), min_length=np.array([[3]], np.int32),
                stream=np.array([[True]]), ignore_eos=np.array([[True]]))
    p = req.params
    assert p.temperature == pytest.approx(0.7) and p.top_k == 40
    assert p.top_p == pytest.approx(0.9) and p.seed == 2**64 - 1
    assert p.stop == ("\n\n", "END") and p.stop_token_ids == (2,) and p.min_tokens == 3
    assert p.ignore_eos and req.stream


@pytest.mark.parametrize(("inputs", "field"), [
    ({"input_ids": np.zeros((1, 0), dtype=np.int32)}, "input_ids"),
    ({"max_tokens": [[0]]}, "max_tokens"),
    ({"max_tokens": [[101]]}, "max_tokens"),
    ({"max_tokens": np.array([[8.0]], dtype=np.float32)}, "max_tokens"),
    ({"max_tokens": [[1, 2]]}, "max_tokens"),
    ({"temperature": np.array([[-1.0]], dtype=np.float32)}, "temperature"),
    ({"temperature": np.array([[np.nan]], dtype=np.float32)}, "temperature"),
    ({"top_p": np.array([[-0.5]], dtype=np.float32)}, "top_p"),
    ({"repetition_penalty": np.array([[0.0]], dtype=np.float32)}, "repetition_penalty"),
    ({"presence_penalty": np.array([[2.5]], dtype=np.float32)}, "presence_penalty"),
    ({"frequency_penalty": np.array([[-3.0]], dtype=np.float32)}, "frequency_penalty"),
    ({"min_p": np.array([[1.5]], dtype=np.float32)}, "min_p"),
    ({"random_seed": np.array([[-1]], dtype=np.int64)}, "random_seed"),
    ({"min_tokens": np.array([[50]], dtype=np.int32)}, "min_tokens"),
    ({"beam_width": np.array([[4]], dtype=np.int32)}, "beam_width"),
    ({"seed": np.array([[1]], dtype=np.uint64), "random_seed": np.array([[2]], np.uint64)},
     "random_seed"),
    ({"length_penalty": np.array([[1]], dtype=np.bool_)}, "length_penalty"),
    ({"top_p": np.array([[1.5]], dtype=np.float32)}, "top_p"),
    ({"top_k": np.array([[-3]], dtype=np.int32)}, "top_k"),
    ({"stop_words": np.array([[b"\xff\xfe"]], dtype=object)}, "stop_words"),
    ({"stop_words": np.array([[1.0]], dtype=np.float32)}, "stop_words"),
    ({"stream": np.array([[1]], dtype=np.int32)}, "stream"),
    ({"min_length": np.array([[50]], dtype=np.int32)}, "min_length"),
])
def test_bad_inputs_name_the_field(inputs: dict, field: str) -> None:
    with pytest.raises(RequestError, match=field):
        parse(**inputs)


def test_tensorrt_llm_inputs_reach_the_params() -> None:
    """Both generations of names, TensorRT-LLM's "0 means off", and the inputs accepted for
    compatibility (beam_width 1, length_penalty, pad_id)."""
    f32 = np.float32
    req = parse(top_p=np.array([[0.0]], f32), top_k=np.array([[0]], np.int32),
                temperature=np.array([[1.0]], f32), repetition_penalty=np.array([[1.3]], f32),
                presence_penalty=np.array([[0.5]], f32), frequency_penalty=np.array([[-0.25]], f32),
                min_p=np.array([[0.1]], f32), random_seed=np.array([[7]], np.uint64),
                min_tokens=np.array([[2]], np.int32), beam_width=np.array([[1]], np.int32),
                length_penalty=np.array([[1.0]], f32), pad_id=np.array([[2]], np.int32))
    p = req.params
    assert p.top_p == 1.0 and p.top_k == -1 and p.seed == 7 and p.min_tokens == 2
    assert p.repetition_penalty == pytest.approx(1.3) and p.min_p == pytest.approx(0.1)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.25
    assert parse(min_length=np.array([[3]], np.int32)).params.min_tokens == 3
    same = parse(seed=np.array([[5]], np.uint64), random_seed=np.array([[5]], np.uint64))
    assert same.params.seed == 5


def test_every_sampling_input_feeds_a_sampling_params_field() -> None:
    from minisgl_backend.fields import specs_of
    from minisgl_backend.core import SamplingParams
    from minisgl_backend.serving.interface import sampling_inputs

    fields = specs_of(SamplingParams)
    assert all(i.feeds in fields for i in sampling_inputs())


def test_config_pbtxt_files_are_generated_from_the_declaration() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    result = subprocess.run([sys.executable, "scripts/gen_configs.py", "--check"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_missing_max_tokens_is_an_error() -> None:
    with pytest.raises(RequestError, match="max_tokens"):
        parse_engine_request(getter(input_ids=[[1, 2]]), max_tokens_limit=10)


def test_chat_messages_from_text_or_json() -> None:
    assert chat_messages("hello") == [{"role": "user", "content": "hello"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_messages(json.dumps(messages)) == messages
    for bad in ('[{"role": 1}]', "[1, 2]", "[]", '[{"role": "user"'):
        with pytest.raises(RequestError, match="text_input"):
            chat_messages(bad)


def test_every_engine_setting_is_a_parameter_of_the_minisgl_config() -> None:
    from minisgl_backend.serving.settings import engine_parameter_names

    text = (Path(__file__).resolve().parents[1] / "model_repository" / "minisgl"
            / "config.pbtxt").read_text()
    keys = set(re.findall(r'parameters \{ key: "(\w+)"', text))
    assert set(engine_parameter_names()) <= keys
    speculative = engine_settings({"speculative": "ngram", "num_speculative_tokens": "3",
                                   "speculative_min_acceptance": "0.2", "jump_forward": "no"})
    assert speculative == {"speculative": "ngram", "num_speculative_tokens": 3,
                           "speculative_min_acceptance": 0.2, "jump_forward": False}


def test_engine_settings_from_parameters(tmp_path) -> None:  # noqa: ANN001
    settings = engine_settings({"tp_size": "2", "page_size": "", "cache": "naive",
                                "kv_memory_fraction": "0.5", "model": "x"})
    assert settings == {"tp_size": 2, "cache": "naive", "kv_memory_fraction": 0.5}
    with pytest.raises(ValueError, match="page_size"):
        engine_settings({"page_size": "sixteen"})
    assert engine_settings({"load_format": ""}) == {}  # LLM's default: "auto"
    assert engine_settings({"load_format": " dummy ", "overlap": "false",
                            "fused_gemv_max_bs": "8"}) == {
        "load_format": "dummy", "overlap": False, "fused_gemv_max_bs": 8}
    repo = tmp_path / "model_repository" / "minisgl"
    assert resolve_model_dir({}, str(repo)) == tmp_path / "models/SmolLM2-135M-Instruct"
    assert resolve_model_dir({"model": "/abs/m"}, str(repo)).as_posix() == "/abs/m"
    assert resolve_model_dir({"model": "rel/m"}, str(repo)) == tmp_path / "rel/m"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from minisgl_backend.testing.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def text_request(tokenizer, **inputs: object):  # noqa: ANN001, ANN201
    base = {"max_tokens": [[8]]}
    return parse_engine_request(getter(**{**base, **inputs}), 100, tokenizer)


def test_text_input_is_tokenized_like_preprocessing(tokenizer) -> None:  # noqa: ANN001
    from minisgl_backend.tokenizer import encode_chat, encode_prompt

    text = "def add(a, b):"
    req = text_request(tokenizer, text_input=np.array([[text.encode()]], dtype=object))
    assert req.prompt_ids == encode_prompt(tokenizer, text)
    chat = text_request(tokenizer, text_input=np.array([[text.encode()]], dtype=object),
                        apply_chat_template=np.array([[True]]))
    assert chat.prompt_ids == encode_chat(tokenizer, [{"role": "user", "content": text}])


@pytest.mark.parametrize(("inputs", "field"), [
    ({}, "text_input"),
    ({"text_input": np.array([[b"  "]], dtype=object)}, "text_input"),
    ({"text_input": np.array([[b"\xc3\x28"]], dtype=object)}, "text_input"),
    ({"text_input": np.array([[b"a", b"b"]], dtype=object)}, "text_input"),
    ({"text_input": np.array([[b"hi"]], dtype=object), "input_ids": [[1, 2]]}, "input_ids"),
])
def test_bad_text_input_names_the_field(tokenizer, inputs: dict, field: str) -> None:  # noqa: ANN001
    with pytest.raises(RequestError, match=field):
        text_request(tokenizer, **inputs)


@pytest.mark.parametrize(("limits", "inputs", "field"), [
    ({"max_input_bytes": 10}, {"text_input": np.array([[b"x" * 11]], dtype=object)},
     "text_input"),
    ({"max_prompt_tokens": 2}, {"text_input": np.array([[b"def add(a, b):"]], dtype=object)},
     "text_input"),
    ({"max_output_tokens": 4}, {"text_input": np.array([[b"hi"]], dtype=object)}, "max_tokens"),
    ({"max_stop_words": 1}, {"text_input": np.array([[b"hi"]], dtype=object),
                             "stop_words": np.array([[b"a", b"b"]], dtype=object)}, "stop_words"),
    ({"max_stop_word_length": 3}, {"text_input": np.array([[b"hi"]], dtype=object),
                                   "stop_words": np.array([[b"abcd"]], dtype=object)},
     "stop_words"),
])
def test_request_policy_name_the_field(tokenizer, limits: dict, inputs: dict,  # noqa: ANN001
                                       field: str) -> None:
    from minisgl_backend.serving.request import RequestPolicy

    getter_inputs = {"max_tokens": [[8]], **inputs}
    with pytest.raises(RequestError, match=field):
        parse_engine_request(getter(**getter_inputs), 100, tokenizer, RequestPolicy(**limits))
    # the same request passes without the limit
    parse_engine_request(getter(**getter_inputs), 100, tokenizer)


def test_request_policy_from_parameters() -> None:
    from minisgl_backend.serving.settings import request_policy

    limits = request_policy({"max_stop_words": "4", "max_prompt_tokens": "", "model": "x"})
    assert limits.max_stop_words == 4 and limits.max_prompt_tokens == 0
    with pytest.raises(ValueError, match="max_output_tokens"):
        request_policy({"max_output_tokens": "-1"})
    policy = request_policy({"exclude_input_in_output": "true", "max_logits_values": "10"})
    assert policy.exclude_input_in_output and policy.max_logits_values == 10
    with pytest.raises(ValueError, match="exclude_input_in_output"):
        request_policy({"exclude_input_in_output": "maybe"})


def test_exclude_input_in_output_defaults_to_the_model_parameter() -> None:
    from minisgl_backend.serving.request import RequestPolicy

    base = {"input_ids": [[5, 6]], "max_tokens": [[4]]}
    excluding = RequestPolicy(exclude_input_in_output=True)
    assert parse_engine_request(getter(**base), 10, limits=excluding).exclude_input
    assert not parse_engine_request(getter(**base), 10).exclude_input
    asked = getter(**base, exclude_input_in_output=np.array([[False]]))
    assert not parse_engine_request(asked, 10, limits=excluding).exclude_input


def words(*items: str) -> np.ndarray:
    return np.array([[w.encode() for w in items]], dtype=object)


def test_bad_words_and_embedding_bias_are_tokenized_as_tensorrt_llm_does(tokenizer) -> None:  # noqa: ANN001
    """Bad words: each as written, without special tokens, empty ones skipped. Embedding bias:
    each word with special tokens, every one of its tokens gets the word's weight (summed)."""
    req = parse_engine_request(getter(
        input_ids=[[5, 6]], max_tokens=[[4]], bad_words=words(" Paris", "", "New York"),
        embedding_bias_words=words(" the", " the cat"),
        embedding_bias_weights=np.array([[1.5, -4.0]], np.float32)), 10, tokenizer)
    encode = lambda w: tokenizer.encode(w, add_special_tokens=False)  # noqa: E731
    assert req.params.bad_token_ids == tuple(tuple(encode(w)) for w in (" Paris", "New York"))
    the, = tokenizer.encode(" the")
    bias = {t: -4.0 for t in tokenizer.encode(" the cat")}
    bias[the] += 1.5
    assert dict(req.params.logit_bias) == pytest.approx(bias)


@pytest.mark.parametrize(("inputs", "field"), [
    ({"embedding_bias_words": words("a", "b"),
      "embedding_bias_weights": np.array([[1.0]], np.float32)}, "embedding_bias_weights"),
    ({"embedding_bias_words": words("a"),
      "embedding_bias_weights": np.array([[101.0]], np.float32)}, "embedding_bias_weights"),
    ({"embedding_bias_words": words("a"),
      "embedding_bias_weights": np.array([[np.inf]], np.float32)}, "embedding_bias_weights"),
    ({"bad_words": np.array([[1]], np.int32)}, "bad_words"),
    ({"bad_words": words(*"abcdefghijklmnopqrstuvwxyz0123456789")}, "bad_words"),
    ({"lora_weights": np.zeros((1, 2, 4), np.float16)}, "lora_weights"),
    ({"lora_name": np.array([[b"a"]], object), "lora_task_id": np.array([[3]], np.uint64)},
     "lora_name and lora_task_id"),
    ({"prompt_embedding_table": np.zeros((1, 2, 4), np.float16)}, "prompt_embedding_table"),
    ({"guided_decoding_guide_type": words("yaml")}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": words("regex")}, "guided_decoding_guide"),
    ({"guided_decoding_guide": words("[0-9]+")}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": words("json_schema"),
      "guided_decoding_guide": words("{not json")}, "guided_decoding_guide"),
    ({"num_draft_tokens": np.array([[2]], np.int32)}, "num_draft_tokens"),
    ({"return_context_logits": np.array([[True]]), "input_ids": [list(range(11))]},
     "return_context_logits"),
    ({"return_generation_logits": np.array([[True]]), "max_tokens": [[11]]},
     "return_generation_logits"),
])
def test_bad_word_and_feature_inputs_name_the_input(tokenizer, inputs: dict,  # noqa: ANN001
                                                    field: str) -> None:
    from minisgl_backend.serving.request import RequestPolicy

    base = {"input_ids": [[5, 6]], "max_tokens": [[4]]}
    policy = RequestPolicy(max_logits_values=10 * 49152)  # logits of 10 tokens
    with pytest.raises(RequestError, match=field):
        parse_engine_request(getter(**{**base, **inputs}), 100, tokenizer, policy, 49152)


def test_end_id_takes_the_place_of_eos() -> None:
    p = parse(end_id=np.array([[9]], np.int32)).params
    assert p.stop_token_ids == (9,) and p.ignore_eos
    p = parse(end_id=np.array([[-1]], np.int32)).params
    assert not p.stop_token_ids and not p.ignore_eos


def test_a_failing_chat_template_names_text_input() -> None:
    class Broken:
        def apply_chat_template(self, *args: object, **kwargs: object) -> str:
            raise RuntimeError("Conversation roles must alternate")

    get = getter(text_input=words("hi"), apply_chat_template=np.array([[True]]),
                 max_tokens=[[4]])
    with pytest.raises(RequestError, match="text_input.*alternate"):
        parse_engine_request(get, 10, Broken())


def test_tensorrt_llm_inputs_are_declared_with_its_types() -> None:
    from minisgl_backend.serving.interface import inputs_of, refused_inputs

    declared = {i.name: (i.data_type, i.dims) for i in inputs_of("ensemble")}
    assert declared["lora_task_id"] == ("TYPE_UINT64", (1,))
    assert declared["lora_weights"] == ("TYPE_FP16", (-1, -1))
    assert declared["lora_config"] == ("TYPE_INT32", (-1, 3))
    assert {i.name for i in refused_inputs()} >= {
        "prompt_embedding_table", "prompt_vocab_size", "decoder_text_input"}


def test_unknown_request_parameters_are_refused_by_name() -> None:
    """Over HTTP a key that is no input becomes a request parameter: refused, with a hint;
    Triton's own parameters pass."""
    from minisgl_backend.serving.request import check_parameters

    check_parameters('{"priority": 1, "timeout": 100, "triton_enable_empty_final_response": true}')
    check_parameters("")
    with pytest.raises(RequestError, match=r"temprature \(did you mean temperature\?\)"):
        check_parameters('{"temprature": 0.5}')
    with pytest.raises(RequestError, match="guided_json"):
        parse_engine_request(getter(input_ids=[[1]], max_tokens=[[2]]), 10,
                             parameters='{"guided_json": "{}"}')


@pytest.mark.parametrize(("kind", "guide", "field"), [
    ("json", None, "json_object"), ("json_schema", '{"type": "array"}', "json_schema"),
    ("regex", "[a-z]+", "regex"), ("ebnf_grammar", 'root ::= "yes" | "no"', "grammar"),
])
def test_guided_decoding_inputs_feed_the_guide(kind: str, guide: str | None, field: str) -> None:
    inputs = {"guided_decoding_guide_type": words(kind)}
    if guide is not None:
        inputs["guided_decoding_guide"] = words(guide)
    req = parse(**inputs)
    assert getattr(req.params, field) == (True if guide is None else guide)
    assert req.name_inputs(f"{field} does not compile").startswith(
        "guided_decoding_guide_type" if guide is None else "guided_decoding_guide")


def test_top_log_probs_and_token_logit_bias_reach_the_params() -> None:
    req = parse(return_log_probs=np.array([[True]]),
                num_top_log_probs=np.array([[3]], np.int32),
                logit_bias_token_ids=np.array([[7, 9]], np.int32),
                logit_bias_values=np.array([[-100.0, 2.5]], np.float32))
    assert req.params.logprobs == 3
    assert req.params.logit_bias == {7: -100.0, 9: 2.5}
    assert parse(return_log_probs=np.array([[True]])).params.logprobs == 0


@pytest.mark.parametrize("inputs, field", [
    ({"num_top_log_probs": np.array([[2]], np.int32)}, "num_top_log_probs needs"),
    ({"return_log_probs": np.array([[True]]), "num_top_log_probs": np.array([[21]], np.int32)},
     "num_top_log_probs must be"),
    ({"logit_bias_token_ids": np.array([[1, 2]], np.int32),
      "logit_bias_values": np.array([[1.0]], np.float32)}, "logit_bias_values must have"),
    ({"logit_bias_token_ids": np.array([[1]], np.int32),
      "logit_bias_values": np.array([[101.0]], np.float32)}, "logit_bias_values must be"),
])
def test_top_log_probs_and_logit_bias_errors_name_the_input(inputs: dict, field: str) -> None:
    with pytest.raises(RequestError, match=field):
        parse(**inputs)

