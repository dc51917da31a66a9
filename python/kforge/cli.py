"""The `kforge` command line: run | capture | search | package | inspect | verify | dash | doctor.

Exit codes are errors.ExitCode (listed by `kforge --help`); a KforgeError prints its message
on one line, never a traceback. Every command that reports takes -q/-v; capture, run,
inspect, verify and doctor take --json (one JSON document on stdout, everything else on
stderr).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .errors import EXIT_CODE_HELP, ExitCode, KforgeError


def _devices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GPU ordinals separated by commas, like 0,1 (got {text!r})") from None


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, like 8050 (got {text!r})")
    return port


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected op names separated by commas, like softmax,group_norm")
    return names


def _price(text: str) -> tuple[float, float]:
    try:
        prompt, completion = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected USD per 1M prompt and completion tokens, like 2.5,10 (got {text!r})") from None
    return prompt, completion


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected a header as 'Name: value' (got {text!r})")
    return name.strip(), value.strip()


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, like '{{\"top_k\": 20}}' ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, like '{{\"top_k\": 20}}' (got {text!r})")
    return value


def _llm_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LLM proposer (override the environment and the config file)")
    g.add_argument("--llm-config", type=Path, metavar="FILE",
                   help="TOML or JSON file of LLM settings (default $KFORGE_LLM_CONFIG)")
    g.add_argument("--llm-base-url", help="OpenAI-compatible endpoint (the API key comes from the environment)")
    g.add_argument("--llm-model", help="model name at that endpoint")
    g.add_argument("--llm-price", type=_price, metavar="PROMPT,COMPLETION",
                   help="the model's price in USD per 1M tokens (0,0 for a free local model); needed with "
                        "--max-cost for a model kforge has no price for")
    g.add_argument("--llm-reply-tokens", type=int, metavar="N",
                   help="reply limit per call (default 8192; 32768 for reasoning models)")
    g.add_argument("--llm-temperature", metavar="T|none", help="sampling temperature, or none to send none")
    g.add_argument("--llm-top-p", type=float, metavar="P")
    g.add_argument("--llm-reasoning-effort", metavar="LEVEL", help="e.g. low, medium, high (reasoning models)")
    g.add_argument("--llm-header", type=_header, action="append", metavar="'NAME: VALUE'",
                   help="extra HTTP header (repeatable); put credentials in the config file instead")
    g.add_argument("--llm-body", type=_json_object, metavar="JSON",
                   help="JSON object merged into each request body, e.g. '{\"top_k\": 20}'")


def _llm_settings(args: argparse.Namespace) -> dict:
    """The LLM flags given, as LLMConfig.resolve settings."""
    settings = {"config_file": args.llm_config, "base_url": args.llm_base_url, "model": args.llm_model,
                "price": args.llm_price, "max_reply_tokens": args.llm_reply_tokens,
                "temperature": args.llm_temperature, "top_p": args.llm_top_p,
                "reasoning_effort": args.llm_reasoning_effort,
                "extra_headers": dict(args.llm_header) if args.llm_header else None, "extra_body": args.llm_body}
    return {k: v for k, v in settings.items() if v is not None}


def _search_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--proposer", default="builtin", help="builtin (default), llm or llm:<model>")
    g.add_argument("--iterations", type=int, default=50, help="search iterations per card (default 50)")
    g.add_argument("--wall-time", type=float, metavar="SECONDS", help="stop searching after this long")
    g.add_argument("--max-cost", type=float, metavar="USD", help="stop once LLM calls cost this much")
    g.add_argument("--min-share", type=float, default=0.0, help="skip cards below this share of runtime (0-1)")
    g.add_argument("--include-vendor", action="store_true", help="also search cards backed by cuBLAS/cuDNN")
    g.add_argument("--ops", type=_names, metavar="softmax,group_norm",
                   help="only search cards whose op name contains one of these")
    g.add_argument("--devices", type=_devices, metavar="0,1",
                   help="GPU ordinals to evaluate on (default: all)")
    g.add_argument("--cluster", metavar="ray|ray://HOST:PORT",
                   help="evaluate on every GPU of a Ray cluster (ray: the one at $RAY_ADDRESS) instead of this "
                        "machine's; needs pip install 'kforge[ray]' (docs/cluster.md)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true", help="no live progress display")
    _llm_options(p)


# Rows a default table shows: the largest searchable cards; --all shows every card.
TOP_CARDS = 20
# Width of a console that is not a terminal (a pipe, a file): rows stay on one line each.
PIPE_WIDTH = 100_000


def _output_options(json_flag: bool, table: bool = False) -> argparse.ArgumentParser:
    """-q/-v (and --json, --all where the command has them), accepted after the command name."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress, only the result")
    g.add_argument("-v", "--verbose", action="count", default=0, help="log what kforge does (-vv: debug)")
    if json_flag:
        g.add_argument("--json", action="store_true",
                       help="print one JSON document on stdout and nothing else (messages go to stderr)")
    if table:
        g.add_argument("--all", action="store_true",
                       help=f"list every card (default: the {TOP_CARDS} largest searchable ones)")
    return p


