"""The project's own functions in a cProfile file (`MINISGL_PROFILE_DIR`), by cumulative time,
with their calls and microseconds per call: where a step's host time goes, without the
imports and model loading that lead a profile's own summary.

    MINISGL_PROFILE_DIR=/tmp/prof python scripts/bench_offline.py --shape qwen3-0.6b
    python scripts/profile_summary.py /tmp/prof/engine-rank0-*.prof --top 40
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

from minisgl_backend.benchmark.cli import markdown_table

ROOT = Path(__file__).resolve().parent.parent
OWN = (str(ROOT / "minisgl_backend"), str(ROOT / "kernels"))
HEADER = ("function", "calls", "cumulative s", "us/call", "own us/call")


def own_rows(path: Path, top: int, min_calls: int, every: bool = False) -> list[list[str]]:
    """The `top` own functions (`every`: all functions, libraries' too) of the profile at
    `path` called at least `min_calls` times."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.items():
        if (every or file.startswith(OWN)) and calls >= min_calls:
            where = (f"{Path(file).relative_to(ROOT)}:{line}({name})" if file.startswith(OWN)
                     else f"{Path(file).name}:{line}({name})")
            rows.append((cumulative, [where, str(calls), f"{cumulative:.3f}",
                                      f"{1e6 * cumulative / calls:.1f}",
                                      f"{1e6 * own / calls:.1f}"]))
    rows.sort(key=lambda r: -r[0])
    return [r for _, r in rows[:top]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--min-calls", type=int, default=10,
                   help="leave out functions called fewer times (startup work)")
    p.add_argument("--all", action="store_true",
                   help="libraries' functions too (xgrammar's, torch's, the pipes')")
    args = p.parse_args(argv)
    for path in args.profiles:
        print(f"\n{path}\n")
        print(markdown_table(HEADER, own_rows(path, args.top, args.min_calls, args.all)))


if __name__ == "__main__":
    main()
