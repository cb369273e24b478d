"""python -m minisgl_backend.benchmark SUBCOMMAND [options]: each subcommand prints one table,
and what it compared against, after a header (command, date, device)."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = ("offline", "decode", "serving", "openai_api", "controls", "structured",
               "speculative", "fp8", "lora", "kernels", "scheduler", "suite", "pack")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minisgl_backend.benchmark",
                                     description=__doc__)
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"minisgl_backend.benchmark.{name}")
        sub = subparsers.add_parser(name, help=module.__doc__.splitlines()[0],
                                    description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
