"""The `pfcompile` command: profile, plan, render, inspect, calibrate.

Each sub-command lives in the module of its stage of the data flow and registers itself
through `register(subparsers)`; this file only dispatches and turns InputError into a
one-line message with exit status 2 (bad input), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

STARTED = time.monotonic()  # the command's start: `plan --time-limit` counts from here

from pfcompile import __version__
from pfcompile.formats.errors import InputError

# module -> the sub-commands it registers. Imported lazily so that `pfcompile plan` never
# pays for importing torch, and a missing optional piece breaks only its own command.
COMMANDS = {
    "profile": "pfcompile.cli.profile",
    "plan": "pfcompile.cli.plan",
    "render": "pfcompile.cli.render",
    "inspect": "pfcompile.cli.inspect",
    "calibrate": "pfcompile.cli.calibrate",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pfcompile",
        description="Profiling-driven schedule compiler for pipeline-parallel training with K-FAC.",
    )
    parser.add_argument("--version", action="version", version=f"pfcompile {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{profile,plan,render,inspect,calibrate}")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            # still list it in --help, with a placeholder parser
            sub.add_parser(name, help=f"see `pfcompile {name} --help`", add_help=False)
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # what no encoder writes (a lone surrogate) prints escaped
            stream.reconfigure(errors="backslashreplace")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(wanted if wanted in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except InputError as e:
        print(f"pfcompile {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pfcompile {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `pfcompile inspect x | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
