"""The `kforge` command line: run | capture | search | package | inspect | verify | dash | doctor.

Exit codes are errors.ExitCode (listed by `kforge --help`); a KforgeError prints its message
on one line, never a traceback. Every command that reports takes -q/-v; capture, run,
inspect, verify and doctor take --json (one JSON document on stdout, everything else on
stderr). One module per command group (pipeline, inspecting, tools), the parser and the output
they share; this one dispatches to them.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from rich.markup import escape

from ..errors import ExitCode, KforgeError
from .inspecting import cmd_inspect, cmd_verify
from .output import err_console, out_console
from .parser import build_parser, resume_command
from .pipeline import cmd_capture, cmd_package, cmd_run, cmd_search
from .tools import cmd_dash, cmd_doctor


COMMANDS = {"run": cmd_run, "capture": cmd_capture, "search": cmd_search, "package": cmd_package,
            "inspect": cmd_inspect, "verify": cmd_verify, "dash": cmd_dash, "doctor": cmd_doctor}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO if args.verbose == 1 else logging.DEBUG, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
    console, err = out_console(), err_console()
    from ..runner import RunInterrupted

    try:
        return COMMANDS[args.command](args, console)
    except RunInterrupted as e:
        err.print(f"[yellow]interrupted[/]: everything evaluated so far is in {escape(str(e.run_dir))}. "
                  f"Resume with:\n  {escape(resume_command(args, e.run_dir))}", soft_wrap=True, highlight=False)
        return ExitCode.INTERRUPTED
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return ExitCode.INTERRUPTED
    except KforgeError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return ExitCode.of(e)
