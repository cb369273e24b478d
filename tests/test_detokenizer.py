"""Tests for the tiny test tokenizer, IncrementalDetokenizer and StopStringMatcher."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from minisgl_backend.testing.tiny_tokenizer import build_tiny_tokenizer
from minisgl_backend.tokenizer import IncrementalDetokenizer, StopStringMatcher
from minisgl_backend.tokenizer.detokenizer import ids_decoder

SMOLLM2_DIR = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"
REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! How are you doing today?",
    " leading space and trailing space ",
    "The capital of France is Paris.\n\nNew paragraph\twith a tab.",
    "你好，世界！北京是中国的首都。",
    "Emoji: 😀🎉🚀 and rare ones 🦄🧬🫠 and flags 🇫🇷 and ZWJ 👩‍👩‍👧",
    "Mixed: naïve café, Ünïcödé, 日本語テキスト, Ελληνικά, русский, عربى.",
    "def f(x):\n    return x ** 2  # squared\n",
    "\ufffd literal replacement char in the middle \ufffd and end \ufffd",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request: pytest.FixtureRequest, tiny_tokenizer: Any) -> Any:
    if request.param == "tiny":
        return tiny_tokenizer
    if not all((SMOLLM2_DIR / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        pytest.skip(f"SmolLM2 tokenizer not available at {SMOLLM2_DIR}")
    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))


# --------------------------------------------------------------------------- tiny tokenizer


def test_tiny_tokenizer_builds_fast_and_deterministically(tmp_path: Path) -> None:
    start = time.perf_counter()
    tok = build_tiny_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 1.0
    build_tiny_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()
    assert len(tok) <= 512


def test_tiny_tokenizer_vocab_size_bound(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(tmp_path, vocab_size=300)
    assert len(tok) <= 300
    assert max(tok.encode(TEXTS[4])) < 300
    with pytest.raises(ValueError):
        build_tiny_tokenizer(tmp_path / "small", vocab_size=100)


def test_tiny_tokenizer_special_tokens(tiny_tokenizer: Any) -> None:
    assert tiny_tokenizer.eos_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id == 0
    assert tiny_tokenizer.pad_token_id == 0
    assert tiny_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_tokenizer_round_trips(tiny_tokenizer: Any, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_tokenizer_chat_template(tiny_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi 👋"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- detokenizer


def _stream(
    tok: Any,
    prompt_ids: list[int],
    generated: list[int],
    skip_special_tokens: bool,
    rng: random.Random,
) -> list[str]:
    """Push `generated` in random chunks (mostly single tokens); return all deltas."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = []
    i = 0
    while i < len(generated):
        n = 1 if rng.random() < 0.7 else rng.randint(0, 4)
        deltas.append(detok.push(generated[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def _check_stream(
    tok: Any, prompt_ids: list[int], generated: list[int], skip: bool, rng: random.Random
) -> None:
    deltas = _stream(tok, prompt_ids, generated, skip, rng)
    full = tok.decode(generated, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas)


def _prompt_ids(tok: Any) -> list[int]:
    messages = [{"role": "user", "content": "Say something nice 😊"}]
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False))


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode_on_texts(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(0)
    prompt = _prompt_ids(tokenizer)
    eos = tokenizer.eos_token_id
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for prompt_ids in (prompt, []):
            _check_stream(tokenizer, prompt_ids, ids, skip, rng)
            _check_stream(tokenizer, prompt_ids, ids + [eos], skip, rng)
        # A special token in the middle of the output.
        mid = len(ids) // 2
        _check_stream(tokenizer, prompt, ids[:mid] + [eos] + ids[mid:], skip, rng)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode_on_random_ids(tokenizer: Any, skip: bool) -> None:
    # Random ids include lone UTF-8 continuation/lead bytes: invalid sequences must match too.
    rng = random.Random(1)
    vocab = len(tokenizer)
    prompt = _prompt_ids(tokenizer)
    for _ in range(30):
        generated = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        _check_stream(tokenizer, prompt, generated, skip, rng)


@pytest.mark.parametrize("skip", [True, False])
def test_ids_decoder_equals_decode(tokenizer: Any, skip: bool) -> None:
    """The Rust tokenizer's decode, where the detokenizer uses it, gives decode's text."""
    rng = random.Random(2)
    decode = ids_decoder(tokenizer, skip)
    specials = list(tokenizer.all_special_ids)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_ids_decoder_keeps_decode_of_other_tokenizers(tiny_tokenizer: Any) -> None:
    """A tokenizer that is not a plain fast one (its own decode, or spaces cleaned up after the
    Rust tokenizer) is decoded by its decode."""
    class Wrapped:
        backend_tokenizer = tiny_tokenizer.backend_tokenizer

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"decoded {len(ids)}"

    assert ids_decoder(Wrapped(), True)([1, 2]) == "decoded 2"
    cleans = tiny_tokenizer.clean_up_tokenization_spaces
    tiny_tokenizer.clean_up_tokenization_spaces = True
    try:
        calls = []
        original = tiny_tokenizer.decode
        tiny_tokenizer.decode = lambda ids, **kw: calls.append(ids) or original(ids, **kw)
        ids_decoder(tiny_tokenizer, True)([5, 6])
        assert calls == [[5, 6]]
    finally:
        tiny_tokenizer.clean_up_tokenization_spaces = cleans
        del tiny_tokenizer.decode


def test_detokenizer_holds_back_partial_characters(tokenizer: Any) -> None:
    text = "a🦄b🫠中"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt_ids(tokenizer))
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert len(ids) > len(text)  # some characters really were split across tokens
    assert "" in deltas[:-1]  # and were held back meanwhile


def test_detokenizer_emoji_split_into_bytes(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("🦄", add_special_tokens=False)
    assert len(ids) >= 2  # not in the training corpus: split into byte-level pieces
    detok = IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("Hi "))
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦄"]
    assert detok.flush() == ""


def test_detokenizer_flush_releases_incomplete_tail(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("ok🦄", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tiny_tokenizer)
    pushed = "".join(detok.push([i]) for i in ids)
    assert pushed == "ok"
    tail = detok.flush()
    assert pushed + tail == tiny_tokenizer.decode(ids)
    assert tail.startswith(REPLACEMENT)


def test_detokenizer_first_token_keeps_leading_space(tokenizer: Any) -> None:
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    full = tokenizer.encode("The answer is forty two", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    detok = IncrementalDetokenizer(tokenizer, prompt)
    out = "".join(detok.push([i]) for i in full[len(prompt) :]) + detok.flush()
    assert out == " forty two"


def test_detokenizer_skip_special_tokens_flag(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("hi", add_special_tokens=False) + [2, 0]
    skipping = IncrementalDetokenizer(tiny_tokenizer)
    assert skipping.push(ids) + skipping.flush() == "hi"
    keeping = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=False)
    assert keeping.push(ids) + keeping.flush() == "hi<|im_end|><|endoftext|>"


def test_detokenizer_empty_push(tiny_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer, [5, 6])
    assert detok.push([]) == ""
    assert detok.flush() == ""


# --------------------------------------------------------------------------- stop strings


def _expected_cut(full: str, stops: list[str]) -> str:
    starts = [full.find(s) for s in stops if s in full]
    return full[: min(starts)] if starts else full


def _random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 1, 2, 3, 5, 8])
        pieces.append(text[i : i + n])
        i += n
    return pieces


def _run_matcher(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            with pytest.raises(RuntimeError):
                matcher.feed("more")
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


STOP_CASES = [
    ("Hello world. The end. More text", ["The end"]),
    ("Answer: 42\nUser: next question", ["\nUser:", "\n\n"]),
    ("stop at the very start", ["stop"]),
    ("xxab and more b", ["ab", "b"]),
    ("xxb then ab", ["ab", "b"]),
    ("abcabd", ["abd", "bc"]),
    ("aabcd", ["abcd", "bc"]),  # a longer stop starting earlier wins
    ("aabce", ["abcd", "bc"]),  # ... unless it does not complete
    ("banana", ["nana", "anan"]),
    ("aaaaab", ["aab"]),
    ("no match here at all", ["xyz", "zzz", "here!"]),
    ("ends with partial sto", ["stop"]),
    ("你好，世界！北京是中国的首都。", ["世界", "首都"]),
    ("emoji 🚀 stop 🎉", ["🚀 s"]),
    ("", ["x"]),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_stop_matcher_random_splits(text: str, stops: list[str]) -> None:
    rng = random.Random(hash(text) % 1000)
    expected = _expected_cut(text, stops)
    for _ in range(50):
        got, stopped = _run_matcher(stops, _random_split(text, rng))
        assert got == expected
        if stopped:
            assert any(s in text for s in stops)


def test_stop_matcher_fuzz() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        got, _ = _run_matcher(stops, _random_split(text, rng))
        assert got == _expected_cut(text, stops), (text, stops)


def test_stop_matcher_holds_back_possible_prefix() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The result </ans") == ("The result ", False)
    assert matcher.feed("wer> trailing") == ("", True)
    assert matcher.stopped

    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("a </an") == ("a ", False)
    assert matcher.feed("d more") == ("</and more", False)
    assert matcher.feed("</") == ("", False)
    assert matcher.flush() == "</"


def test_stop_matcher_without_stops_passes_through() -> None:
    matcher = StopStringMatcher([])
    for delta in ["a", "", "bc", "\ufffd"]:
        assert matcher.feed(delta) == (delta, False)
    assert matcher.flush() == ""


def test_stop_matcher_rejects_empty_stop() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
