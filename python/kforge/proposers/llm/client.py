"""One chat completion at a time against an OpenAI-compatible endpoint, with retries,
budgets and per-call accounting.

The `openai` package does the HTTP; its own retries are off (max_retries=0) so that every
attempt is visible here: each one is reported to `on_call` as a CallRecord (status ok,
retry or error) for the search log, and counts against the budget. Transient failures
(429, 5xx, timeouts, connection errors) are retried with exponential backoff and jitter,
or after the server's Retry-After; everything else becomes an LLMError saying what to fix.
The API key never appears in a record, a message or a log line: any text that comes back
from the server is scrubbed of it before it goes anywhere.
"""

from __future__ import annotations

import email.utils
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable

from ...errors import BudgetExhausted, LLMError
from ...redact import register, scrub
from .config import LLMConfig

logger = logging.getLogger("kforge.llm")

CHARS_PER_TOKEN = 4  # rough size of a token, for estimates when the endpoint reports no usage
BACKOFF_BASE_S = 1.0
RETRY_STATUS = {408, 409, 429}  # plus every 5xx


@dataclass(frozen=True)
class CallRecord:
    """One attempt at a chat completion, as the search log stores it (no key, no text)."""

    model: str
    base_url: str
    status: str  # ok | retry | error
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    duration_s: float
    card_id: str | None = None
    error: str | None = None
    estimated: bool = False  # tokens estimated from characters: the endpoint reported no usage


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    duration_s: float


@dataclass
class Totals:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


class _Transient(Exception):
    """An attempt failed in a way another attempt may not: wait `delay_s`, then retry."""

    def __init__(self, message: str, delay_s: float | None):
        super().__init__(message)
        self.delay_s = delay_s


