"""The offline API's contract: sampling, stopping, validation, failures and clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.tokenizer import encode_prompt
from tests.conftest import CHECKED, mixed_prompts


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):  # noqa: ANN201
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED) as engine:
        yield engine


def test_same_seed_same_output_whatever_the_batch(llm: LLM) -> None:
    prompts = mixed_prompts(6)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234,
                             ignore_eos=True)
    alone = llm.generate(prompts[:1], sampled)[0].token_ids
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    mixed = llm.generate(prompts, [sampled] + [greedy] * 5)[0].token_ids
    other_seed = llm.generate(prompts[:1], SamplingParams(
        max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True))[0]
    assert alone == mixed
    assert other_seed.token_ids != alone


def test_greedy_rows_unaffected_by_sampled_rows(llm: LLM) -> None:
    prompts = mixed_prompts(4)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.5, seed=5, ignore_eos=True)
    all_greedy = llm.generate(prompts, greedy)
    mixed = llm.generate(prompts, [greedy, sampled, greedy, sampled])
    assert mixed[0].token_ids == all_greedy[0].token_ids
    assert mixed[2].token_ids == all_greedy[2].token_ids


def test_stop_token_ids_end_the_request(llm: LLM) -> None:
    prompt = mixed_prompts(1)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=3)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    stop = free.text[6:9]
    assert len(stop) == 3
    out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text
    assert free.token_ids[: len(out.token_ids)] == out.token_ids


def test_text_prompts_and_single_prompt(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    by_text = llm.generate("hello world", params)
    ids = encode_prompt(llm.tokenizer, "hello world")
    by_ids = llm.generate(ids, params)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].token_ids == by_ids[0].token_ids
    assert by_text[0].prompt_tokens == len(ids)


def test_per_prompt_sampling_params_and_order(llm: LLM) -> None:
    prompts = mixed_prompts(3)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)
                                  for n in (3, 7, 1)])
    assert [len(o.token_ids) for o in outs] == [3, 7, 1]
    assert [o.prompt_tokens for o in outs] == [len(p) for p in prompts]


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", -0.1),
    ("temperature", float("nan")), ("top_k", 0), ("top_k", -2), ("top_p", 0.0),
    ("top_p", 1.5), ("seed", -1), ("seed", 2**64), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
])
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_requests_raise_and_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10**7))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams()])
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside"):
        llm.generate([[5, 6], [7, -1]], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside"):
        llm.generate([[10**6]], SamplingParams(max_tokens=3))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_unknown_architecture_names_it(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(tmp_path, device="cpu")


@pytest.mark.parametrize(("setting", "value"), [
    ("tp_size", 0), ("page_size", 0), ("cache", "lru"), ("device", "tpu"),
    ("max_running_requests", 0), ("max_total_tokens", 0), ("cuda_graph_max_bs", -1),
    ("fused_gemv_max_bs", 17), ("fused_gemv_max_bs", -1), ("fused_gemv_max_bs", 2.0),
])
def test_invalid_engine_settings_name_the_setting(tiny_models: dict[str, Path], setting: str,
                                                  value: object) -> None:
    settings = {"device": "cpu", setting: value}
    with pytest.raises(ValueError, match=setting):
        LLM(tiny_models["llama"], **settings)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_engine_fails_requests_instead_of_hanging(tiny_models: dict[str, Path]) -> None:
    llm = LLM(tiny_models["llama"], device="cpu", tp_size=2)
    pids = llm.scheduler.engine.pids
    killer = threading.Timer(1.0, os.kill, args=(pids[1], signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="engine"):
        llm.generate(mixed_prompts(8), SamplingParams(max_tokens=1500, ignore_eos=True))
    assert time.monotonic() - started < 30
    with pytest.raises(RuntimeError, match="engine"):  # later requests fail at once too
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    llm.shutdown()
    assert not any(_alive(pid) for pid in pids)


def test_shutdown_leaves_no_process_or_files(tiny_models: dict[str, Path]) -> None:
    with LLM(tiny_models["qwen3"], device="cpu", tp_size=2) as llm:
        pids = llm.scheduler.engine.pids
        private_dir = Path(llm.scheduler.engine._tmpdir)
        assert private_dir.is_dir()
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)
    assert not private_dir.exists()
    assert not llm.scheduler.alive


def test_min_tokens_holds_back_stop_ids(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[1]
    early = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))[0]
    held = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True,
                                                 stop_token_ids=[stop_id], min_tokens=6))[0]
    assert len(early.token_ids) <= 2 and early.finish_reason == "stop"
    assert len(held.token_ids) > 6
    assert stop_id not in held.token_ids[:6]
