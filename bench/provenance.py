"""Where a benchmark result comes from, recorded the same way by every script whose results
bench/scoreboard.py reads: date, device, torch, commit and the command line."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def commit() -> str | None:
    """The checkout's commit, or None where the tree was copied without .git (the scoreboard
    then names the commit that added the result file)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commit": commit(), "command": " ".join(["python", *sys.argv])}
