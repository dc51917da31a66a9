"""The `kforge` command line: run | capture | search | package | inspect | verify | dash | doctor.

Exit codes: 0 ok, 1 error (a KforgeError prints its message, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import warnings
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import KforgeError


def _devices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GPU ordinals separated by commas, like 0,1 (got {text!r})") from None


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected op names separated by commas, like softmax,group_norm")
    return names


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
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true", help="no live progress display")
    g.add_argument("--llm-base-url", help="OpenAI-compatible endpoint (the API key comes from the environment)")
    g.add_argument("--llm-model", help="model name at that endpoint")


def _trusted_key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-key", type=Path, action="append", metavar="PUBKEY", dest="trusted_keys",
                   help="refuse the package unless this Ed25519 public key (PEM) signed it; repeat for several")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kforge", description="Generated, verified, guarded CUDA kernels for "
                                                                "unmodified PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="capture a model, search kernels, package the winners")
    p.add_argument("model", nargs="?", help="model.py (defining get_model() and get_inputs()) or pkg.module:factory")
    p.add_argument("--out", default="model.cast", help="package to write (default model.cast)")
    p.add_argument("--run-dir", type=Path, help="where cards and the search log go")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir without capturing")
    p.add_argument("--no-model-check", action="store_true",
                   help="do not time the model eager and with the package at the end")
    _search_options(p)

    p = sub.add_parser("capture", help="record the operators a model runs as cards")
    p.add_argument("model", help="model.py (defining get_model() and get_inputs()) or pkg.module:factory")
    p.add_argument("--run-dir", type=Path,
                   help="where the cards go (created; default: a new temporary directory, printed at the end)")

    p = sub.add_parser("search", help="search kernels for the cards of a run directory")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--cards", nargs="+", metavar="ID", help="only these card ids")
    _search_options(p)

    p = sub.add_parser("package", help="write the winners of a run directory into a .cast package")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sign", type=Path, metavar="KEYFILE",
                   help="sign the package with this Ed25519 private key (PEM; make a pair with `openssl genpkey "
                        "-algorithm ed25519 -out key.pem && openssl pkey -in key.pem -pubout -out key.pub.pem`)")

    p = sub.add_parser("inspect", help="show a run directory or a .cast package")
    p.add_argument("path", type=Path)
    _trusted_key_option(p)

    p = sub.add_parser("verify", help="check a .cast package: checksums and format, then re-run its dispatched "
                                      "kernels on this GPU")
    p.add_argument("path", type=Path)
    _trusted_key_option(p)

    p = sub.add_parser("dash", help="serve the dashboard over run directories")
    p.add_argument("run_dirs", nargs="*", type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8050)

    sub.add_parser("doctor", help="what kforge finds of CUDA, the driver and NVRTC")
    return parser


def _search_kwargs(args: argparse.Namespace) -> dict:
    options = {k: v for k, v in (("base_url", args.llm_base_url), ("model", args.llm_model)) if v}
    return dict(proposer=args.proposer, iterations=args.iterations, wall_time_s=args.wall_time,
                max_cost_usd=args.max_cost, min_share=args.min_share, include_vendor=args.include_vendor,
                devices=args.devices, seed=args.seed, progress=not args.no_progress, proposer_options=options,
                ops=args.ops)


# Search options as (dest, flag): a resume hint repeats those that differ from the defaults.
_SEARCH_FLAGS = (("proposer", "--proposer"), ("iterations", "--iterations"), ("wall_time", "--wall-time"),
                 ("max_cost", "--max-cost"), ("min_share", "--min-share"), ("include_vendor", "--include-vendor"),
                 ("ops", "--ops"),
                 ("devices", "--devices"), ("seed", "--seed"), ("llm_base_url", "--llm-base-url"),
                 ("llm_model", "--llm-model"))


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
            words += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return shlex.join(words)


def _report(result, console: Console) -> int:
    console.print(result.rich_table())
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


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from . import runner

    if args.resume:
        if args.run_dir is None:
            raise KforgeError("--resume needs --run-dir: the directory of the run to continue")
        result = runner.run(out=args.out, run_dir=args.run_dir, resume=True, **_search_kwargs(args))
    else:
        if args.model is None:
            raise KforgeError("kforge run needs a model file (model.py) or pkg.module:factory")
        from .modelspec import load_model_spec

        model, inputs = load_model_spec(args.model)
        result = runner.run(model, inputs, out=args.out, run_dir=args.run_dir, model_name=args.model,
                            check_model=not args.no_model_check, **_search_kwargs(args))
    return _report(result, console)


def cmd_capture(args: argparse.Namespace, console: Console) -> int:
    from .capture import capture, cards_table
    from .modelspec import load_model_spec

    model, inputs = load_model_spec(args.model)
    result = capture(model, inputs, args.run_dir)
    console.print(cards_table(result.cards))
    console.print(f"{len(result.cards)} cards written to {result.run_dir}")
    return 0


def cmd_search(args: argparse.Namespace, console: Console) -> int:
    from . import runner

    return _report(runner.search_run(args.run_dir, cards=args.cards, **_search_kwargs(args)), console)


def cmd_package(args: argparse.Namespace, console: Console) -> int:
    from .package import write_package

    console.print(f"package: [bold]{escape(str(write_package(args.run_dir, args.out, sign_key=args.sign)))}[/]")
    return 0


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    path: Path = args.path
    if path.is_dir():
        return _inspect_run(path, console)
    if path.suffix == ".cast" and path.is_file():
        return _inspect_package(path, args, console)
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


def _inspect_package(path: Path, args: argparse.Namespace, console: Console) -> int:
    pkg, _, summary, caught = _load_package(path, args.trusted_keys)
    console.print(f"{escape(str(path))}: built for {escape(pkg.gpu)} ({pkg.arch}); {summary}; {pkg.integrity}")
    console.print(pkg.report(fmt="table"))
    _notes(caught, console)
    return 0


def _inspect_run(run_dir: Path, console: Console) -> int:
    from .cards import load_cards
    from .log import LOG_NAME, connect
    from .runner import card_results, results_table

    if not (run_dir / LOG_NAME).exists():
        cards = load_cards(run_dir)
        if not cards:
            raise KforgeError(f"{run_dir} holds no cards and no search log: run `kforge capture` or `kforge run`")
        from .capture import cards_table

        console.print(cards_table(cards))
        console.print(f"{len(cards)} cards, not searched yet: `kforge search {run_dir}`")
        return 0
    conn = connect(run_dir, readonly=True)
    try:
        run = conn.execute("SELECT * FROM runs ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
        if run is None:
            raise KforgeError(f"the search log in {run_dir} has no run yet")
        console.print(f"run [bold]{run['id']}[/] ({run['status']}) model {run['model'] or '-'} on "
                      f"{run['device'] or '-'} {run['arch'] or ''}, torch {run['torch'] or '-'}")
        console.print(results_table(card_results(conn, run["id"]), "cards"))
        tokens, cost = conn.execute("SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0), "
                                    "COALESCE(SUM(cost_usd), 0) FROM llm_calls WHERE run_id=?", (run["id"],)).fetchone()
        if tokens or cost:
            console.print(f"LLM: {tokens} tokens, ${cost:.4f}")
        if run["status"] in ("interrupted", "running"):
            console.print(f"resume with: kforge search {run_dir}")
    finally:
        conn.close()
    return 0


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    """Re-validate every dispatched kernel of a package on this GPU; 1 if any fails."""
    pkg, packaged, summary, caught = _load_package(args.path, args.trusted_keys)
    console.print(f"{escape(str(args.path))}: checksums and format ok; {summary}; {pkg.integrity}")
    _notes(caught, console)
    if not packaged:
        console.print("no kernel to re-run: every card falls back to PyTorch")
        return 0
    results = pkg.verify()
    t = Table(title=f"verify {args.path.name}", title_justify="left")
    for col in ("card", "verdict", "speedup", "message"):
        t.add_column(col, overflow="fold")
    for card_id, r in results.items():
        t.add_row(card_id, r.verdict.value, f"{r.speedup:.2f}x" if r.speedup else "-", escape(r.message))
    console.print(t)
    failed = [c for c, r in results.items() if r.verdict.failed]
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


def cmd_doctor(args: argparse.Namespace, console: Console) -> int:
    from .cuda import cuda_status

    t = Table(title="kforge doctor", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("status", overflow="fold")  # paths whole, folded, never cut with an ellipsis
    for key, value in cuda_status().items():
        shown = ("none found" if value is None or value == [] else value if isinstance(value, str)
                 else json.dumps(value, default=str))
        t.add_row(str(key), shown)
    from .dispatch import native_status

    native, why = native_status("CUDA")
    t.add_row("dispatch", f"{'C++' if native else 'Python'}: {why}")
    console.print(t)
    return 0


COMMANDS = {"run": cmd_run, "capture": cmd_capture, "search": cmd_search, "package": cmd_package,
            "inspect": cmd_inspect, "verify": cmd_verify, "dash": cmd_dash, "doctor": cmd_doctor}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console, err = Console(), Console(stderr=True)
    from .runner import RunInterrupted

    try:
        return COMMANDS[args.command](args, console)
    except RunInterrupted as e:
        err.print(f"[yellow]interrupted[/]: everything evaluated so far is in {escape(str(e.run_dir))}. "
                  f"Resume with:\n  {escape(_resume_command(args, e.run_dir))}", soft_wrap=True, highlight=False)
        return 130
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return 130
    except KforgeError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 1
