"""One chat completion at a time against an OpenAI-compatible endpoint, with retries,
hard budgets and per-call accounting.

The `openai` package does the HTTP; its own retries are off (max_retries=0) so that every
attempt is visible here: each one is reported to `on_call` as a CallRecord (status ok,
retry or error) for the search log, and counts against the budgets. Transient failures
(429, 5xx, timeouts, connection errors) are retried with exponential backoff and jitter,
or after the server's Retry-After; what retrying cannot fix is a ProposerUnavailable
saying what to fix. A 400 that names a setting the model does not take (max_tokens for
max_completion_tokens, a temperature, a reply limit above what the model or its context
allows) is adapted to once, and the request resent.

The budget is a hard limit. Before every attempt its worst case is reserved: every byte of
the prompt a token, plus the whole reply limit, at the model's price. An attempt is charged
what the endpoint reports, unless that is missing or implausible (negative, more prompt
tokens than bytes sent, more completion tokens than allowed, or too few for the reply's
length): then the worst case. A timed-out attempt may still be billed, so it is charged the
worst case too; refused connections and HTTP errors cost nothing. A reply is cut at
MAX_CHARS_PER_TOKEN characters per allowed token before anything parses or stores it.

The API key never appears in a record, a message or a log line: any text that comes back
from the server, the reply included, goes through redact.scrub (which knows the key and the
extra header values) before it goes anywhere.
"""

from __future__ import annotations

import email.utils
import logging
import math
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import ProposerUnavailable
from ...redact import register, scrub
from ...spend import Hold, Spend
from .config import LLMConfig

logger = logging.getLogger("kforge.llm")

CHARS_PER_TOKEN = 4  # a typical token, for estimates
MAX_CHARS_PER_TOKEN = 16  # no tokenizer packs more on average: the reply cap, and the floor of plausible usage
MESSAGE_OVERHEAD_TOKENS = 8  # what a chat template adds around each message
MIN_REPLY_TOKENS = 512  # below this a kernel does not fit: not worth adapting down to
PREFLIGHT_TIMEOUT_S = 10.0
BACKOFF_BASE_S = 1.0
RETRY_STATUS = {408, 409, 429}  # plus every 5xx
DETAIL_CHARS = 400  # the provider's message, on one line, at most this long


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
    estimated: bool = False  # charged the worst case: usage missing or implausible, or a timeout


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str | None  # "length" also when kforge cut an oversized reply
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


def prompt_ceiling(messages: list[dict[str, str]]) -> int:
    """The most prompt tokens `messages` can be: one per UTF-8 byte, plus the template's."""
    return sum(len(m["content"].encode()) + MESSAGE_OVERHEAD_TOKENS for m in messages) + MESSAGE_OVERHEAD_TOKENS


class _Transient(Exception):
    """An attempt failed in a way another attempt may not: wait `delay_s`, then retry."""

    def __init__(self, message: str, delay_s: float | None):
        super().__init__(message)
        self.delay_s = delay_s


