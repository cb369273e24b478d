"""What the front door knows of the model it serves: its name, tokenizer, context limit and the
tool-call format its chat template speaks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from minisgl_backend.serving.settings import resolve_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
ToolFormat = Literal["hermes", "llama3"]


@dataclass(frozen=True)
class ServedModel:
    """`max_seq_len`: prompt and output tokens of one request at most (the engine's limit when
    known). `renders_tools`: the chat template lays out `tools` itself; else the front door
    describes them in a system message (`tools.tool_system_prompt`)."""

    name: str
    folder: Path
    tokenizer: Any
    max_seq_len: int
    tool_format: ToolFormat
    renders_tools: bool


def model_folder(minisgl_parameters: dict[str, str]) -> Path:
    """The checkpoint the `minisgl` model serves, from its `model` parameter, resolved as the
    model resolves it."""
    return resolve_model_dir(minisgl_parameters, str(REPO_ROOT / "model_repository" / "minisgl"))


def tool_format_of(template: str) -> ToolFormat:
    """Llama 3's JSON calls where the template speaks of them (`<|python_tag|>`, the ipython
    role), else Hermes' `<tool_call>` tags (also the front door's own tool prompt)."""
    return "llama3" if "<|python_tag|>" in template or "ipython" in template else "hermes"


def load_served_model(folder: Path, name: str | None, kv_tokens: int | None,
                      tool_format: ToolFormat | None = None) -> ServedModel:
    """The model in `folder`, served as `name` (default: the folder's name). `kv_tokens`: the
    engine's KV pool, which caps the context when it is smaller."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    limit = int(config.get("max_position_embeddings") or 2048)
    if kv_tokens:
        limit = min(limit, kv_tokens)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return ServedModel(name=name or folder.name, folder=folder, tokenizer=tokenizer,
                       max_seq_len=limit, tool_format=tool_format or tool_format_of(template),
                       renders_tools="tools" in template)
