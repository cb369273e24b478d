"""The speculative-decoding settings, declared once: `LLM` keywords and `config.pbtxt`
parameters of the same names, validated here (`fields.validate`), listed in the README."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl_backend.fields import spec_field, validate

METHODS = ("ngram", "suffix")
GPU_MIN_ACCEPTANCE, CPU_MIN_ACCEPTANCE = 0.1, 0.4  # speculative_min_acceptance's defaults


def _method(value: object) -> str | None:
    if value in (None, "", "none"):
        return None
    if value not in METHODS:
        raise ValueError(value)
    return str(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How decode steps draft and verify tokens (no draft model: the drafts come from the
    request's own tokens, `ngram`, or from those and recent requests' outputs, `suffix`)."""

    speculative: str | None = spec_field(
        None, "custom", "draft-free speculative decoding: None (off), `ngram` or `suffix`",
        normalize=_method, accepts="None, 'ngram' or 'suffix'")
    num_speculative_tokens: int = spec_field(
        4, "int", "draft tokens verified per decode row and step at most", low=1, high=16)
    speculative_max_batch_size: int = spec_field(
        32, "int", "decode steps with more rows than this do not speculate (large batches "
        "have no compute to spare)", low=1)
    speculative_min_acceptance: float | None = spec_field(
        None, "float", "a draft token is sent only while its chance of being kept (the "
        "request's acceptance rate to the power of its place among the drafts) reaches this; "
        "a rate below it stops the request's speculation (the rate: kept drafts over those "
        "that met a verdict, the kept ones and each step's first rejected one, as if 2 more "
        "had been kept). None: 0.1 on a GPU, where a verify step's extra tokens cost little "
        "at the batch sizes that speculate, 0.4 on CPU, where each costs about a decode step",
        low=0.0, high=1.0, nullable=True)
    speculative_ngram_max: int = spec_field(
        4, "int", "`ngram`: longest suffix of the request's tokens matched", low=1, high=32)
    speculative_ngram_min: int = spec_field(
        2, "int", "`ngram`: shortest suffix matched (single tokens recur too often to predict "
        "much)", low=1, high="speculative_ngram_max")
    speculative_suffix_tokens: int = spec_field(
        1 << 16, "int", "`suffix`: tokens of ended requests kept to draft from (memory: at "
        "most about 1.2 KB per token)", low=0)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def enabled(self) -> bool:
        return self.speculative is not None

    def min_acceptance(self, device_type: str) -> float:
        """`speculative_min_acceptance`, or its default for the engine's device type."""
        if self.speculative_min_acceptance is not None:
            return self.speculative_min_acceptance
        return GPU_MIN_ACCEPTANCE if device_type == "cuda" else CPU_MIN_ACCEPTANCE
