"""One definition per request field and engine setting: name, kind, default, range, meaning.

A dataclass field made with `spec_field(...)` carries a `Spec` in its metadata. `validate`
checks (and normalizes) every such field of an instance with one error style that names the
field; the engine's per-row step message, the Triton inputs and parameters and the README
tables are derived from the same specs (`specs_of`), so a new control or setting is declared
in one place.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

Kind = Literal["int", "float", "bool", "str", "custom"]
# Which front door a setting applies to: the offline `LLM`, the Triton model, or both.
Where = Literal["both", "offline", "triton"]
# How a per-row control travels to the engine (a numpy dtype name), if it does.
RowDtype = Literal["int32", "int64", "float32"]


@dataclass(frozen=True)
class Spec:
    """What one field accepts.

    `low` / `high` bound numbers (inclusive unless `low_open` / `high_open`); a string `high`
    names another field whose value is the bound. `also` lists values accepted outside the
    range (top_k's -1). `normalize` replaces the checks for structured ("custom") fields: it
    returns the normalized value or raises ValueError; `accepts` says in words what it takes.
    `row_dtype` marks a scalar the engine keeps per table row, sent on admission. `choices`
    lists the values a "str" field takes. For settings: `where` says which front door reads
    it, and `shipped` is the value the repository's `config.pbtxt` sets when it differs from
    the default (None: the default).
    """

    kind: Kind
    doc: str
    low: float | None = None
    high: float | str | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False
    also: tuple[Any, ...] = ()
    normalize: Callable[[Any], Any] | None = None
    accepts: str = ""
    row_dtype: RowDtype | None = None
    choices: tuple[str, ...] = ()
    where: Where = "both"
    shipped: Any = None

    def describe(self, bound: float | None = None) -> str:
        """The accepted values in words ("an integer in [0, 20]", "a number > 0")."""
        if self.kind == "custom":
            return self.accepts
        if self.kind == "bool":
            return "a bool"
        if self.kind == "str":
            names = [repr(c) for c in self.choices]
            return ", ".join(names[:-1]) + " or " + names[-1]
        noun = "an integer" if self.kind == "int" else "a number"
        high = bound if bound is not None else self.high
        if self.low is not None and high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{noun} in {left}{_num(self.low)}, {_num(high)}{right}"
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif high is not None:
            text = f"{noun} {'<' if self.high_open else '<='} {_num(high)}"
        else:
            text = f"a finite {'integer' if self.kind == 'int' else 'number'}"
        if self.also:
            text = " or ".join([*(repr(v) for v in self.also), text])
        if self.nullable:
            text += " (or None)"
        return text


def _num(value: float | str) -> str:
    if is_int(value) and value >= 1 << 32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def spec_field(default: Any, kind: Kind, doc: str, **spec: Any) -> Any:
    """A dataclass field with its `Spec` (see `Spec` for the keywords)."""
    return dataclasses.field(default=default, metadata={"spec": Spec(kind, doc, **spec)})


def specs_of(cls: type) -> dict[str, tuple[Spec, Any]]:
    """name -> (spec, default) of every spec'd field of a dataclass, in declaration order."""
    return {f.name: (f.metadata["spec"], f.default) for f in dataclasses.fields(cls)
            if "spec" in f.metadata}


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(name: str, spec: Spec, value: Any, bound: float | None = None) -> Any:
    """`value` if `spec` accepts it (normalized), else ValueError naming `name`."""
    if value is None and spec.nullable:
        return None
    if spec.normalize is not None:
        try:
            return spec.normalize(value)
        except ValueError:
            raise ValueError(f"{name} must be {spec.describe()}, got {value!r}") from None
    if value in spec.also and type(value) is type(spec.also[0]):
        return value
    if not _in_range(spec, value, bound):
        raise ValueError(f"{name} must be {spec.describe(bound)}, got {value!r}")
    return value


def _in_range(spec: Spec, value: Any, bound: float | None) -> bool:
    if spec.kind == "bool":
        return isinstance(value, bool)
    if spec.kind == "str":
        return value in spec.choices and isinstance(value, str)
    if not (is_int(value) if spec.kind == "int" else is_number(value)):
        return False
    if not math.isfinite(value):
        return False
    high = bound if bound is not None else spec.high
    if spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low):
        return False
    if high is not None and (value >= high if spec.high_open else value > high):
        return False
    return True


def validate(instance: Any) -> None:
    """Check every spec'd field of a (frozen) dataclass instance, storing normalized values."""
    for name, (spec, _) in specs_of(type(instance)).items():
        bound = getattr(instance, spec.high) if isinstance(spec.high, str) else None
        value = check_value(name, spec, getattr(instance, name), bound)
        object.__setattr__(instance, name, value)


_WHERE = {"both": "both", "offline": "`LLM`", "triton": "Triton"}


def markdown_table(specs: dict[str, tuple[Spec, Any]], first: str = "field",
                   where: bool = False) -> str:
    """Spec'd fields (`specs_of`) as a README table: name, default, accepted values, (with
    `where`: which front door reads it), meaning."""
    columns = [first, "default", "accepted", *(["where"] if where else []), "meaning"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, (spec, default) in specs.items():
        cells = [f"`{name}`", f"`{default!r}`", spec.describe(),
                 *([_WHERE[spec.where]] if where else []), spec.doc]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