def _trusted_key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-key", type=Path, action="append", metavar="PUBKEY", dest="trusted_keys",
                   help="refuse the package unless this Ed25519 public key (PEM) signed it; repeat for several")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="kforge", description="Generated, verified, guarded CUDA kernels for unmodified PyTorch models.",
        epilog="exit codes:\n" + "\n".join(f"  {int(code):<4} {EXIT_CODE_HELP[code]}" for code in ExitCode),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    scripted, plain = _output_options(True, table=True), _output_options(False)

    p = sub.add_parser("run", help="capture a model, search kernels, package the winners", parents=[scripted])
    p.add_argument("model", nargs="?", help="model.py (defining get_model() and get_inputs()) or pkg.module:factory")
    p.add_argument("--out", default="model.cast", help="package to write (default model.cast)")
    p.add_argument("--run-dir", type=Path, help="where cards and the search log go")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir without capturing")
    p.add_argument("--no-model-check", action="store_true",
                   help="do not time the model eager and with the package at the end")
    p.add_argument("--leave-one-out", type=int, default=0, metavar="N",
                   help="when kforge.compile does not beat torch.compile and its graphs ran at most N cards, "
                        "time it without each card in turn and record the one to leave out (default 0: off)")
    p.add_argument("--regions", action="store_true",
                   help="also trace the model and write a card per fused multi-op region (experimental)")
    _search_options(p)

    p = sub.add_parser("capture", help="record the operators a model runs as cards", parents=[scripted])
    p.add_argument("model", help="model.py (defining get_model() and get_inputs()) or pkg.module:factory")
    p.add_argument("--run-dir", type=Path,
                   help="where the cards go (created; default: a new temporary directory, printed at the end)")
    p.add_argument("--regions", action="store_true",
                   help="also trace the model and write a card per fused multi-op region (experimental)")

    p = sub.add_parser("search", help="search kernels for the cards of a run directory",
                       parents=[_output_options(False, table=True)])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--cards", nargs="+", metavar="ID", help="only these card ids")
    _search_options(p)

    p = sub.add_parser("package", help="write the winners of a run directory into a .cast package", parents=[plain])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sign", type=Path, metavar="KEYFILE",
                   help="sign the package with this Ed25519 private key (PEM; make a pair with `openssl genpkey "
                        "-algorithm ed25519 -out key.pem && openssl pkey -in key.pem -pubout -out key.pub.pem`)")

    p = sub.add_parser("inspect", help="show a run directory or a .cast package", parents=[scripted])
    p.add_argument("path", type=Path)
    _trusted_key_option(p)

    p = sub.add_parser("verify", help="check a .cast package: checksums and format, then re-run its dispatched "
                                      "kernels on this GPU", parents=[_output_options(True)])
    p.add_argument("path", type=Path)
    _trusted_key_option(p)

    p = sub.add_parser("dash", help="serve the dashboard over run directories", parents=[plain])
    p.add_argument("run_dirs", nargs="*", type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8050)

    p = sub.add_parser("doctor", help="what kforge finds of CUDA, the driver and NVRTC, the LLM settings, and "
                       "what works without a GPU", parents=[_output_options(True)])
    p.add_argument("--cluster", metavar="ray|ray://HOST:PORT",
                   help="also report the Ray cluster's nodes: GPUs, versions, and which a run from here refuses")
    _llm_options(p)
    return parser


