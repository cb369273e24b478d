"""The tokenizers of the benchmark's model shapes, written into their dummy-weight model folders.

`LLM` loads a tokenizer from its model folder, and with one it detokenizes every generated token
incrementally (as the Triton model does when it streams text), so a benchmark folder with a
tokenizer measures that work too. A shape gets the tokenizer `SHAPE_TOKENIZERS` names, else:

* "llama-3": Meta's Llama 3 tokenizer (byte-level BPE, 128,256 ids), committed compressed in
  tokenizers/llama-3/ next to this module (see the README there for its origin and license);
* "word-level": built here for any vocabulary size: id i is the word "w{i}" (HF `tokenizers`
  WordLevel model, split on whitespace), so that every id of the shape decodes.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

from minisgl_backend.benchmark.shapes import SHAPE_TOKENIZERS

TOKENIZERS_DIR = Path(__file__).resolve().parent / "tokenizers"
WORD_LEVEL = "word-level"
# tokenizer_config.json of each committed tokenizer (the special tokens of Meta's base model).
# No clean-up of spaces: it would cut the spaces before punctuation of a byte-level BPE's text.
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
}


def word_level_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer whose ids 0 .. vocab_size - 1 are the words "w0" .. "w{vocab_size - 1}"."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)},
                                           unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def committed_tokenizer(name: str) -> Tokenizer:
    """The tokenizer committed as tokenizers/<name>/tokenizer.json.xz."""
    path = TOKENIZERS_DIR / name / "tokenizer.json.xz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer")
    return Tokenizer.from_str(lzma.decompress(path.read_bytes()).decode())


def tokenizer_name(shape: str) -> str:
    """The name of shape `shape`'s benchmark tokenizer ("word-level" unless it has its own)."""
    return SHAPE_TOKENIZERS.get(shape, WORD_LEVEL)


def shape_tokenizer(shape: str, vocab_size: int, name: str | None = None) -> Tokenizer:
    """The benchmark tokenizer of shape `shape` (or the one named `name`). The word-level one
    has exactly `vocab_size` ids; a committed one at most that many (a model's vocabulary may
    be padded past its tokenizer's, as Qwen's is)."""
    name = name or tokenizer_name(shape)
    tokenizer = (word_level_tokenizer(vocab_size) if name == WORD_LEVEL
                 else committed_tokenizer(name))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size or (name == WORD_LEVEL and size != vocab_size):
        raise ValueError(f"tokenizer {name!r} has {size} ids, shape {shape!r} {vocab_size}")
    return tokenizer


def write_tokenizer(shape: str, vocab_size: int, folder: str | Path,
                    name: str | None = None) -> Path:
    """Write shape `shape`'s tokenizer (or the one named `name`) into model folder `folder`
    (tokenizer.json and a tokenizer_config.json that `transformers.AutoTokenizer` loads);
    return the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    name = name or tokenizer_name(shape)
    shape_tokenizer(shape, vocab_size, name).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **_CONFIGS.get(name, {})}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
