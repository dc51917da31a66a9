"""The search log as one typed store (Optuna's study / trial / storage split is the model).

`records` holds what is stored (runs, cards, candidates, LLM calls, events); a store writes
what the search makes and answers the queries of the runner, the CLI, the packager and the
dashboard with those records. `SQLiteStore` is a run directory's log (the only SQL in
kforge); `MemoryStore` is the same contract without a file. The search takes either: it
calls the store, it never knows which one.
"""

from .base import SearchStore
from .memory import MemoryStore
from .records import CandidateRecord, CardRecord, EventRecord, LLMCallRecord, LLMUsage, RunRecord
from .sqlite import SQLiteStore
from .sqlite.logfile import LOG_NAME, MIGRATIONS, SCHEMA_VERSION, connect

__all__ = ["LOG_NAME", "MIGRATIONS", "SCHEMA_VERSION", "CandidateRecord", "CardRecord", "EventRecord", "LLMCallRecord",
           "LLMUsage", "MemoryStore", "RunRecord", "SearchStore", "SQLiteStore", "connect"]
