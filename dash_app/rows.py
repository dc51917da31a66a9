"""How search-log records and package manifests become what the dashboard's pages show: rows
for tables, one-line texts, grouped failure kinds, tolerances, and the estimated speedup.
Pure functions of their arguments (kforge.redact scrubs every text a record may hold)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kforge.redact import scrub

# Verdicts the search keeps (correct kernels); everything else but "untimed" (compiled, with
# no GPU to run it: not a failure) is a failure.
CORRECT = ("valid", "slower")
NOT_FAILED = CORRECT + ("untimed",)

def loads(text: str | None, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def scrubbed(value: Any) -> Any:
    """`value` with its texts scrubbed: a log written before kforge scrubbed its texts may hold
    a key in any of them. A JSON value is scrubbed as the one text it is stored as."""
    if isinstance(value, str):
        return scrub(value, limit=None)
    if isinstance(value, (dict, list)):
        return loads(scrub(json.dumps(value), limit=None), type(value)())
    return value


def record_dict(record: Any, *keys: str) -> dict:
    """A store record as a dict of scrubbed values (only `keys`, when given)."""
    return {k: scrubbed(getattr(record, k)) for k in keys or [f.name for f in dataclasses.fields(record)]}


def proposer_of_call(model: str) -> str:
    """The proposer an llm_calls row belongs to. The search logs a call under its proposer's
    name (`llm:<model>`); the LLM client's per-attempt recorder logs the bare model."""
    return model if model.startswith("llm:") else f"llm:{model}"


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


# Numbers, hex addresses and quoted names vary between otherwise identical failures
# ("max abs err 0.31 at index 17" vs "... 0.29 at index 4"); grouping ignores them.
_VARYING = re.compile(r"\b[0-9a-f]{16}\b|0x[0-9a-fA-F]+|[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")  # card ids too


def failure_kind(message: str | None) -> str:
    return _VARYING.sub("N", first_line(message)) or "(no message)"


def flatten(d: dict, skip: tuple[str, ...] = (), prefix: str = "") -> dict[str, Any]:
    """Scalars of a manifest's header, nested keys joined ("gpu name")."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k in skip:
            continue
        if isinstance(v, dict):
            out.update(flatten(v, prefix=f"{prefix}{k} "))
        elif not isinstance(v, list) and v is not None:
            out[f"{prefix}{k}"] = v
    return out


def manifest_row(e: dict) -> dict:
    """One card entry of a manifest (kforge.package format), flattened for a table."""
    timing, error = e.get("timing") or {}, e.get("error") or {}
    compiled = e.get("compile") if isinstance(e.get("compile"), dict) else {}  # none in format 1 packages
    eager, kernel = timing.get("eager_us"), timing.get("kernel_us")
    return {
        "card_id": e.get("id", ""), "op": e.get("op", ""), "summary": e.get("summary", ""),
        "decision": e.get("decision", ""), "reason": e.get("reason") or "", "kind": e.get("kind") or "",
        "eager_us": eager, "kernel_us": kernel, "dispatched_us": timing.get("dispatched_us"),
        "eager_dispatched_us": timing.get("eager_dispatched_us"),
        "speedup": eager / kernel if eager and kernel else None,
        "compile_decision": compiled.get("decision") or "none", "compile_reason": compiled.get("reason") or "",
        "compile_us": compiled.get("compile_us"),
        "max_abs_err": error.get("max_abs_err"), "tolerance": tolerance_text(error.get("tolerances")),
        "candidate": (e.get("candidate") or {}).get("log_id"),
    }


def tolerance_text(tolerances: Any) -> str:
    """The tolerance a packaged kernel passed, per output: kforge.worker records one list per
    input set (one {atol, rtol, how} per observed tensor); the loosest over the sets is shown."""
    if not isinstance(tolerances, dict):
        return ""
    outputs: dict[int, tuple[float, float]] = {}
    for per_output in tolerances.values():
        for j, t in enumerate(per_output if isinstance(per_output, list) else []):
            if isinstance(t, dict) and isinstance(t.get("atol"), (int, float)) and isinstance(t.get("rtol"), (int, float)):
                a, r = outputs.get(j, (0.0, 0.0))
                outputs[j] = (max(a, t["atol"]), max(r, t["rtol"]))
    return "; ".join(f"atol={a:.2g}, rtol={r:.2g}" for _, (a, r) in sorted(outputs.items()))


def estimated_speedup(cards: list[dict]) -> float | None:
    """Whole-model speedup implied by the winners and their shares (Amdahl), if any won."""
    saved = sum((c["share"] or 0.0) * (1.0 - 1.0 / c["best_speedup"]) for c in cards if c["best_speedup"])
    return 1.0 / (1.0 - saved) if saved > 0 and saved < 1 else None


def pct_of_floor(floor_us: float | None, latency_us: float | None) -> float | None:
    return 100.0 * floor_us / latency_us if floor_us and latency_us else None
