"""The `pfcompile` command: profile, plan, render, inspect, calibrate.

Each sub-command lives in the module of its stage of the data flow and registers itself
through `register(subparsers)`; this file only dispatches and turns InputError into a
one-line message with exit status 2 (bad input), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

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


def process_start() -> float:
    """When this process started, on the time.monotonic() clock: from its start time in
    /proc/self/stat (clock ticks since boot) against CLOCK_BOOTTIME, so the interpreter's
    start-up and the imports count; now where that is not available (not Linux)."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        # the command name (field 2) may hold spaces and parentheses: fields follow its last ")"
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - since if 0.0 <= since < 3600.0 else now  # an hour-old "start" is a misread


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
    """The command of `argv` (default: this process's command line, timed from the
    process's start; a call with `argv` is timed from the call)."""
    started = process_start() if argv is None else time.monotonic()
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
    args.started = started  # `plan --time-limit` counts from here
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
