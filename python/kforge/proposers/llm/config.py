"""Where the LLM proposer's endpoint, model, key, prices and budgets come from.

Precedence, highest first: explicit arguments (CLI flags) > environment > config file >
defaults. The config file is TOML or JSON (by suffix), named by the `config_file` argument
or $KFORGE_LLM_CONFIG, with the same keys as LLMConfig plus a price table:

    base_url = "http://localhost:8000/v1"
    model = "qwen3-coder"
    max_cost_usd = 5.0
    max_reply_tokens = 4096       # default 8192, 32768 for reasoning models
    temperature = "none"          # a number, or "none" to send none (default 0.7; none for reasoning models)
    top_p = 0.95
    reasoning_effort = "high"     # sent as is (OpenAI-style reasoning models)
    extra_headers = {"X-Team" = "kernels"}
    extra_body = {top_k = 20}     # merged into the request body (vLLM, Ollama, ... options)
    [prices."qwen3-coder"]        # USD per 1M tokens; the table in prices.py covers the big providers
    prompt = 0.0
    completion = 0.0

Environment variables:
  KFORGE_LLM_BASE_URL (or OPENAI_BASE_URL)   endpoint, e.g. http://localhost:8000/v1
  KFORGE_LLM_MODEL                           model name as the endpoint knows it
  KFORGE_LLM_API_KEY (or OPENAI_API_KEY)     the key; never logged, stored or shown
  KFORGE_LLM_CONFIG                          path of the config file (or --llm-config)

The key is held in a Secret whose repr and str are masked, so printing or logging a config
cannot leak it, and `public()` (what goes into a search log's run config) leaves it out, and
the values of extra headers with it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ...env import llm_environment
from ...errors import LLMError
from .prices import PRICES, PRICES_AS_OF, find_price

OPENAI_URL = "https://api.openai.com/v1"

REPLY_TOKENS = 8192
# Reasoning models spend most of a reply's tokens thinking before the answer, and the limit
# covers both: 8192 leaves some with nothing left for the code.
REASONING_REPLY_TOKENS = 32768
DEFAULT_TEMPERATURE = 0.7
_REASONING = re.compile(r"^(o\d+(-|$)|gpt-5|gpt-oss|deepseek-r1|deepseek-reasoner|qwq|magistral|gemini-2\.5|grok-4"
                        r"|grok-3-mini)"
                        r"|thinking|reasoner|reasoning|-r1(\b|-|$)")


def is_reasoning_model(model: str) -> bool:
    """A model that thinks before it answers (o-series, gpt-5, DeepSeek-R1, QwQ, ...), by name."""
    return bool(_REASONING.search(model.rsplit("/", 1)[-1].lower()))


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
    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(PRICES))
    max_cost_usd: float | None = None  # budget over every call of this proposer (the run's is --max-cost)
    max_tokens: int | None = None  # budget of prompt + completion tokens over every call
    max_reply_tokens: int | None = None  # cap of one reply, sent to the endpoint; None: by model (see above)
    temperature: float | str | None = "auto"  # a number; "none" sends none; "auto": 0.7, none for reasoning models
    top_p: float | None = None
    reasoning_effort: str | None = None  # e.g. low | medium | high, for models that take it
    extra_headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request's JSON body
    max_repair_attempts: int = 3  # re-asks after a malformed reply, and repair rounds

    def __post_init__(self) -> None:
        if not self.model:
            raise LLMError("no LLM model given: pass --llm-model or set KFORGE_LLM_MODEL")
        if self.api_key is not None and not isinstance(self.api_key, Secret):
            object.__setattr__(self, "api_key", Secret(str(self.api_key)))
        if self.max_retries < 0 or self.max_repair_attempts < 0 or self.timeout_s <= 0:
            raise LLMError("max_retries and max_repair_attempts must be >= 0 and timeout_s > 0")
        reasoning = is_reasoning_model(self.model)
        if self.max_reply_tokens is None:
            object.__setattr__(self, "max_reply_tokens", REASONING_REPLY_TOKENS if reasoning else REPLY_TOKENS)
        elif isinstance(self.max_reply_tokens, bool) or not isinstance(self.max_reply_tokens, int) \
                or self.max_reply_tokens < 1:
            raise LLMError(f"max_reply_tokens must be a whole number >= 1, got {self.max_reply_tokens!r}")
        object.__setattr__(self, "temperature", _temperature(self.temperature, reasoning))
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise LLMError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        for name in ("extra_headers", "extra_body"):
            if not isinstance(getattr(self, name), Mapping):
                raise LLMError(f"{name} must be a table of names and values, got {getattr(self, name)!r}")
        if self.max_cost_usd is not None:
            self.require_price("max_cost_usd")

    def price(self) -> tuple[float, float] | None:
        """USD per 1M (prompt, completion) tokens (prices.find_price), None when unpriced."""
        return find_price(self.model, self.prices)

    def require_price(self, budget: str) -> tuple[float, float]:
        """The price, or an LLMError saying how to give one: a cost budget cannot be kept
        on calls whose cost is unknown."""
        price = self.price()
        if price is None:
            raise LLMError(
                f"model {self.model!r} has no known price (table of {PRICES_AS_OF}), so the cost budget "
                f"({budget}) cannot be kept; give its price in USD per 1M tokens with --llm-price PROMPT,COMPLETION "
                f"(0,0 for a free local model) or a [prices.\"{self.model}\"] table in the --llm-config file")
        return price

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        p, c = self.price() or (0.0, 0.0)  # unpriced runs only without a cost budget (require_price)
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
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("api_key", "prices")}
        d["price"] = list(self.price()) if self.price() else None
        d["extra_headers"] = sorted(self.extra_headers)  # names only: values may be credentials
        d["api_key_set"] = self.api_key is not None
        return d

    @staticmethod
    def resolve(config_file: str | Path | None = None, environ: Mapping[str, str] | None = None,
                **flags: Any) -> "LLMConfig":
        """Build a config from flags > environment > config file > defaults.
        Flags that are None count as not given."""
        from_env = llm_environment(environ)
        path = config_file or from_env.pop("config")
        values: dict[str, Any] = _read_file(Path(path)) if path else {}
        values.update({k: v for k, v in from_env.items() if v})
        values.update({k: v for k, v in flags.items() if v is not None})
        # `price` (--llm-price): the price of the model in use, whatever its name resolves to.
        price = values.pop("price", None)
        known = {f.name for f in fields(LLMConfig)}
        unknown = set(values) - known
        if unknown:
            raise LLMError(f"unknown LLM settings {sorted(unknown)}; known: {sorted(known | {'price'})}")
        if "prices" in values or price is not None:
            given = _prices(values.get("prices", {}))
            if price is not None:
                given.update(_prices({values.get("model") or "the model": price}))
            values["prices"] = {**PRICES, **given}
        return LLMConfig(**{"model": "", **values})


def _prices(table: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """{"model": {"prompt": p, "completion": c}}, {"model": [p, c]} or {"model": "p,c"} -> {"model": (p, c)}."""
    out = {}
    for model, v in table.items():
        try:
            p, c = (v["prompt"], v["completion"]) if isinstance(v, Mapping) else v.split(",") if isinstance(v, str) else v
            out[model] = (float(p), float(c))
            if min(out[model]) < 0 or not all(map(math.isfinite, out[model])):
                raise ValueError("negative or not finite")
        except (KeyError, TypeError, ValueError) as e:
            raise LLMError(f"price of {model!r} must be {{prompt = USD/1M, completion = USD/1M}}, got {v!r}") from e
    return out


def _temperature(value: Any, reasoning: bool) -> float | None:
    """The temperature to send: "auto" is 0.7, or none for a reasoning model (they reject
    any but their default); "none" (or None) sends none."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("auto", "none", "default"):
        return None if value.strip().lower() != "auto" or reasoning else DEFAULT_TEMPERATURE
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = -1.0
    if isinstance(value, bool) or not 0.0 <= t <= 2.0:
        raise LLMError(f"temperature must be a number from 0 to 2 or \"none\", got {value!r}")
    return t


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise LLMError(f"cannot read LLM config {path}: {e.strerror}; fix --llm-config or KFORGE_LLM_CONFIG") from e
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
