"""The pipeline's commands: kforge run | capture | search | package."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from ..errors import KforgeError
from .output import capture_progress, card_json, cards_table_of, emit, err_console, progress_lines, report_result
from .parser import search_kwargs


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from .. import runner

    err = err_console()
    kwargs = dict(search_kwargs(args), console=err)
    kwargs["progress"] = kwargs["progress"] and not args.quiet
    if args.resume:
        if args.run_dir is None:
            raise KforgeError("--resume needs --run-dir: the directory of the run to continue")
        result = runner.run(out=args.out, run_dir=args.run_dir, resume=True, **kwargs)
    else:
        if args.model is None:
            raise KforgeError("kforge run needs a model file (model.py) or pkg.module:factory")
        from ..capturing import check_run_dir
        from ..modelspec import load_model_spec

        if args.run_dir is not None:
            check_run_dir(args.run_dir)  # before the model is even built
        model, inputs = load_model_spec(args.model)
        # Plain lines: a live status here would clash with the search's progress display after it.
        result = runner.run(model, inputs, out=args.out, run_dir=args.run_dir, model_name=args.model,
                            check_model=not args.no_model_check, leave_one_out=args.leave_one_out,
                            regions=args.regions,
                            capture_progress=progress_lines(args, err, "capture"), **kwargs)
    return report_result(result, console, args)


def cmd_capture(args: argparse.Namespace, console: Console) -> int:
    from ..capturing import capture, check_run_dir
    from ..modelspec import load_model_spec

    if args.run_dir is not None:
        check_run_dir(args.run_dir)  # before the model is even built
    err = err_console()
    with capture_progress(args, err) as say:
        say(f"loading {args.model}")
        model, inputs = load_model_spec(args.model)
        result = capture(model, inputs, args.run_dir, progress=say, regions=args.regions)
    if args.json:
        return emit({**result.to_json(), "cards": [card_json(c) for c in result.cards]})
    console.print(cards_table_of(result.cards, args))
    for note in result.notes if args.regions else ():
        err.print(f"[yellow]{escape(note)}[/]", soft_wrap=True)
    console.print(f"{len(result.cards)} cards written to {result.run_dir}")
    return 0


def cmd_search(args: argparse.Namespace, console: Console) -> int:
    from .. import runner

    kwargs = dict(search_kwargs(args), console=err_console())
    kwargs["progress"] = kwargs["progress"] and not args.quiet
    return report_result(runner.search_run(args.run_dir, cards=args.cards, **kwargs), console, args)


def cmd_package(args: argparse.Namespace, console: Console) -> int:
    from ..package import write_package

    console.print(f"package: [bold]{escape(str(write_package(args.run_dir, args.out, sign_key=args.sign)))}[/]")
    return 0
