"""minisgl_backend: a mini-sglang LLM serving engine for Triton, with an offline API.

`from minisgl_backend import LLM, SamplingParams`; heavy modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl_backend.core import SamplingParams

if TYPE_CHECKING:
    from minisgl_backend.llm import LLM, GenerationOutput

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "GenerationOutput"):
        from minisgl_backend import llm

        return getattr(llm, name)
    raise AttributeError(name)
