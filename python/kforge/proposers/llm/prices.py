"""List prices of the models people drive kforge with, and how a model name finds its price.

USD per 1M (prompt, completion) tokens, from the providers' pricing pages as of PRICES_AS_OF,
for prompts of ordinary length (no long-context tier, no cache discount, no batch discount).
Where a provider changed a price, the higher figure is kept: with stale prices a budget stops
early, never late. Prices move; a price given by the user (--llm-price, or a [prices] table in
the config file) always wins over this table.

A model name finds its price by an exact match, then with a provider prefix removed
(`openai/gpt-4o`, `models/gemini-2.5-pro`), then with a dated-snapshot suffix removed
(`gpt-4o-2024-08-06`, `claude-sonnet-4-20250514`, `mistral-large-2411`, `gemini-1.5-pro-002`,
`claude-3-7-sonnet-latest`). Nothing else: `o3-pro` is not `o3`, `gpt-4.1-nano` is not
`gpt-4.1`. A model found nowhere is unpriced (None).
"""

from __future__ import annotations

import re
from typing import Mapping

PRICES_AS_OF = "2025-10"

PRICES: dict[str, tuple[float, float]] = {
    # OpenAI
    "gpt-5": (1.25, 10.00), "gpt-5-mini": (0.25, 2.00), "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.00, 8.00), "gpt-4.1-mini": (0.40, 1.60), "gpt-4.1-nano": (0.10, 0.40),
    "gpt-4o": (2.50, 10.00), "gpt-4o-mini": (0.15, 0.60), "gpt-4-turbo": (10.00, 30.00),
    "o1": (15.00, 60.00), "o1-mini": (1.10, 4.40), "o1-pro": (150.00, 600.00),
    "o3": (2.00, 8.00), "o3-mini": (1.10, 4.40), "o3-pro": (20.00, 80.00), "o4-mini": (1.10, 4.40),
    "codex-mini-latest": (1.50, 6.00),
    # Anthropic
    "claude-opus-4-1": (15.00, 75.00), "claude-opus-4": (15.00, 75.00), "claude-opus-4-0": (15.00, 75.00),
    "claude-sonnet-4-5": (3.00, 15.00), "claude-sonnet-4": (3.00, 15.00), "claude-sonnet-4-0": (3.00, 15.00),
    "claude-haiku-4-5": (1.00, 5.00), "claude-3-7-sonnet": (3.00, 15.00), "claude-3-5-sonnet": (3.00, 15.00),
    "claude-3-5-haiku": (0.80, 4.00), "claude-3-opus": (15.00, 75.00), "claude-3-haiku": (0.25, 1.25),
    # Google
    "gemini-2.5-pro": (1.25, 10.00), "gemini-2.5-flash": (0.30, 2.50), "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.0-flash": (0.10, 0.40), "gemini-2.0-flash-lite": (0.075, 0.30),
    "gemini-1.5-pro": (1.25, 5.00), "gemini-1.5-flash": (0.075, 0.30),
    # DeepSeek (its own API; other hosts of the open weights price them differently)
    "deepseek-chat": (0.28, 1.10), "deepseek-reasoner": (0.55, 2.19),
    # Mistral
    "mistral-large": (2.00, 6.00), "mistral-medium": (0.40, 2.00), "mistral-small": (0.10, 0.30),
    "codestral": (0.30, 0.90), "devstral-medium": (0.40, 2.00), "devstral-small": (0.10, 0.30),
    "magistral-medium": (2.00, 5.00), "magistral-small": (0.50, 1.50),
    # Alibaba Qwen (Model Studio, international)
    "qwen-max": (1.60, 6.40), "qwen-plus": (0.40, 1.20), "qwen-turbo": (0.05, 0.20),
    "qwen3-coder-plus": (1.00, 5.00), "qwen3-coder-flash": (0.30, 1.50),
    # xAI
    "grok-4": (3.00, 15.00), "grok-3": (3.00, 15.00), "grok-3-mini": (0.30, 0.50),
}

# Dated snapshots and moving aliases of one model: -2024-08-06, -20250514, -0613 / -2411,
# -002, @20241022, -latest.
_SNAPSHOT = re.compile(r"(?:-\d{4}-\d{2}-\d{2}|-\d{8}|-\d{4}|-\d{3}|@\d{8}|-latest)$")


def find_price(model: str, prices: Mapping[str, tuple[float, float]]) -> tuple[float, float] | None:
    """The price of `model` in `prices` (rules in the module docstring), or None."""
    bare = model.rsplit("/", 1)[-1]
    for name in dict.fromkeys((model, bare, _SNAPSHOT.sub("", model), _SNAPSHOT.sub("", bare))):
        if name in prices:
            return prices[name]
    return None
