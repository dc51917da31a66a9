"""The `kforge` command line's parser: argument types, the option groups the commands share, and
what the search commands pass on to kforge.runner."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path


from ..errors import EXIT_CODE_HELP, ExitCode


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


def llm_settings(args: argparse.Namespace) -> dict:
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
    from .. import __version__

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


def search_kwargs(args: argparse.Namespace) -> dict:
    options = llm_settings(args)
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


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
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
