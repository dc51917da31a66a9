"""kforge.env: the environment variables kforge reads, each with its effect."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "import logging, kforge; logging.getLogger('kforge.package').info('packaged it')"


def _run(level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KFORGE_LOG_LEVEL"}
    if level is not None:
        env["KFORGE_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)


def test_kforge_log_level_shows_the_kforge_loggers_records_on_stderr():
    shown, silent = _run("info"), _run(None)
    assert shown.returncode == 0 and "INFO kforge.package: packaged it" in shown.stderr
    assert silent.returncode == 0 and "packaged it" not in silent.stderr


def test_a_kforge_log_level_that_is_no_level_says_which_are():
    out = _run("chatty")
    assert out.returncode != 0 and "KFORGE_LOG_LEVEL='CHATTY' is not a logging level: use DEBUG, INFO" in out.stderr
