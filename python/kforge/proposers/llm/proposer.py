"""LLMProposer: kernels from any OpenAI-compatible model.

A proposal is one conversation: the prompt (first version, revision or repair), then, while
the reply cannot be used (no code block, bad plan, unknown kernel, a kernel already
evaluated), an excerpt of the reply and the reason are sent back, up to
`max_repair_attempts` times. Compile, runtime and correctness failures come back from the
evaluator through `repair`. Every attempt is recorded and charged by the client (see bind).
"""

from __future__ import annotations

import time
from typing import Callable

from ...cards import Card
from ...errors import ProposerError
from ...spend import Spend
from ..base import Proposal, ProposalContext, Proposer, Tried
from . import prompts
from .client import CallRecord, LLMClient, log_recorder
from .config import LLMConfig
from .parse import parse_reply, strip_reasoning

# What of an unusable reply goes back with the reason: enough to see the mistake, never a
# huge reply uploaded again on every re-ask.
EXCERPT_CHARS = 12_000


class LLMProposer(Proposer):
    def __init__(self, config: LLMConfig | None = None, *, on_call: Callable[[CallRecord], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, **settings):
        """`config`, or settings (model=..., base_url=..., CLI flags) resolved with the
        environment and config file by LLMConfig.resolve."""
        if config is not None and settings:
            raise ProposerError(f"pass either an LLMConfig or settings, not both (got {sorted(settings)})")
        self.config = config if config is not None else LLMConfig.resolve(**settings)
        self.name = f"llm:{self.config.model}"
        self.client = LLMClient(self.config, on_call=on_call, sleep=sleep)

    def bind(self, log, run_id: str, spend: Spend) -> None:
        """Write every call attempt (no key, no text) into the search log's llm_calls table and
        charge it to `spend`, whose limits the client checks before every attempt."""
        if spend.max_cost_usd is not None:
            self.config.require_price("--max-cost")
        self.client.on_call = log_recorder(log, run_id)
        self.client.ledger = spend

    def preflight(self, spend: Spend) -> None:
        if spend.max_cost_usd is not None:
            self.config.require_price("--max-cost")
        self.client.check_endpoint()

    def supports(self, card: Card) -> tuple[bool, str]:
        if not card.outputs:
            return False, "the op returns no tensor, so there is nothing for a kernel to write"
        return True, ""

    def propose(self, ctx: ProposalContext) -> Proposal:
        return self._converse(ctx, prompts.proposal_messages(ctx), note="")

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal:
        return self._converse(ctx, prompts.repair_messages(ctx, failed),
                              note=f"repair of #{failed.id}" if failed.id is not None else "repair")

    def close(self) -> None:
        self.client.close()

    def _converse(self, ctx: ProposalContext, messages: list[dict[str, str]], note: str) -> Proposal:
        asks = self.config.max_repair_attempts + 1
        for ask in range(1, asks + 1):
            reply = self.client.chat(messages, card_id=ctx.card.id)
            try:
                candidate = parse_reply(reply.text, ctx.card, self.name)
                if candidate.digest() in ctx.tried_digests:
                    raise ProposerError("this source and plan are identical to a kernel already evaluated for "
                                        "this card; change something that matters")
            except ProposerError as e:
                problem = str(e)
                if reply.finish_reason == "length":
                    problem = _cut_off(problem, reply.text, self.client.reply_limit)
                # The model's reasoning is not sent back: reasoning models expect only their earlier
                # answers in the conversation (DeepSeek documents it), and thoughts cost prompt tokens.
                # Nor is an empty turn: some endpoints refuse an assistant message without content.
                answer = strip_reasoning(reply.text)
                answer = answer if answer.strip() else "(no answer)"
                messages = prompts.retry_messages(messages, excerpt(answer), problem)
                continue
            candidate.knobs = {"model": self.config.model, "asks": ask}
            candidate.note = "; ".join(x for x in (note, candidate.note) if x)
            return Proposal(candidate)
        raise ProposerError(f"{self.name} gave no usable answer in {asks} asks for card {ctx.card.id}; "
                            f"the last problem: {problem}")


def _cut_off(problem: str, text: str, limit: int) -> str:
    """What to say of a reply that hit the token limit. One that is all reasoning (hidden
    reasoning tokens, or a `<think>` block) cannot be made briefer by answering briefer:
    the model must stop deliberating and write the code."""
    if not strip_reasoning(text).strip():
        return (f"the reply was cut off at {limit} tokens before any answer: the reasoning used the whole reply "
                "budget. Do not reason at length this time; write the ```cuda and ```json blocks directly")
    return f"{problem} (the reply was cut off at {limit} tokens; answer more briefly)"


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text`, or its start and end with how much was left out between them."""
    if len(text) <= limit:
        return text
    head, tail = text[:limit * 3 // 4], text[-(limit // 4):]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters of the reply left out ...]\n{tail}"
