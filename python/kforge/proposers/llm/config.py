"""Where the LLM proposer's endpoint, model, key, prices and budgets come from.

Precedence, highest first: explicit arguments (CLI flags) > environment > config file >
defaults. The config file is TOML or JSON (by suffix), named by the `config_file` argument
or $KFORGE_LLM_CONFIG, with the same keys as LLMConfig plus a price table:

    base_url = "http://localhost:8000/v1"
    model = "qwen3-coder"
    max_cost_usd = 5.0
    [prices."qwen3-coder"]        # USD per 1M tokens
    prompt = 0.0
    completion = 0.0

Environment variables:
  KFORGE_LLM_BASE_URL (or OPENAI_BASE_URL)   endpoint, e.g. http://localhost:8000/v1
  KFORGE_LLM_MODEL                           model name as the endpoint knows it
  KFORGE_LLM_API_KEY (or OPENAI_API_KEY)     the key; never logged, stored or shown
  KFORGE_LLM_CONFIG                          path of the config file

The key is held in a Secret whose repr and str are masked, so printing or logging a config
cannot leak it, and `public()` (what goes into a search log's run config) leaves it out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ...errors import LLMError

OPENAI_URL = "https://api.openai.com/v1"

# USD per 1M (prompt, completion) tokens, list prices when this table was written. Models
# not listed (local servers, new models) cost 0 unless the config file prices them.
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "o3": (2.00, 8.00),
    "o4-mini": (1.10, 4.40),
}


class Secret:
    """A string that does not show itself: repr/str are masked; `reveal()` gives the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class LLMConfig:
    model: str
    base_url: str = OPENAI_URL
    api_key: Secret | None = None
    timeout_s: float = 120.0  # per attempt
    max_retries: int = 4  # retries after the first attempt, on 429 / 5xx / timeouts / connection errors
    max_retry_wait_s: float = 60.0  # longest backoff or Retry-After we sleep through
    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    max_cost_usd: float | None = None  # budget over every call of this proposer
    max_tokens: int | None = None  # budget of prompt + completion tokens over every call
    max_reply_tokens: int = 8192  # cap of one reply, sent to the endpoint
    temperature: float | None = 0.7  # None: leave it to the endpoint (some models reject it)
    max_repair_attempts: int = 3  # re-asks after a malformed reply, and repair rounds

    def __post_init__(self) -> None:
        if not self.model:
            raise LLMError("no LLM model given: pass --llm-model or set KFORGE_LLM_MODEL")
        if self.api_key is not None and not isinstance(self.api_key, Secret):
            object.__setattr__(self, "api_key", Secret(str(self.api_key)))
        if self.max_retries < 0 or self.max_repair_attempts < 0 or self.timeout_s <= 0:
            raise LLMError("max_retries and max_repair_attempts must be >= 0 and timeout_s > 0")

    def price(self) -> tuple[float, float]:
        """USD per 1M (prompt, completion) tokens: exact model name, else the longest listed
        prefix (dated snapshots such as gpt-4o-2024-08-06), else free."""
        if self.model in self.prices:
            return self.prices[self.model]
        prefixes = [k for k in self.prices if self.model.startswith(k)]
        return self.prices[max(prefixes, key=len)] if prefixes else (0.0, 0.0)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        p, c = self.price()
        return (prompt_tokens * p + completion_tokens * c) / 1e6

    def key_for_client(self) -> str:
        """What to hand the openai client. Local servers ignore the key, but the client
        requires one; OpenAI itself does not, so a missing key there is an error now rather
        than a 401 later."""
        if self.api_key is not None:
            return self.api_key.reveal()
        if self.base_url.rstrip("/") == OPENAI_URL:
            raise LLMError(f"no API key for {OPENAI_URL}: set KFORGE_LLM_API_KEY (or OPENAI_API_KEY)")
        return "no-key"

    def public(self) -> dict[str, Any]:
        """Everything but the key, JSON-ready (for the search log's run config)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "api_key"}
        d["prices"] = {k: list(v) for k, v in self.prices.items()}
        d["api_key_set"] = self.api_key is not None
        return d

    @staticmethod
    def resolve(config_file: str | Path | None = None, environ: Mapping[str, str] | None = None,
                **flags: Any) -> "LLMConfig":
        """Build a config from flags > environment > config file > defaults.
        Flags that are None count as not given."""
        env = os.environ if environ is None else environ
        path = config_file or env.get("KFORGE_LLM_CONFIG")
        values: dict[str, Any] = _read_file(Path(path)) if path else {}
        from_env = {
            "base_url": env.get("KFORGE_LLM_BASE_URL") or env.get("OPENAI_BASE_URL"),
            "model": env.get("KFORGE_LLM_MODEL"),
            "api_key": env.get("KFORGE_LLM_API_KEY") or env.get("OPENAI_API_KEY"),
        }
        values.update({k: v for k, v in from_env.items() if v})
        values.update({k: v for k, v in flags.items() if v is not None})
        known = {f.name for f in fields(LLMConfig)}
        unknown = set(values) - known
        if unknown:
            raise LLMError(f"unknown LLM settings {sorted(unknown)}; known: {sorted(known)}")
        if "prices" in values:
            values["prices"] = {**DEFAULT_PRICES, **_prices(values["prices"])}
        return LLMConfig(**{"model": "", **values})


def _prices(table: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """{"model": {"prompt": p, "completion": c}} or {"model": [p, c]} -> {"model": (p, c)}."""
    out = {}
    for model, v in table.items():
        try:
            p, c = (v["prompt"], v["completion"]) if isinstance(v, Mapping) else v
            out[model] = (float(p), float(c))
        except (KeyError, TypeError, ValueError) as e:
            raise LLMError(f"price of {model!r} must be {{prompt = USD/1M, completion = USD/1M}}, got {v!r}") from e
    return out


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise LLMError(f"cannot read LLM config {path}: {e.strerror}; fix KFORGE_LLM_CONFIG or --llm-config") from e
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import tomllib  # Python 3.11+; JSON configs work everywhere

            data = tomllib.loads(text)
    except ModuleNotFoundError as e:
        raise LLMError(f"reading TOML needs Python 3.11+; write {path} as JSON instead") from e
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise LLMError(f"LLM config {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from e
    if not isinstance(data, dict):
        raise LLMError(f"LLM config {path} must hold a table of settings")
    return data
