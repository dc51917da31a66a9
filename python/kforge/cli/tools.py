"""kforge dash (the dashboard) and kforge doctor (what works on this machine)."""

from __future__ import annotations

import argparse
import importlib
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import KforgeError
from .output import emit
from .parser import llm_settings


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
    from ..cuda import cuda_status
    from ..dispatch import native_status

    status = cuda_status()
    native, why = native_status("CUDA")
    advice = _without_gpu(status)
    llm = _llm_rows(llm_settings(args))
    cluster = _cluster_report(args.cluster) if args.cluster else None
    if args.json:
        return emit({**status, "dispatch": {"native": native, "why": why}, "without_gpu": advice, "llm": dict(llm),
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
    from ..cluster import ray_address
    from ..cluster.nodes import cluster_report

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
    from ..errors import LLMError
    from ..proposers.llm.config import LLMConfig
    from ..proposers.llm.prices import PRICES, PRICES_AS_OF, find_price

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
