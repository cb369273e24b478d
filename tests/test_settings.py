"""Engine settings are declared once (`minisgl_backend.settings`): LLM's keywords, the Triton
parameters, config.pbtxt and the README table follow from the declaration."""

from __future__ import annotations

import pytest

from minisgl_backend.serving.settings import engine_settings, triton_parameters
from minisgl_backend.settings import (
    EngineHooks,
    EngineSettings,
    setting_specs,
    shipped_text,
    split_settings,
)


@pytest.mark.parametrize("name", list(setting_specs()))
def test_every_setting_rejects_a_wrong_type_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name} must be "):
        split_settings({name: object()})


@pytest.mark.parametrize("name", list(setting_specs()))
def test_every_setting_takes_its_default_back(name: str) -> None:
    spec, default = setting_specs()[name]
    general, speculative = split_settings({name: default})
    assert getattr(general if hasattr(general, name) else speculative, name) == default


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(ValueError, match="'mixed_prefill'"):
        split_settings({"mixed_prefill": True})


def test_settings_in_text_parse_as_declared() -> None:
    assert engine_settings({"attention_backend": "flashinfer,triton", "max_total_tokens": "64",
                            "speculative": "suffix", "dtype": "bfloat16"}) == {
        "attention_backend": "flashinfer,triton", "max_total_tokens": 64,
        "speculative": "suffix", "dtype": "bfloat16"}
    for text in ("flashinfer,triton,torch", "cuda"):
        with pytest.raises(ValueError, match="attention_backend"):
            engine_settings({"attention_backend": text})


def test_cross_setting_rules_name_the_setting() -> None:
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineSettings(page_size=16, max_total_tokens=8)


def test_hooks_are_not_settings() -> None:
    assert not set(vars(EngineHooks())) & set(triton_parameters())
    with pytest.raises(ValueError, match="unknown setting 'debug_checks'"):
        split_settings({"debug_checks": True})


def test_only_the_shipped_exceptions_differ_from_the_defaults_in_config_pbtxt() -> None:
    shipped = {name: shipped_text(spec) for name, (spec, _) in triton_parameters().items()
               if shipped_text(spec)}
    assert shipped == {"exclude_input_in_output": "true"}
