"""The Triton request surface, declared once: every input and output of the `ensemble`,
`preprocessing` and `minisgl` models with its data type, dims and meaning, and for sampling
inputs the `SamplingParams` field it feeds.

`scripts/gen_configs.py` writes the three `config.pbtxt` files' input, output and ensemble
sections from these lists (a test fails when they drift), and `serving/request.py` reads the
sampling inputs by walking `INPUTS`. Names, types and semantics follow the TensorRT-LLM
ensemble convention (both of its generations: `seed` / `random_seed`, `min_tokens` /
`min_length`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Model = Literal["ensemble", "preprocessing", "minisgl"]
_CLIENT: tuple[Model, ...] = ("ensemble", "minisgl")  # inputs a client sends either model
_KINDS = {"TYPE_FP32": "float", "TYPE_FP16": "float", "TYPE_INT32": "int", "TYPE_INT64": "int",
          "TYPE_UINT64": "int", "TYPE_BOOL": "bool", "TYPE_STRING": "text"}


@dataclass(frozen=True)
class TritonInput:
    """One request input. `feeds`: the `SamplingParams` field set from its value (after
    `convert`, TensorRT-LLM's conventions such as 0 meaning "off"; it raises ValueError naming
    the input), None when the parser reads it itself; `models`: which models declare it;
    `refused`: why a request that gives it is refused (a feature we do not have: the
    input is declared so that the error names it, never Triton's "unexpected input").

    Every input is declared optional, `text_input` and `max_tokens` too (the models check
    them): Triton 2.51 checks only the number of inputs of an ensemble, and one missing a
    required input ends with an empty final response instead of an error."""

    name: str
    data_type: str
    doc: str
    dims: tuple[int, ...] = (1,)
    feeds: str | None = None
    convert: Callable[[object], object] | None = None
    models: tuple[Model, ...] = _CLIENT
    refused: str | None = None

    @property
    def kind(self) -> str:
        """How the parser reads it: "int", "float", "bool" or "text"."""
        return _KINDS[self.data_type]


@dataclass(frozen=True)
class TritonOutput:
    name: str
    data_type: str
    doc: str
    dims: tuple[int, ...] = (1,)


def _off_if_zero(name: str, off: object) -> Callable[[object], object]:
    """TensorRT-LLM: 0 disables top_k / top_p; negative values raise ValueError."""

    def convert(value: object) -> object:
        if value == 0:
            return off
        if not value > 0:  # type: ignore[operator]
            raise ValueError(f"{name} must be >= 0 (0: off), got {value}")
        return value

    return convert


_BOTH: tuple[Model, ...] = ("ensemble", "preprocessing", "minisgl")

INPUTS: tuple[TritonInput, ...] = (
    TritonInput("input_ids", "TYPE_INT32", "prompt token ids (from preprocessing)", dims=(-1,),
                models=("minisgl",)),
    TritonInput("text_input", "TYPE_STRING", "the prompt; with `apply_chat_template`, the user "
                "message or a JSON list of `{\"role\", \"content\"}` messages", models=_BOTH),
    TritonInput("apply_chat_template", "TYPE_BOOL", "render `text_input` with the model's chat "
                "template", models=_BOTH),
    TritonInput("max_tokens", "TYPE_INT32", "tokens to generate (required)", feeds="max_tokens",
                models=_BOTH),
    TritonInput("stream", "TYPE_BOOL", "true: one response per new piece of text (deltas), the "
                "last one FINAL; false: one response"),
    TritonInput("temperature", "TYPE_FP32", "0: greedy", feeds="temperature"),
    TritonInput("top_k", "TYPE_INT32", "sample among the k most likely tokens (0: off)",
                feeds="top_k", convert=_off_if_zero("top_k", -1)),
    TritonInput("top_p", "TYPE_FP32", "nucleus sampling (0: off)", feeds="top_p",
                convert=_off_if_zero("top_p", 1.0)),
    TritonInput("min_p", "TYPE_FP32", "drop tokens less likely than min_p times the most "
                "likely one", feeds="min_p"),
    TritonInput("seed", "TYPE_UINT64", "makes sampling reproducible", feeds="seed"),
    TritonInput("random_seed", "TYPE_UINT64", "`seed`'s older name", feeds="seed"),
    TritonInput("repetition_penalty", "TYPE_FP32", "HF's multiplicative penalty over prompt and "
                "output tokens (1: off)", feeds="repetition_penalty"),
    TritonInput("presence_penalty", "TYPE_FP32", "OpenAI's, over output tokens",
                feeds="presence_penalty"),
    TritonInput("frequency_penalty", "TYPE_FP32", "OpenAI's, over output tokens",
                feeds="frequency_penalty"),
    TritonInput("stop_words", "TYPE_STRING", "stop strings (the text is cut before them; empty "
                "strings: none)", dims=(-1,)),
    TritonInput("bad_words", "TYPE_STRING", "words never generated: each is tokenized as "
                "written (no special tokens) and its last token is banned after the others "
                "(empty strings: none)", dims=(-1,)),
    TritonInput("embedding_bias_words", "TYPE_STRING", "words whose tokens get a logit bias "
                "(each tokenized with special tokens, as TensorRT-LLM does)", dims=(-1,)),
    TritonInput("embedding_bias_weights", "TYPE_FP32", "one bias per `embedding_bias_words` "
                "entry, added to each of its tokens' logits (sums in [-100, 100])", dims=(-1,)),
    TritonInput("logit_bias_token_ids", "TYPE_INT32", "token ids whose logits get "
                "`logit_bias_values` (OpenAI's `logit_bias`; added to the embedding bias)",
                dims=(-1,)),
    TritonInput("logit_bias_values", "TYPE_FP32", "one value per `logit_bias_token_ids` "
                "entry, added to its logit", dims=(-1,)),
    TritonInput("end_id", "TYPE_INT32", "the token id that ends generation, in place of the "
                "model's EOS (-1: the model's)"),
    TritonInput("pad_id", "TYPE_INT32", "accepted for compatibility: responses carry no "
                "padding"),
    TritonInput("ignore_eos", "TYPE_BOOL", "keep generating after EOS", feeds="ignore_eos"),
    TritonInput("min_tokens", "TYPE_INT32", "EOS and stop ids cannot end generation before this "
                "many tokens", feeds="min_tokens"),
    TritonInput("min_length", "TYPE_INT32", "`min_tokens`' older name", feeds="min_tokens"),
    TritonInput("beam_width", "TYPE_INT32", "1 (no beam search; other values are refused)"),
    TritonInput("length_penalty", "TYPE_FP32", "accepted for compatibility: it only affects "
                "beam search"),
    TritonInput("num_return_sequences", "TYPE_INT32", "sequences sampled from the prompt (each "
                "response carries its `sequence_index`; one FINAL per request)", feeds="n"),
    TritonInput("return_log_probs", "TYPE_BOOL", "add `output_log_probs` (each token's "
                "log-probability under the model) and `cum_log_probs`"),
    TritonInput("num_top_log_probs", "TYPE_INT32", "with `return_log_probs`: also this many "
                "most likely tokens at each generated token, in `output_top_log_prob_ids` and "
                "`output_top_log_probs`"),
    TritonInput("exclude_input_in_output", "TYPE_BOOL", "non-streaming only: leave the prompt "
                "out of `text_output` (streaming never repeats it); unset: the model's "
                "`exclude_input_in_output` parameter (true as shipped)"),
    TritonInput("guided_decoding_guide_type", "TYPE_STRING", "structured output, as "
                "TensorRT-LLM names it: `json` (any JSON object), `json_schema`, `regex` or "
                "`ebnf_grammar` (xgrammar's EBNF)"),
    TritonInput("guided_decoding_guide", "TYPE_STRING", "the schema, regex or grammar "
                "(not for `json`)"),
    TritonInput("return_context_logits", "TYPE_BOOL", "add `context_logits` (the prompt's "
                "logits; the prompt is then computed in full, without the prefix cache)",
                feeds="return_context_logits"),
    TritonInput("return_generation_logits", "TYPE_BOOL", "add `generation_logits` (each "
                "generated token's raw logits)", feeds="return_generation_logits"),
    TritonInput("return_perf_metrics", "TYPE_BOOL", "add the request's KV-cache and timing "
                "outputs (`kv_cache_*`, `*_time_ns`, draft-token counts)"),
    TritonInput("return_num_input_tokens", "TYPE_BOOL", "add `num_input_tokens`"),
    TritonInput("return_num_output_tokens", "TYPE_BOOL", "add `num_output_tokens`"),
    TritonInput("return_finish_reason", "TYPE_BOOL", "add `finish_reason`"),
    TritonInput("return_cached_tokens", "TYPE_BOOL", "add `cached_tokens`"),
    TritonInput("lora_name", "TYPE_STRING", "the LoRA adapter to generate with: a name of the "
                "`lora_adapters` parameter (vllm_backend's input; unset: the base model)"),
    TritonInput("lora_task_id", "TYPE_UINT64", "TensorRT-LLM's LoRA task: its first request "
                "brings `lora_weights` and `lora_config`, later ones the id alone "
                "(`enable_lora` or `lora_adapters` must be set)"),
    TritonInput("lora_weights", "TYPE_FP16", "the task's adapter in TensorRT-LLM's layout: per "
                "module and layer, A then B (scaled), `[rows, size]`", dims=(-1, -1)),
    TritonInput("lora_config", "TYPE_INT32", "per row of `lora_weights`: module id, layer, "
                "adapter size", dims=(-1, 3)),
    # TensorRT-LLM inputs of features this engine does not have.
    *(TritonInput(name, data_type, "refused: " + why, dims=dims, refused=why)
      for name, data_type, dims, why in (
          ("decoder_text_input", "TYPE_STRING", (1,), "encoder-decoder models are not supported"),
          ("prompt_embedding_table", "TYPE_FP16", (-1, -1), "prompt tables are not supported"),
          ("prompt_table_extra_id", "TYPE_UINT64", (1,), "prompt tables are not supported"),
          ("prompt_vocab_size", "TYPE_INT32", (1,), "prompt tables are not supported"),
          ("num_draft_tokens", "TYPE_INT32", (1,), "draft-model speculative decoding is not "
           "supported"),
          ("use_draft_logits", "TYPE_BOOL", (1,), "draft-model speculative decoding is not "
           "supported"),
      )),
)

# `return_perf_metrics` outputs, TensorRT-LLM's (last response); the draft-token ones are 0
# until speculative decoding exists.
PERF_METRICS: tuple[tuple[str, str, str], ...] = (
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", "KV pages allocated for the request"),
    ("kv_cache_reused_blocks", "TYPE_INT32", "KV pages reused from the prefix cache"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", "the two together"),
    ("arrival_time_ns", "TYPE_INT64", "when the request reached the engine model (Unix ns)"),
    ("first_scheduled_time_ns", "TYPE_INT64", "when the scheduler admitted it"),
    ("first_token_time_ns", "TYPE_INT64", "when its first token was sampled"),
    ("last_token_time_ns", "TYPE_INT64", "when its last token was sampled"),
    ("acceptance_rate", "TYPE_FP32", "accepted / proposed draft tokens"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "draft tokens accepted"),
    ("total_draft_tokens", "TYPE_INT32", "draft tokens proposed"),
)

OUTPUTS: tuple[TritonOutput, ...] = (
    TritonOutput("text_output", "TYPE_STRING", "the text (streaming: a delta)", dims=(-1,)),
    TritonOutput("output_ids", "TYPE_INT32", "the generated token ids (EOS included when it "
                 "ends generation)", dims=(-1,)),
    TritonOutput("num_input_tokens", "TYPE_INT32", "prompt tokens"),
    TritonOutput("num_output_tokens", "TYPE_INT32", "tokens in this response (streaming: "
                 "they add up to the sequence's)"),
    TritonOutput("cached_tokens", "TYPE_INT32", "prompt tokens served from the prefix cache"),
    TritonOutput("finish_reason", "TYPE_STRING", "`stop` or `length` (last response)"),
    TritonOutput("sequence_index", "TYPE_INT32", "which of `num_return_sequences` the response "
                 "belongs to (when more than one)"),
    TritonOutput("output_log_probs", "TYPE_FP32", "log-probabilities of the response's tokens "
                 "([1, tokens])", dims=(-1, -1)),
    TritonOutput("cum_log_probs", "TYPE_FP32", "their running sum over the sequence",
                 dims=(-1,)),
    TritonOutput("output_top_log_prob_ids", "TYPE_INT32", "with `num_top_log_probs`: the most "
                 "likely tokens at each of the response's tokens ([1, tokens, k])",
                 dims=(-1, -1, -1)),
    TritonOutput("output_top_log_probs", "TYPE_FP32", "their log-probabilities ([1, tokens, "
                 "k])", dims=(-1, -1, -1)),
    TritonOutput("batch_index", "TYPE_INT32", "the request's item (always 0: one prompt per "
                 "request; sent with `sequence_index`)"),
    TritonOutput("context_logits", "TYPE_FP32", "the prompt's logits, [prompt tokens, "
                 "vocabulary] (first response)", dims=(-1, -1)),
    TritonOutput("generation_logits", "TYPE_FP32", "the response's tokens' raw logits, "
                 "[1, tokens, vocabulary]", dims=(-1, -1, -1)),
    *(TritonOutput(name, data_type, doc) for name, data_type, doc in PERF_METRICS),
)

# preprocessing's output, mapped to minisgl's `input_ids` inside the ensemble.
PREPROCESSING_OUTPUTS = (TritonOutput("input_ids", "TYPE_INT32", "prompt token ids", dims=(-1,)),)


# Request parameters Triton itself defines or adds (HTTP keys that are no input arrive as
# request parameters): any other parameter is refused by name, so that a misspelled or
# unsupported control is never silently ignored.
TRITON_REQUEST_PARAMETERS = frozenset({
    "priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
    "triton_enable_empty_final_response", "binary_data_output", "binary_data",
    "binary_data_size", "classification",
})


def inputs_of(model: Model) -> list[TritonInput]:
    return [i for i in INPUTS if model in i.models]


def refused_inputs() -> list[TritonInput]:
    return [i for i in INPUTS if i.refused is not None]


def sampling_inputs() -> list[TritonInput]:
    """The inputs that feed a `SamplingParams` field directly, in declaration order."""
    return [i for i in INPUTS if i.feeds is not None]
