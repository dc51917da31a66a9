"""Where a benchmark result comes from, recorded the same way by every script whose results
bench/scoreboard.py reads: date, device, torch, commit, how many tracked files differ from it
(a device that runs a copy of the working tree may hold an older .git: the commit alone would
name code that was not the code measured) and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


HERE = Path(__file__).parent


def _git(*args: str, where: Path = HERE) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=where,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def commit(where: Path = HERE) -> str | None:
    """KFORGE_COMMIT where the caller names the commit it sent (a copied tree's .git may be older
    than its files), else the checkout's commit, or None where the tree was copied without .git
    (the scoreboard then names the commit that added the result file)."""
    if os.environ.get("KFORGE_COMMIT"):
        return os.environ["KFORGE_COMMIT"]
    out = _git("rev-parse", "--short", "HEAD", where=where)
    return out.strip() or None if out is not None else None


def uncommitted(where: Path = HERE) -> int | None:
    """How many tracked files differ from that commit (None without git, or where KFORGE_COMMIT
    names it: the local .git cannot tell)."""
    if os.environ.get("KFORGE_COMMIT"):
        return None
    out = _git("status", "--porcelain", "--untracked-files=no", where=where)
    return None if out is None else len([line for line in out.splitlines() if line.strip()])


def libraries() -> dict:
    """Versions of the model libraries that are imported: a model built from transformers or timm
    traces differently from one version to the next (its attention mask, its GQA path)."""
    return {name: getattr(sys.modules[name], "__version__", "?") for name in ("transformers", "timm", "diffusers")
            if name in sys.modules}


def provenance() -> dict:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "libraries": libraries(), "commit": commit(),
            "uncommitted_files": uncommitted(), "command": " ".join(["python", *sys.argv])}
