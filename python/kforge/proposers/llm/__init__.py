"""The LLM proposer: CUDA kernels from any OpenAI-compatible endpoint.

    from kforge.proposers.llm import LLMProposer
    proposer = LLMProposer(model="gpt-4.1", max_cost_usd=5.0)   # + environment, config file
    proposer.bind(search_log, run_id, Spend(max_cost_usd=5.0))   # what the search does: log and charge each call

config.py (settings, key handling) · prices.py (price table) · client.py (calls, retries, budgets, accounting)
· prompts.py (messages) · parse.py (reply -> Candidate) · proposer.py (the conversation).
"""

from .client import CallRecord, LLMClient, Totals, log_recorder
from .config import LLMConfig, Secret
from .proposer import LLMProposer

__all__ = ["CallRecord", "LLMClient", "LLMConfig", "LLMProposer", "Secret", "Totals", "log_recorder"]
