"""Secrets out of every text kforge stores, shows or sends, and a cap on its size.

Texts that come back from a compile, a run or an LLM (compile logs, error messages, a
reply's source and notes) go into the search log, the dashboard, packages and the next
prompt. Any of them could hold a secret: a kernel that made NVRTC echo a host file, or a
reply that repeats the API key. `scrub` replaces the LLM API key and the value of every
secret-looking environment variable (its name says KEY, TOKEN, SECRET, PASSWORD, ...), and
anything shaped like a provider key, with `***`, and cuts the text to a size limit.
"""

from __future__ import annotations

import os
import re

MAX_TEXT = 64 << 10  # characters kept of one stored text (a compile log, a message)
# `_PWD` (MYSQL_PWD), not PWD: the working directory is no secret, and every path in a log holds it.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|_PWD|CRED|AUTH|PRIVATE|SESSION|COOKIE|SIGNATURE|DSN", re.I)
_MIN_SECRET = 8  # shorter values ("1", "true") would blank ordinary words
# Provider key shapes: OpenAI/Anthropic/DeepSeek sk-..., Google AIza..., HF hf_..., GitHub gh?_...,
# AWS access key ids, bearer tokens, and the user:password of a URL (postgres://u:p@host).
_KEY_SHAPES = re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|AIza[0-9A-Za-z_-]{30,}|hf_[A-Za-z0-9]{20,}"
                         r"|gh[pousr]_[A-Za-z0-9]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|(?:AKIA|ASIA)[0-9A-Z]{16})\b"
                         r"|(?i:bearer\s+)[A-Za-z0-9._~+/-]{16,}=*|(?<=://)[^\s/@:]+:[^\s/@]+(?=@)")
MASK = "***"

_extra: set[str] = set()


def register(secret: str | None) -> None:
    """Also scrub this value from now on (an API key given by flag or config file)."""
    if secret and len(secret) >= _MIN_SECRET:
        _extra.add(secret)


def secrets(environ: dict[str, str] | None = None) -> list[str]:
    """Values to scrub, longest first (so a key containing another is masked whole)."""
    env = os.environ if environ is None else environ
    found = set(_extra)
    for name, value in env.items():
        if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET:
            found.add(value)
    return sorted(found, key=len, reverse=True)


def scrub(text: str | None, limit: int | None = MAX_TEXT) -> str:
    """`text` with secrets masked and cut to `limit` characters (None: no cut)."""
    if not text:
        return text or ""
    for s in secrets():
        if s in text:
            text = text.replace(s, MASK)
    text = _KEY_SHAPES.sub(MASK, text)
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"\n[... {len(text) - limit} more characters cut by kforge]"
    return text