class LLMClient:
    """Chat completions with retries, budgets and accounting. Not thread-safe (one search
    drives one proposer); `ledger`, the run's Spend, may be shared by several clients."""

    def __init__(self, config: LLMConfig, *, on_call: Callable[[CallRecord], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
                 ledger: Spend | None = None):
        import openai  # optional dependency: only the LLM proposer needs it

        self.config = config
        self.on_call = on_call
        self.ledger = ledger
        self.totals = Totals()
        self._own = Spend(max_tokens=config.max_tokens, max_cost_usd=config.max_cost_usd)
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._openai = openai
        # Servers may echo the key, or a header's credential, in error bodies: scrubbed everywhere.
        register(config.api_key.reveal() if config.api_key else None)
        for v in config.extra_headers.values():
            register(v if isinstance(v, str) else None)
        self._client = openai.OpenAI(base_url=config.base_url, api_key=config.key_for_client(),
                                     timeout=config.timeout_s, max_retries=0)
        # Request parameters; _adapt() rewrites them once each if the model rejects one.
        self._params: dict[str, Any] = {"max_tokens": config.max_reply_tokens}
        for name in ("temperature", "top_p", "reasoning_effort"):
            if getattr(config, name) is not None:
                self._params[name] = getattr(config, name)
        if config.extra_headers:
            self._params["extra_headers"] = dict(config.extra_headers)
        if config.extra_body:
            self._params["extra_body"] = dict(config.extra_body)
        self._adapted: set[str] = set()

    def close(self) -> None:
        self._client.close()

    @property
    def reply_limit(self) -> int:
        """The reply tokens asked for now (lowered if the endpoint said it allows fewer)."""
        return self._params.get("max_tokens") or self._params["max_completion_tokens"]

    def chat(self, messages: list[dict[str, str]], card_id: str | None = None) -> Reply:
        """The model's reply to `messages`. Raises BudgetExhausted before an attempt that could
        pass a budget, ProposerUnavailable when the endpoint refuses or stays down."""
        attempts = self.config.max_retries + 1
        attempt = 0
        while True:
            worst_prompt, worst_reply = prompt_ceiling(messages), self.reply_limit
            hold = self._reserve(worst_prompt, worst_reply)
            start = time.monotonic()
            try:
                response = self._create(messages)
            except self._openai.OpenAIError as e:
                # The provider may bill a request we stopped waiting for; nothing else that failed.
                charged = (worst_prompt, worst_reply) if isinstance(e, self._openai.APITimeoutError) else (0, 0)
                cost = self._settle(hold, *charged)
                adapted = self._adapt(e, messages)
                if adapted:
                    self._record("retry", *charged, cost, time.monotonic() - start, card_id, error=adapted)
                    continue
                failure = self._classify(e)
                final = not isinstance(failure, _Transient) or attempt == attempts - 1
                self._record("error" if final else "retry", *charged, cost, time.monotonic() - start, card_id,
                             error=str(failure), estimated=charged[0] > 0)
                if not isinstance(failure, _Transient):
                    raise failure from None
                if final:
                    raise ProposerUnavailable(
                        f"{self.config.base_url} gave no reply after {attempts} attempts (last: {failure}); "
                        f"check the endpoint is up, or raise the timeout ({self.config.timeout_s:g} s) "
                        f"or max_retries ({self.config.max_retries})", transient=True) from None
                delay = self._delay(attempt, failure.delay_s)
                logger.warning("LLM call failed (%s); retry %d/%d in %.1f s", failure, attempt + 1,
                               self.config.max_retries, delay)
                self._sleep(delay)
                attempt += 1
                continue
            return self._accept(response, hold, worst_prompt, worst_reply, time.monotonic() - start, card_id)

    def check_endpoint(self) -> None:
        """One quick look before a run, without retries: the model listed by GET /models, or
        else a one-token completion answered (its few tokens are not charged). Raises
        ProposerUnavailable with the endpoint's error on one line."""
        o = self._openai
        quick = self._client.with_options(timeout=min(PREFLIGHT_TIMEOUT_S, self.config.timeout_s), max_retries=0)
        listed: list[str] = []
        try:
            listed = [m.id for m in quick.models.list()]
        except o.OpenAIError as e:
            # Some endpoints have no model list, or guard it otherwise than completions: only
            # an endpoint that cannot be reached at all is judged by it.
            if not isinstance(e, o.APIStatusError):
                raise self._unavailable(e) from None
        if self.config.model in {name.removeprefix("models/") for name in listed}:
            return
        probe = {k: v for k, v in self._params.items() if k not in ("max_tokens", "max_completion_tokens")}
        try:
            quick.chat.completions.create(model=self.config.model, messages=[{"role": "user", "content": "Say OK."}],
                                          max_tokens=1, **probe)
        except o.BadRequestError:
            return  # the model answered, taking issue with the request: chat() adapts to that
        except o.OpenAIError as e:
            failure = self._unavailable(e)
            if listed and isinstance(e, o.NotFoundError):
                raise ProposerUnavailable(f"{failure} (it lists: {', '.join(sorted(listed)[:12])})") from None
            raise failure from None

    # ---- one attempt ---------------------------------------------------------------------
    def _create(self, messages: list[dict[str, str]]):
        return self._client.chat.completions.create(model=self.config.model, messages=messages, **self._params)

    def _adapt(self, e: Exception, messages: list[dict[str, str]]) -> str | None:
        """Rewrite the request once for a 400 that names a setting this model does not take,
        and say so; None when the error is not one of these (or was adapted to already)."""
        o = self._openai
        if not isinstance(e, (o.BadRequestError, o.UnprocessableEntityError)):
            return None
        detail = _detail(e)
        low = detail.lower()
        limit = _allowed_reply_tokens(low, messages)
        if limit is not None and "reply_limit" not in self._adapted:
            self._adapted.add("reply_limit")
            if limit < MIN_REPLY_TOKENS:
                return None  # the prompt nearly fills the context: _classify says so
            key = "max_tokens" if "max_tokens" in self._params else "max_completion_tokens"
            self._params[key] = min(limit, self.reply_limit)
            return f"endpoint allows at most {limit} reply tokens here; resent with {key}={self._params[key]}"
        if ("max_tokens" in self._params and "max_completion_tokens" in low
                and any(w in low for w in ("unsupported", "not supported", "instead"))):
            self._params["max_completion_tokens"] = self._params.pop("max_tokens")
            return "endpoint wants max_completion_tokens instead of max_tokens; resent"
        if "temperature" in self._params and "temperature" in low:
            del self._params["temperature"]
            return "endpoint rejects a temperature for this model; resent without one"
        return None

    def _accept(self, response, hold: list[tuple[Spend, Hold]], worst_prompt: int, worst_reply: int, duration: float,
                card_id: str | None) -> Reply:
        choice = response.choices[0] if getattr(response, "choices", None) else None
        content = choice.message.content if choice is not None and choice.message is not None else None
        text = content if isinstance(content, str) else ""
        finish = choice.finish_reason if choice is not None else None
        cap = worst_reply * MAX_CHARS_PER_TOKEN
        plausible = _plausible_usage(getattr(response, "usage", None), worst_prompt, worst_reply, len(text))
        if len(text) > cap:
            logger.warning("LLM reply of %d characters cut to %d (%d tokens allowed)", len(text), cap, worst_reply)
            text, finish = text[:cap], "length"
        # A reply that repeats a secret must not carry it into the log or the next prompt.
        text = scrub(text, limit=None)
        prompt, completion = plausible or (worst_prompt, worst_reply)
        if plausible is None:
            logger.warning("LLM usage missing or implausible for %s; charged the worst case (%d + %d tokens)",
                           self.config.model, worst_prompt, worst_reply)
        cost = self._settle(hold, prompt, completion)
        self.totals.calls += 1
        self.totals.prompt_tokens += prompt
        self.totals.completion_tokens += completion
        self.totals.cost_usd += cost
        self._record("ok", prompt, completion, cost, duration, card_id, estimated=plausible is None)
        return Reply(text, finish, prompt, completion, cost, duration)

    def _record(self, status: str, prompt: int, completion: int, cost: float, duration: float,
                card_id: str | None, *, error: str | None = None, estimated: bool = False) -> None:
        if self.on_call is not None:
            self.on_call(CallRecord(self.config.model, self.config.base_url, status, prompt, completion, cost,
                                    duration, card_id, error, estimated))

    # ---- budget --------------------------------------------------------------------------
    def _reserve(self, prompt: int, reply: int) -> list[tuple[Spend, Hold]]:
        """Hold an attempt's worst case in this client's budget and the run's; all or none."""
        tokens, cost = prompt + reply, self.config.cost(prompt, reply)
        held: list[tuple[Spend, Hold]] = []
        try:
            for ledger in filter(None, (self._own, self.ledger)):
                held.append((ledger, ledger.reserve(tokens, cost)))
        except BaseException:
            for ledger, hold in held:
                ledger.settle(hold, 0, 0.0)
            raise
        return held

    def _settle(self, held: list[tuple[Spend, Hold]], prompt: int, completion: int) -> float:
        cost = self.config.cost(prompt, completion)
        for ledger, hold in held:
            ledger.settle(hold, prompt + completion, cost)
        return cost

    # ---- failures ------------------------------------------------------------------------
    def _classify(self, e: Exception) -> Exception:
        """A ProposerUnavailable for what retrying cannot fix, else a _Transient with the
        server's requested delay (if any)."""
        o = self._openai
        url = self.config.base_url
        if isinstance(e, o.APITimeoutError):
            return _Transient(f"timed out after {self.config.timeout_s:g} s", None)
        if isinstance(e, o.APIConnectionError):
            return _Transient(f"cannot connect to {url}: {scrub(_one_line(str(e.__cause__ or e)))}", None)
        if not isinstance(e, o.APIStatusError):
            return _Transient(f"unexpected reply from {url}: {scrub(_one_line(str(e)))}", None)
        status = e.status_code
        if status in RETRY_STATUS or status >= 500:
            return _Transient(f"HTTP {status}: {scrub(_detail(e))}", _retry_after(e.response.headers))
        return self._unavailable(e)

    def _unavailable(self, e: Exception) -> ProposerUnavailable:
        """What the endpoint's refusal means, with the fix, on one line."""
        o = self._openai
        url, model = self.config.base_url, self.config.model
        if isinstance(e, (o.APITimeoutError, o.APIConnectionError)) or not isinstance(e, o.APIStatusError):
            why = "timed out" if isinstance(e, o.APITimeoutError) else scrub(_one_line(str(e.__cause__ or e)))
            return ProposerUnavailable(f"cannot reach the LLM endpoint {url} ({why}); start the server or fix "
                                       "--llm-base-url / KFORGE_LLM_BASE_URL", transient=True)
        status, detail = e.status_code, scrub(_detail(e))
        if status in (401, 403):
            return ProposerUnavailable(f"{url} refused the API key (HTTP {status}: {detail}); "
                                       "check KFORGE_LLM_API_KEY (or OPENAI_API_KEY)")
        if status == 404:
            return ProposerUnavailable(
                f"model {model!r} not found at {url} (HTTP 404: {detail}); check --llm-model / KFORGE_LLM_MODEL "
                f"against GET {url.rstrip('/')}/models, and that the base URL ends where /chat/completions begins "
                "(often .../v1)")
        if _CONTEXT.search(detail.lower()):
            return ProposerUnavailable(
                f"the prompt leaves no room for a reply in {model!r}'s context (HTTP {status}: {detail}); use a model "
                "with a longer context (for vLLM, a larger --max-model-len)")
        if status >= 500 or status in RETRY_STATUS:
            return ProposerUnavailable(f"{url} is failing (HTTP {status}: {detail}); try again later", transient=True)
        return ProposerUnavailable(
            f"{url} rejected the request (HTTP {status}: {detail}); fix the setting it names (--llm-reply-tokens, "
            "--llm-temperature, --llm-top-p, --llm-reasoning-effort, --llm-body, or the --llm-config file)")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """The server's Retry-After when it gave one, else exponential backoff with full
        jitter (so parallel searches do not retry in lockstep); capped either way."""
        if retry_after is not None:
            return min(retry_after, self.config.max_retry_wait_s)
        return min(self.config.max_retry_wait_s, BACKOFF_BASE_S * 2 ** attempt) * self._rng.uniform(0.5, 1.0)


def _plausible_usage(usage, worst_prompt: int, worst_reply: int, reply_chars: int) -> tuple[int, int] | None:
    """(prompt, completion) tokens as reported, or None when they cannot be right."""
    prompt = getattr(usage, "prompt_tokens", None)
    completion = getattr(usage, "completion_tokens", None)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (prompt, completion)):
        return None
    if not (0 <= prompt <= worst_prompt and 0 <= completion <= worst_reply):
        return None
    if completion * MAX_CHARS_PER_TOKEN < reply_chars:
        return None
    return prompt, completion


