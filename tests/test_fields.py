"""Request fields are declared once (`minisgl_backend.fields`): validation, the engine's per-row
controls and the README table all follow from the declarations."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from minisgl_backend.core import RowSampling, SamplingParams, sample_seed
from minisgl_backend.engine.protocol import StepMessage
from minisgl_backend.fields import specs_of
from tests.conftest import REPO_ROOT


def test_readme_tables_are_generated_from_the_declarations() -> None:
    result = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", list(specs_of(SamplingParams)))
def test_every_field_rejects_a_wrong_type_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        SamplingParams(**{name: object()})


@pytest.mark.parametrize(("name", "value"), [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01), ("min_p", 1.5), ("min_p", -0.1), ("logit_bias", {1: 200}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [1, 2]),
    ("bad_words", [""]), ("bad_words", "word"), ("bad_token_ids", [[]]),
    ("bad_token_ids", [[1, -2]]), ("bad_token_ids", [1, 2]), ("logprobs", 21),
    ("logprobs", -1), ("n", 0), ("n", 65), ("n", True),
])
def test_invalid_control_values_name_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        SamplingParams(**{name: value})


def test_defaults_and_normalized_values() -> None:
    p = SamplingParams(bad_words=["a"], bad_token_ids=[[1, 2]], logit_bias={3: 1})
    assert p.bad_words == ("a",) and p.bad_token_ids == ((1, 2),)
    assert p.logit_bias == {3: 1.0} and isinstance(p.logit_bias[3], float)
    plain = SamplingParams()
    assert not plain.uses_penalties and plain.n == 1 and plain.logprobs is None
    assert plain.logit_bias == {} and plain.bad_token_ids == ()


def test_row_sampling_covers_every_per_row_control_and_travels_in_the_step_message() -> None:
    params = SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.2, logprobs=3)
    rows = RowSampling.of([(params, 9), (SamplingParams(), 1),
                           (SamplingParams(temperature=1e-7), 1)], vocab_size=100)
    per_row = {name for name, (spec, _) in specs_of(SamplingParams).items() if spec.row_dtype}
    assert per_row | {"seed"} < {f.name for f in dataclasses.fields(RowSampling)}
    assert rows.logprobs[0] == 3 and rows.seed[0] == 9 and rows.min_p[0] == 0.1
    assert rows.logprobs[1] == -1  # None travels as -1
    assert rows.temperature[2] == 0.0 and rows.greedy == [False, True, True]  # greedy
    assert rows.uses_penalties == rows.uses_min_p == rows.reports == [True, False, False]
    msg = StepMessage(is_prefill=False, rows=[0], admit_rows=[0, 1, 2], admit=rows)
    decoded = StepMessage.from_bytes(msg.to_bytes()).admit
    assert decoded is not None
    assert decoded.repetition_penalty.tolist() == [pytest.approx(1.2), 1.0, 1.0]
    assert decoded.greedy.tolist() == [False, True, True]


def test_sample_seeds_are_distinct_64_bit_and_sample_0_keeps_the_seed() -> None:
    for seed in (0, 1, 2**63, 2**64 - 1):
        seeds = [sample_seed(seed, i) for i in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64
        assert all(0 <= s < 2**64 for s in seeds)
