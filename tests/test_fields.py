"""Request fields are declared once (`minisgl_backend.fields`): validation, the engine's per-row
controls and the README table all follow from the declarations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minisgl_backend.core import ROW_CONTROLS, ROW_DTYPES, SamplingParams, sample_seed
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


def test_row_values_cover_every_per_row_control_and_travel_in_the_step_message() -> None:
    params = SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.2, logprobs=3)
    values = params.row_values(seed=9)
    assert set(values) == set(ROW_DTYPES) == set(ROW_CONTROLS) | {"seed"}
    assert values["logprobs"] == 3 and values["seed"] == 9 and values["min_p"] == 0.1
    assert SamplingParams().row_values(1)["logprobs"] == -1  # None travels as -1
    assert SamplingParams(temperature=1e-7).row_values(1)["temperature"] == 0.0  # greedy
    msg = StepMessage(is_prefill=False, rows=[0], admit_rows=[0],
                      admit={k: [v] for k, v in values.items()})
    decoded = StepMessage.from_bytes(msg.to_bytes())
    assert set(decoded.admit) == set(ROW_DTYPES)
    assert decoded.admit["repetition_penalty"].tolist() == [pytest.approx(1.2)]


def test_sample_seeds_are_distinct_64_bit_and_sample_0_keeps_the_seed() -> None:
    for seed in (0, 1, 2**63, 2**64 - 1):
        seeds = [sample_seed(seed, i) for i in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64
        assert all(0 <= s < 2**64 for s in seeds)