_CONTEXT = re.compile(r"maximum context length is (\d+)")
_PROMPT_TOKENS = re.compile(r"\((\d+) in the messages|has (\d+) input tokens|(\d+) tokens? in the (?:prompt|input)")
_MAX_TOKENS_OVER = re.compile(r"max_tokens\W{0,4}(\d+)\s*>\s*(\d+)")  # Anthropic: "max_tokens: 8192 > 4096, which is ..."
_AT_MOST = re.compile(r"(?:supports at most|at most|maximum (?:allowed )?(?:number of )?(?:output |completion )?"
                      r"tokens (?:is|of))\s*(\d+)\s*(?:completion |output )?tokens")


def _allowed_reply_tokens(detail: str, messages: list[dict[str, str]]) -> int | None:
    """The reply limit a 400 says the endpoint allows (lower-cased `detail`): from a context
    length and the prompt's size (vLLM, OpenAI), or a stated output maximum (Anthropic,
    OpenAI); None when it says neither."""
    over = _MAX_TOKENS_OVER.search(detail)
    if over:
        return int(over.group(2))
    context = _CONTEXT.search(detail)
    if context:
        used = _PROMPT_TOKENS.search(detail)
        prompt = int(next(g for g in used.groups() if g)) if used else estimate_tokens(
            "".join(m["content"] for m in messages)) * 3 // 2
        return int(context.group(1)) - prompt - 2 * MESSAGE_OVERHEAD_TOKENS
    at_most = _AT_MOST.search(detail)
    return int(at_most.group(1)) if at_most else None


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


def _message(body) -> str | None:
    """The human message in an error body, whatever its shape: {"error": {"message"}}, a
    list of those (Gemini), {"error": "..."}, {"detail": ...} (FastAPI), or plain text."""
    if isinstance(body, str):
        return body.strip() or None
    if isinstance(body, list):
        return next(filter(None, map(_message, body)), None)
    if isinstance(body, dict):
        for key in ("message", "error", "detail", "msg"):
            found = _message(body.get(key))
            if found:
                return found
    return None


def _detail(e) -> str:
    return _one_line(_message(e.body) or e.message)


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
    """An `on_call` hook that records each attempt in a store (kforge.store: its LLM calls)."""

    def record(r: CallRecord) -> None:
        log.add_llm_call(run_id, r.card_id, r.model, prompt_tokens=r.prompt_tokens,
                         completion_tokens=r.completion_tokens, cost_usd=r.cost_usd, duration_s=r.duration_s,
                         status=r.status, error=r.error, base_url=r.base_url)

    return record