def _search_kwargs(args: argparse.Namespace) -> dict:
    options = _llm_settings(args)
    return dict(proposer=args.proposer, iterations=args.iterations, wall_time_s=args.wall_time,
                max_cost_usd=args.max_cost, min_share=args.min_share, include_vendor=args.include_vendor,
                devices=args.devices, seed=args.seed, progress=not args.no_progress, proposer_options=options,
                ops=args.ops, cluster=args.cluster)


# Search options as (dest, flag): a resume hint repeats those that differ from the defaults.
_SEARCH_FLAGS = (("proposer", "--proposer"), ("iterations", "--iterations"), ("wall_time", "--wall-time"),
                 ("max_cost", "--max-cost"), ("min_share", "--min-share"), ("include_vendor", "--include-vendor"),
                 ("ops", "--ops"),
                 ("devices", "--devices"), ("cluster", "--cluster"), ("seed", "--seed"), ("llm_config", "--llm-config"),
                 ("llm_base_url", "--llm-base-url"), ("llm_model", "--llm-model"), ("llm_price", "--llm-price"),
                 ("llm_reply_tokens", "--llm-reply-tokens"), ("llm_temperature", "--llm-temperature"),
                 ("llm_top_p", "--llm-top-p"), ("llm_reasoning_effort", "--llm-reasoning-effort"),
                 ("llm_body", "--llm-body"))  # not --llm-header: its values may be credentials


def _resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues an interrupted run with the options it was started with:
    with the defaults it would go on under another proposer, budget or set of cards."""
    if args.command == "search":
        words = ["kforge", "search", str(run_dir)] + (["--cards", *args.cards] if args.cards else [])
    else:
        words = ["kforge", "run", "--resume", "--run-dir", str(run_dir)]
        if args.out != "model.cast":
            words += ["--out", str(args.out)]
    defaults = vars(build_parser().parse_args(["search", "."]))
    for dest, flag in _SEARCH_FLAGS:
        value = getattr(args, dest)
        if value == defaults[dest]:
            continue
        if value is True:
            words.append(flag)
        else:
            words += [flag, json.dumps(value) if isinstance(value, dict) else
                      ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return shlex.join(words)


def _out_console() -> Console:
    """stdout for people. Piped or redirected it is as wide as a row needs: a table then has
    one line per row instead of wrapping at 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def _err_console() -> Console:
    console = Console(stderr=True)
    return console if console.is_terminal else Console(stderr=True, width=PIPE_WIDTH)


def _emit(data: Any) -> int:
    """The one JSON document a --json command prints on stdout."""
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
    return 0