class LLMClient:
    """Chat completions with retries, budgets and accounting. Not thread-safe (one search
    drives one proposer)."""

    def __init__(self, config: LLMConfig, *, on_call: Callable[[CallRecord], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None):
        import openai  # optional dependency: only the LLM proposer needs it

        self.config = config
        self.on_call = on_call
        self.totals = Totals()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._openai = openai
        register(config.api_key.reveal() if config.api_key else None)
        self._client = openai.OpenAI(base_url=config.base_url, api_key=config.key_for_client(),
                                     timeout=config.timeout_s, max_retries=0)
        # Sampling parameters; _adapt() rewrites them once if the model rejects one.
        self._params: dict[str, float | int] = {"max_tokens": config.max_reply_tokens}
        if config.temperature is not None:
            self._params["temperature"] = config.temperature

    def close(self) -> None:
        self._client.close()

    def chat(self, messages: list[dict[str, str]], card_id: str | None = None) -> Reply:
        """The model's reply to `messages`. Raises BudgetExhausted before a call that could
        exceed the cost or token budget, and LLMError when the endpoint refuses or stays down."""
        self._check_budget(messages)
        attempts = self.config.max_retries + 1
        attempt = 0
        while True:
            start = time.monotonic()
            try:
                response = self._create(messages)
            except self._openai.OpenAIError as e:
                adapted = self._adapt(e)
                if adapted:
                    self._record("retry", 0, 0, time.monotonic() - start, card_id, error=adapted)
                    continue
                failure = self._classify(e)
                final = not isinstance(failure, _Transient) or attempt == attempts - 1
                self._record("error" if final else "retry", 0, 0, time.monotonic() - start, card_id,
                             error=str(failure))
                if not isinstance(failure, _Transient):
                    raise failure from None
                if final:
                    raise LLMError(
                        f"{self.config.base_url} gave no reply after {attempts} attempts (last: {failure}); "
                        f"check the endpoint is up, or raise the timeout ({self.config.timeout_s:g} s) "
                        f"or max_retries ({self.config.max_retries})") from None
                delay = self._delay(attempt, failure.delay_s)
                logger.warning("LLM call failed (%s); retry %d/%d in %.1f s", failure, attempt + 1,
                               self.config.max_retries, delay)
                self._sleep(delay)
                attempt += 1
                continue
            return self._accept(messages, response, time.monotonic() - start, card_id)

    # ---- one attempt ---------------------------------------------------------------------
    def _create(self, messages: list[dict[str, str]]):
        return self._client.chat.completions.create(model=self.config.model, messages=messages, **self._params)

    def _adapt(self, e: Exception) -> str | None:
        """Reasoning models (o-series, gpt-5) reject `max_tokens` for `max_completion_tokens`
        and any temperature but the default. Rewrite the request once and say so; None when
        the error is not one of these."""
        if not isinstance(e, self._openai.BadRequestError):
            return None
        detail = _detail(e)
        if "max_tokens" in self._params and "max_completion_tokens" in detail:
            self._params["max_completion_tokens"] = self._params.pop("max_tokens")
            return "endpoint wants max_completion_tokens instead of max_tokens; resent"
        if "temperature" in self._params and "temperature" in detail:
            del self._params["temperature"]
            return "endpoint rejects a temperature for this model; resent without one"
        return None

    def _accept(self, messages, response, duration: float, card_id: str | None) -> Reply:
        choice = response.choices[0] if response.choices else None
        # A reply that repeats a secret must not carry it into the log or the next prompt.
        text = scrub((choice.message.content if choice and choice.message else None) or "", limit=None)
        usage = response.usage
        estimated = usage is None or usage.prompt_tokens is None or usage.completion_tokens is None
        if estimated:
            prompt = estimate_tokens("".join(m["content"] for m in messages))
            completion = estimate_tokens(text)
        else:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
        cost = self.config.cost(prompt, completion)
        self.totals.calls += 1
        self.totals.prompt_tokens += prompt
        self.totals.completion_tokens += completion
        self.totals.cost_usd += cost
        self._record("ok", prompt, completion, duration, card_id, estimated=estimated, cost=cost)
        return Reply(text, choice.finish_reason if choice else None, prompt, completion, cost, duration)

    def _record(self, status: str, prompt: int, completion: int, duration: float, card_id: str | None, *,
                error: str | None = None, estimated: bool = False, cost: float = 0.0) -> None:
        if self.on_call is not None:
            self.on_call(CallRecord(self.config.model, self.config.base_url, status, prompt, completion, cost,
                                    duration, card_id, error, estimated))

    # ---- failures ------------------------------------------------------------------------
    def _classify(self, e: Exception) -> Exception:
        """An LLMError for what retrying cannot fix, else a _Transient with the server's
        requested delay (if any)."""
        o = self._openai
        url, model = self.config.base_url, self.config.model
        if isinstance(e, o.APITimeoutError):
            return _Transient(f"timed out after {self.config.timeout_s:g} s", None)
        if isinstance(e, o.APIConnectionError):
            return _Transient(f"cannot connect to {url}: {scrub(str(e.__cause__ or e))}", None)
        if not isinstance(e, o.APIStatusError):
            return LLMError(f"unexpected reply from {url}: {scrub(str(e))}")
        status, detail = e.status_code, scrub(_detail(e))
        if status in RETRY_STATUS or status >= 500:
            return _Transient(f"HTTP {status}: {detail}", _retry_after(e.response.headers))
        if status in (401, 403):
            return LLMError(f"{url} refused the API key (HTTP {status}: {detail}); "
                            "check KFORGE_LLM_API_KEY (or OPENAI_API_KEY)")
        if status == 404:
            return LLMError(f"model {model!r} not found at {url} (HTTP 404: {detail}); check KFORGE_LLM_MODEL "
                            f"against GET {url.rstrip('/')}/models, and that the base URL ends where /chat "
                            "/completions begins (often .../v1)")
        return LLMError(f"{url} rejected the request (HTTP {status}: {detail})")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """The server's Retry-After when it gave one, else exponential backoff with full
        jitter (so parallel searches do not retry in lockstep); capped either way."""
        if retry_after is not None:
            return min(retry_after, self.config.max_retry_wait_s)
        return min(self.config.max_retry_wait_s, BACKOFF_BASE_S * 2 ** attempt) * self._rng.uniform(0.5, 1.0)

    # ---- budget --------------------------------------------------------------------------
    def _check_budget(self, messages: list[dict[str, str]]) -> None:
        """Refuse a call whose worst case (estimated prompt + a full reply) would pass a budget,
        so the budget holds as a hard limit."""
        c = self.config
        prompt = estimate_tokens("".join(m["content"] for m in messages))
        if c.max_tokens is not None and self.totals.tokens + prompt + c.max_reply_tokens > c.max_tokens:
            raise BudgetExhausted(
                f"LLM token budget: {self.totals.tokens} used, the next call may take up to "
                f"{prompt + c.max_reply_tokens} more, over the limit of {c.max_tokens}; raise max_tokens to go on")
        worst = c.cost(prompt, c.max_reply_tokens)
        if c.max_cost_usd is not None and self.totals.cost_usd + worst > c.max_cost_usd:
            raise BudgetExhausted(
                f"LLM cost budget: ${self.totals.cost_usd:.4f} spent, the next call may cost up to ${worst:.4f}, "
                f"over the limit of ${c.max_cost_usd:.4f}; raise max_cost_usd to go on")


def _detail(e) -> str:
    """The error message inside an OpenAI-style body {"error": {"message": ...}}, else the
    exception's own text."""
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return e.message


def _retry_after(headers) -> float | None:
    """Seconds the server asks us to wait: retry-after-ms, or Retry-After in seconds or as
    an HTTP date."""
    if headers.get("retry-after-ms"):
        try:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def log_recorder(log, run_id: str) -> Callable[[CallRecord], None]:
    """An `on_call` hook that writes each attempt into a SearchLog (llm_calls table)."""

    def record(r: CallRecord) -> None:
        log.add_llm_call(run_id, r.card_id, r.model, prompt_tokens=r.prompt_tokens,
                         completion_tokens=r.completion_tokens, cost_usd=r.cost_usd, duration_s=r.duration_s,
                         status=r.status, error=r.error, base_url=r.base_url)

    return record
