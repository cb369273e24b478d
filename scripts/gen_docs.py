"""Rewrite the README (and docs/) tables that are generated from their one definition in the
code.

    python scripts/gen_docs.py          # rewrite README.md and docs/openai.md in place
    python scripts/gen_docs.py --check  # exit 1 if one is out of date (tests run this)

Each table sits between `<!-- generated:NAME -->` and `<!-- end:NAME -->` markers.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from minisgl_backend.core import SamplingParams
from minisgl_backend.fields import markdown_table, specs_of
from minisgl_backend.serving.interface import OUTPUTS, inputs_of
from minisgl_backend.serving.settings import triton_parameters

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def triton_inputs() -> str:
    lines = ["| input | type | meaning |", "|---|---|---|"]
    for spec in inputs_of("ensemble"):
        shape = " [-1]" if spec.dims == (-1,) else ""
        lines.append(f"| `{spec.name}` | {spec.data_type.removeprefix('TYPE_')}{shape} | "
                     f"{spec.doc} |")
    return "\n".join(lines)


def triton_outputs() -> str:
    lines = ["| output | type | meaning |", "|---|---|---|"]
    lines += [f"| `{o.name}` | {o.data_type.removeprefix('TYPE_')} | {o.doc} |" for o in OUTPUTS]
    return "\n".join(lines)


def openai_parameters() -> str:
    """The OpenAI parameters that set an engine field, with that field's accepted values."""
    from minisgl_backend.openai_server.params import CONTROLS, DEFAULT_NOTES, OPENAI_DEFAULTS

    specs = specs_of(SamplingParams)
    lines = ["| parameter | engine field | default | accepted |", "|---|---|---|---|"]
    for name, field in CONTROLS.items():
        spec, default = specs[field]
        shown = DEFAULT_NOTES.get(field) or f"`{OPENAI_DEFAULTS.get(field, default)!r}`"
        lines.append(f"| `{name}` | `{field}` | {shown} | {spec.describe()} |")
    return "\n".join(lines)


TABLES = {README: {"sampling-params": lambda: markdown_table(specs_of(SamplingParams)),
                   "settings": lambda: markdown_table(triton_parameters(), "setting",
                                                      where=True),
                   "triton-inputs": triton_inputs, "triton-outputs": triton_outputs},
          ROOT / "docs" / "openai.md": {"openai-parameters": openai_parameters}}


def render(text: str, tables: dict, name_of_file: str = "README.md") -> str:
    """`text` with every generated block of `tables` replaced by its current content."""
    for name, make in tables.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{name_of_file} has no block for {name}")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = parser.parse_args()
    for path, tables in TABLES.items():
        text = path.read_text()
        fresh = render(text, tables, path.name)
        if args.check:
            if fresh != text:
                sys.exit(f"{path.name} is out of date: run python scripts/gen_docs.py")
            continue
        path.write_text(fresh)


if __name__ == "__main__":
    main()