def _progress_lines(args: argparse.Namespace, err: Console, what: str) -> Callable[[str], None]:
    """Progress of a long step as plain lines on stderr (a log file stays readable); nothing
    with -q or --no-progress."""
    if args.quiet or getattr(args, "no_progress", False):
        return lambda line: None
    return lambda line: err.print(f"{what}: {line}", highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def _capture_progress(args: argparse.Namespace, err: Console) -> Iterator[Callable[[str], None]]:
    """The capture's stages on stderr: a live status line on a terminal, plain lines and the
    time it took otherwise, nothing with -q."""
    t0 = time.monotonic()
    if args.quiet or not err.is_terminal:
        yield _progress_lines(args, err, "capture")
    else:
        with err.status("capture") as status:
            yield lambda line: status.update(f"capture: {escape(line)}")
    if not args.quiet:
        err.print(f"capture: done in {time.monotonic() - t0:.1f} s", highlight=False, markup=False)


def _table_limit(args: argparse.Namespace) -> dict:
    return {} if getattr(args, "all", False) else {"limit": TOP_CARDS}


def _result_json(result) -> dict:
    check = result.model_check
    return {"run_id": result.run_id, "run_dir": str(result.run_dir), "validated": result.validated,
            "package": str(result.package_path) if result.package_path else None, "message": result.message,
            "cards": [dataclasses.asdict(r) for r in result.table], "stop_reasons": result.stop_reasons,
            "model_check": {"verdict": check.verdict, "message": check.message(),
                            "compile": check.compile_record()} if check is not None else None,
            "model_check_error": result.model_check_error or None}


def _report(result, console: Console, args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        return _emit(_result_json(result))
    everything = getattr(args, "all", False)
    console.print(_results_table(result.table, f"run {result.run_id}", args, everything))
    if result.message:
        console.print(f"[yellow]{escape(result.message)}[/]", soft_wrap=True)
    if result.package_path:
        console.print(f"package: [bold]{result.package_path}[/]")
    check = result.model_check
    if check is not None:
        colour = {"faster": "green", "slower": "red", "unused": "red"}.get(check.verdict, "yellow")
        console.print(f"[{colour}]{escape(check.message())}[/]", soft_wrap=True)
    elif result.model_check_error:
        console.print(f"[yellow]the model check did not complete: {escape(result.model_check_error)}[/]", soft_wrap=True)
    console.print(f"run directory: {result.run_dir}")
    return 0


def _results_table(rows, title: str, args: argparse.Namespace, everything: bool):
    from .runner import results_table

    return results_table(rows, title, searched_only=not everything, **({} if everything else {"limit": TOP_CARDS}))


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from . import runner

    err = _err_console()
    kwargs = dict(_search_kwargs(args), console=err)
    kwargs["progress"] = kwargs["progress"] and not args.quiet
    if args.resume:
        if args.run_dir is None:
            raise KforgeError("--resume needs --run-dir: the directory of the run to continue")
        result = runner.run(out=args.out, run_dir=args.run_dir, resume=True, **kwargs)
    else:
        if args.model is None:
            raise KforgeError("kforge run needs a model file (model.py) or pkg.module:factory")
        from .capture import check_run_dir
        from .modelspec import load_model_spec

        if args.run_dir is not None:
            check_run_dir(args.run_dir)  # before the model is even built
        model, inputs = load_model_spec(args.model)
        # Plain lines: a live status here would clash with the search's progress display after it.
        result = runner.run(model, inputs, out=args.out, run_dir=args.run_dir, model_name=args.model,
                            check_model=not args.no_model_check, leave_one_out=args.leave_one_out,
                            regions=args.regions,
                            capture_progress=_progress_lines(args, err, "capture"), **kwargs)
    return _report(result, console, args)


def _card_json(card) -> dict:
    from .capture import skip_reason

    return {"id": card.id, "op": card.op, "summary": card.summary(), "family": card.family, "calls": card.calls,
            "eager_us": card.eager_us, "share": card.share, "module_paths": card.module_paths,
            "searchable": skip_reason(card) is None, "skip_reason": skip_reason(card)}


def _cards_table(cards, args: argparse.Namespace):
    from .capture import cards_table

    everything = getattr(args, "all", False)
    return cards_table(cards, searchable_only=not everything, **({} if everything else {"limit": TOP_CARDS}))


def cmd_capture(args: argparse.Namespace, console: Console) -> int:
    from .capture import capture, check_run_dir
    from .modelspec import load_model_spec

    if args.run_dir is not None:
        check_run_dir(args.run_dir)  # before the model is even built
    err = _err_console()
    with _capture_progress(args, err) as say:
        say(f"loading {args.model}")
        model, inputs = load_model_spec(args.model)
        result = capture(model, inputs, args.run_dir, progress=say, regions=args.regions)
    if args.json:
        return _emit({**result.to_json(), "cards": [_card_json(c) for c in result.cards]})
    console.print(_cards_table(result.cards, args))
    for note in result.notes if args.regions else ():
        err.print(f"[yellow]{escape(note)}[/]", soft_wrap=True)
    console.print(f"{len(result.cards)} cards written to {result.run_dir}")
    return 0


def cmd_search(args: argparse.Namespace, console: Console) -> int:
    from . import runner

    kwargs = dict(_search_kwargs(args), console=_err_console())
    kwargs["progress"] = kwargs["progress"] and not args.quiet
    return _report(runner.search_run(args.run_dir, cards=args.cards, **kwargs), console, args)


def cmd_package(args: argparse.Namespace, console: Console) -> int:
    from .package import write_package

    console.print(f"package: [bold]{escape(str(write_package(args.run_dir, args.out, sign_key=args.sign)))}[/]")
    return 0


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    path: Path = args.path
    if path.is_dir():
        return _inspect_run(path, console, args)
    if path.suffix == ".cast" and path.is_file():
        return _inspect_package(path, console, args)
    if not path.exists():
        raise KforgeError(f"{path} does not exist: give a run directory or a .cast package")
    raise KforgeError(f"{path} is neither a run directory nor a .cast package")


def _load_package(path: Path, trusted_keys: list[Path] | None):
    """(package, number of cards it dispatches as packaged, "N of M cards dispatched as
    packaged", fallback warnings). A package that is not intact raises PackageError. Loading on
    another GPU (or none) makes every card fall back here: the warnings are returned, to be
    shown as notes."""
    from .package import PackageFallbackWarning, load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackageFallbackWarning)
        pkg = load(path, trusted_keys=trusted_keys)
    entries = pkg.manifest.get("cards", [])
    packaged = sum(e.get("decision") == "dispatched" for e in entries)
    return pkg, packaged, f"{packaged} of {len(entries)} cards dispatched as packaged", caught


def _notes(caught, console: Console) -> None:
    for w in caught:
        console.print(f"[yellow]on this machine:[/] {escape(str(w.message))}", soft_wrap=True)


_PACKAGE_CARD_KEYS = ("id", "op", "summary", "family", "calls", "share", "decision", "reason", "compile", "kind",
                      "timing", "error", "flags")


def _inspect_package(path: Path, console: Console, args: argparse.Namespace) -> int:
    pkg, _, summary, caught = _load_package(path, args.trusted_keys)
    if args.json:
        manifest = pkg.manifest
        return _emit({"kind": "package", "path": str(path), "gpu": pkg.gpu, "arch": pkg.arch, "summary": summary,
                      "integrity": pkg.integrity,
                      **{k: manifest.get(k) for k in ("format", "kforge", "torch", "cuda", "run_id", "model_check")},
                      "cards": [{k: e.get(k) for k in _PACKAGE_CARD_KEYS} for e in manifest.get("cards", [])],
                      "notes": [str(w.message) for w in caught]})
    console.print(f"{escape(str(path))}: built for {escape(pkg.gpu)} ({pkg.arch}); {summary}; {pkg.integrity}")
    console.print(pkg.report(fmt="table"))
    console.print(escape(pkg.compile_verdict()))
    _notes(caught, console)
    return 0


def _proposer_errors(log, run_id: str, top: int = 3) -> tuple[int, list[dict]]:
    """(how many proposer errors the run logged, the most frequent messages with their counts;
    ties: the one logged first)."""
    counts = collections.Counter(e.message for e in log.events(run_id, "proposer_error"))
    return counts.total(), [{"message": m, "count": n} for m, n in counts.most_common(top)]


def _inspect_run(run_dir: Path, console: Console, args: argparse.Namespace) -> int:
    from .cards import load_cards
    from .runner import card_results
    from .store import LOG_NAME, LLMUsage, SQLiteStore

    if not (run_dir / LOG_NAME).exists():
        cards = load_cards(run_dir)
        if not cards:
            raise KforgeError(f"{run_dir} holds no cards and no search log: run `kforge capture` or `kforge run`")
        if args.json:
            return _emit({"kind": "capture", "run_dir": str(run_dir), "cards": [_card_json(c) for c in cards],
                          "next": f"kforge search {run_dir}"})
        console.print(_cards_table(cards, args))
        console.print(f"{len(cards)} cards, not searched yet: `kforge search {run_dir}`")
        return 0
    with SQLiteStore(run_dir, readonly=True) as log:
        run_id = log.latest_run()
        if run_id is None:
            raise KforgeError(f"the search log in {run_dir} has no run yet")
        run = log.run(run_id)
        rows = card_results(log, run_id)
        llm = sum(log.llm_usage(run_id).values(), LLMUsage())
        n_errors, errors = _proposer_errors(log, run_id)
    resume = f"kforge search {run_dir}" if run.status in ("interrupted", "running") else None
    if args.json:
        info = {k: v for k, v in dataclasses.asdict(run).items() if k != "config"}
        return _emit({"kind": "run", "run_dir": str(run_dir), "run": {**info, "config": run.config},
                      "cards": [dataclasses.asdict(r) for r in rows],
                      "llm": {"calls": llm.calls, "failed_calls": llm.failed_calls, "tokens": llm.tokens,
                              "cost_usd": llm.cost_usd},
                      "proposer_errors": {"count": n_errors, "top": errors}, "resume": resume})
    console.print(f"run [bold]{run.id}[/] ({run.status}) model {run.model or '-'} on "
                  f"{run.device or '-'} {run.arch or ''}, torch {run.torch or '-'}")
    console.print(_results_table(rows, "cards", args, getattr(args, "all", False)))
    if llm.calls:
        console.print(f"LLM: {llm.calls} calls ({llm.failed_calls} failed), {llm.tokens} tokens, ${llm.cost_usd:.4f}")
    if n_errors:
        console.print(f"[red]{n_errors} proposer error(s)[/], the most frequent:")
        for e in errors:
            console.print(f"  {e['count']} x {escape(e['message'])}", soft_wrap=True, highlight=False)
    if resume:
        console.print(f"resume with: {resume}")
    return 0


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    """Re-validate every dispatched kernel of a package on this GPU; 1 if any fails."""
    pkg, packaged, summary, caught = _load_package(args.path, args.trusted_keys)
    if args.json:
        results = pkg.verify() if packaged else {}
        failed = [c for c, r in results.items() if r.verdict.failed]
        _emit({"path": str(args.path), "summary": summary, "integrity": pkg.integrity,
               "notes": [str(w.message) for w in caught],
               "results": {c: {"verdict": r.verdict.value, "speedup": r.speedup, "message": r.message}
                           for c, r in results.items()}, "failed": failed})
        return 1 if failed else 0
    console.print(f"{escape(str(args.path))}: checksums and format ok; {summary}; {pkg.integrity}")
    _notes(caught, console)
    if not packaged:
        console.print("no kernel to re-run: every card falls back to PyTorch")
        return 0
    results = pkg.verify()
    failed = [c for c, r in results.items() if r.verdict.failed]
    t = Table(title=f"verify {args.path.name}", title_justify="left")
    for col in ("card", "verdict", "speedup", "message"):
        t.add_column(col, overflow="fold")
    for card_id, r in results.items():
        t.add_row(card_id, r.verdict.value, f"{r.speedup:.2f}x" if r.speedup else "-", escape(r.message))
    console.print(t)
    if failed:
        console.print(f"[red]{len(failed)} kernel(s) failed here and will fall back:[/] {', '.join(failed)}")
        return 1
    console.print(f"{len(results)} dispatched kernel(s) verified on this GPU")
    return 0


def cmd_dash(args: argparse.Namespace, console: Console) -> int:
    missing = [str(d) for d in args.run_dirs if not d.exists()]
    if missing:
        raise KforgeError(f"no such run directory or package: {', '.join(missing)}")
    serve = _dash_serve()
    console.print(f"dashboard on http://{args.host}:{args.port} (Ctrl-C stops it)")
    serve([str(d) for d in args.run_dirs], host=args.host, port=args.port)
    return 0


def _dash_serve():
    """kforge.dash_app when installed, dash_app from a source checkout otherwise."""
    for name in ("kforge.dash_app", "dash_app"):
        try:
            return importlib.import_module(name).serve
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ("dash", "dash_cytoscape"):
                raise KforgeError("the dashboard needs dash: pip install 'kforge[dash]'") from e
            if e.name not in (name, name.split(".")[0]):
                raise
    raise KforgeError("the dashboard (kforge.dash_app) is not installed with this kforge")


def _without_gpu(status: dict) -> list[str]:
    """What works on this machine, in words, for one without a usable GPU (or NVRTC)."""
    lines = []
    if not status["devices"]:
        lines.append("No usable GPU here. What works: `kforge capture` (cards, shares and samples of any model on "
                     "the CPU), `kforge inspect`, `kforge dash` over captures and runs, and LLM prompting.")
        lines.append("`kforge run` / `kforge search` without a GPU only generate and compile a few candidates per "
                     "card (compile-only): nothing is validated or timed, and no package is written.")
        lines.append("Validation, timing, packaging (`kforge package`) and `kforge verify` need an NVIDIA GPU.")
    if status["nvrtc"] is None:
        lines.append("Without NVRTC no candidate can be compiled: `pip install 'nvidia-cuda-nvrtc>=13,<14'`.")
    return lines


def cmd_doctor(args: argparse.Namespace, console: Console) -> int:
    from .cuda import cuda_status
    from .dispatch import native_status

    status = cuda_status()
    native, why = native_status("CUDA")
    advice = _without_gpu(status)
    llm = _llm_rows(_llm_settings(args))
    cluster = _cluster_report(args.cluster) if args.cluster else None
    if args.json:
        return _emit({**status, "dispatch": {"native": native, "why": why}, "without_gpu": advice, "llm": dict(llm),
                      **({"cluster": cluster} if cluster else {})})
    t = Table(title="kforge doctor", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("status", overflow="fold")  # paths whole, folded, never cut with an ellipsis
    for key, value in status.items():
        shown = ("none found" if value is None or value == [] else value if isinstance(value, str)
                 else json.dumps(value, default=str))
        t.add_row(str(key), shown)
    t.add_row("dispatch", f"{'C++' if native else 'Python'}: {why}")
    for what, value in llm:
        t.add_row(what, escape(value))
    console.print(t)
    for line in advice:
        console.print(line, soft_wrap=True, highlight=False)
    if not advice:
        console.print("A GPU and NVRTC are here: everything works.")
    if cluster:
        console.print(_cluster_table(cluster))
    return 0


def _cluster_report(cluster: str) -> dict:
    from .cluster import ray_address
    from .cluster.nodes import cluster_report

    return cluster_report(ray_address(cluster))


def _cluster_table(report: dict) -> Table:
    t = Table(title=f"Ray cluster at {report['address']} (ray {report['ray']})", title_justify="left")
    for col in ("node", "GPUs", "GPU", "driver", "torch", "kforge", "a run from here"):
        t.add_column(col, overflow="fold")
    for n in report["nodes"]:
        gpu = ", ".join(sorted({f"{g['name']} ({g['arch']})" for g in n.get("gpus_seen", [])})) or "-"
        verdict = (n["error"] if "error" in n else "no GPU: not used" if not n["gpus"] else
                   f"refused: {n['refused']}" if n.get("refused") else "used")
        t.add_row(*map(Text, (f"{n['ip']} ({n['node_id'][:8]})", str(n["gpus"]), gpu, str(n.get("driver", "-")),
                              n.get("torch", "-"), n.get("kforge", "-"), verdict)))
    return t


def _llm_rows(settings: dict) -> list[tuple[str, str]]:
    """What the LLM proposer would use: model, endpoint, reply limit and the price it charges."""
    from .errors import LLMError
    from .proposers.llm.config import LLMConfig
    from .proposers.llm.prices import PRICES, PRICES_AS_OF, find_price

    try:
        cfg = LLMConfig.resolve(**settings)
    except LLMError as e:
        return [("llm", f"not configured ({e})")]
    price = cfg.price()
    if price is None:
        shown = "unknown: --max-cost is refused until one is given (--llm-price PROMPT,COMPLETION)"
    else:
        source = f"kforge's table of {PRICES_AS_OF}" if find_price(cfg.model, PRICES) == price else "given"
        shown = f"${price[0]:g} prompt, ${price[1]:g} completion per 1M tokens ({source})"
    return [("llm model", cfg.model), ("llm endpoint", cfg.base_url), ("llm price", shown),
            ("llm reply limit", f"{cfg.max_reply_tokens} tokens per call")]


COMMANDS = {"run": cmd_run, "capture": cmd_capture, "search": cmd_search, "package": cmd_package,
            "inspect": cmd_inspect, "verify": cmd_verify, "dash": cmd_dash, "doctor": cmd_doctor}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO if args.verbose == 1 else logging.DEBUG, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
    console, err = _out_console(), _err_console()
    from .runner import RunInterrupted

    try:
        return COMMANDS[args.command](args, console)
    except RunInterrupted as e:
        err.print(f"[yellow]interrupted[/]: everything evaluated so far is in {escape(str(e.run_dir))}. "
                  f"Resume with:\n  {escape(_resume_command(args, e.run_dir))}", soft_wrap=True, highlight=False)
        return ExitCode.INTERRUPTED
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return ExitCode.INTERRUPTED
    except KforgeError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return ExitCode.of(e)
