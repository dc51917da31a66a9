"""A candidate kernel: CUDA source plus a launch plan that is data, not code.

    {"kernels": [{"name": "softmax_rows", "grid": [4096, 1, 1], "block": [256, 1, 1],
                  "smem": 0, "args": [{"in": 0}, {"out": 0}, {"i32": 4096}]}],
     "workspace": [], "options": ["-default-device"]}

Arguments bind inputs (`in`, numbered as Card.inputs), outputs (`out`, numbered as
Card.outputs; allocated by kforge with the reference's shape, stride and dtype, or the
input itself for in-place ops), workspaces (`ws`, numbered as `workspace`) and typed
scalars (`i32`, `i64`, `f32`, `f64`). A workspace entry is a byte count, or
{"bytes": n, "zero": true} to have it zeroed before the first kernel. Nothing in a
candidate runs on the host: only NVRTC-compiled device code is launched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import PlanError
from .redact import scrub
from .sourcebox import SourceRefused, check_options

ARG_KINDS = ("in", "out", "ws", "i32", "i64", "f32", "f64")
KINDS = ("custom", "vendor")  # custom CUDA, or a wrapper of a vendor library (audited as such)
MAX_THREADS = 1024
MAX_ARGS = 512  # 8 bytes each: CUDA's 4 KB of kernel parameters, the launcher's slots
MAX_GRID = (2**31 - 1, 65535, 65535)
# Far above what any kernel here needs (partial sums, counters), far below a GPU that could
# not hold it: a plan from a package or an LLM reply asking more is refused when parsed,
# not when the user's forward allocates it.
MAX_WORKSPACE_BYTES = 1 << 32


@dataclass
class KernelLaunch:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0
    args: list[dict[str, Any]] = field(default_factory=list)
    # Launched with cuLaunchCooperativeKernel: every block resident at once, so the kernel may
    # wait on other blocks (a grid-wide barrier); a grid too large to be resident is refused.
    cooperative: bool = False
    # Programmatic dependent launch (sm_90+): may start before the previous kernel of the plan
    # finishes, so it must run `griddepcontrol.wait` before reading what that kernel wrote.
    pdl: bool = False
    # Thread block cluster (sm_90+): this many consecutive blocks along x are co-scheduled on
    # one GPC and may barrier together (barrier.cluster) and read each other's shared memory.
    cluster: int = 0

    def to_json(self) -> dict:
        d = {"name": self.name, "grid": list(self.grid), "block": list(self.block), "smem": self.smem, "args": self.args}
        if self.cooperative:  # only when set: plans (and digests) of ordinary kernels stay as they were
            d["cooperative"] = True
        if self.pdl:
            d["pdl"] = True
        if self.cluster:
            d["cluster"] = self.cluster
        return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is not a count


def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    if _is_int(v):
        v = [v]
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= 3 or not all(_is_int(x) for x in v):
        raise PlanError(f"{what} must be 1 to 3 integers, got {v!r}")
    v = list(v) + [1] * (3 - len(v))
    return (v[0], v[1], v[2])


def _check_workspace(w: Any) -> None:
    ok = _is_int(w) and 0 <= w <= MAX_WORKSPACE_BYTES
    if isinstance(w, dict):
        ok = (_is_int(w.get("bytes")) and 0 <= w["bytes"] <= MAX_WORKSPACE_BYTES
              and isinstance(w.get("zero", False), bool) and set(w) <= {"bytes", "zero"})
    if not ok:
        raise PlanError(f'workspace entry {json.dumps(w, default=str):.80} must be a byte count (an integer, 0 to '
                        f'{MAX_WORKSPACE_BYTES}) or {{"bytes": n, "zero": true}}')


@dataclass
class LaunchPlan:
    kernels: list[KernelLaunch]
    workspace: list[int | dict] = field(default_factory=list)
    options: list[str] = field(default_factory=list)

    def workspace_bytes(self) -> list[tuple[int, bool]]:
        """(bytes, zero before launch) per workspace buffer."""
        return [(w["bytes"], w.get("zero", False)) if isinstance(w, dict) else (w, False) for w in self.workspace]

    def to_json(self) -> dict:
        return {"kernels": [k.to_json() for k in self.kernels], "workspace": self.workspace, "options": self.options}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @staticmethod
    def from_json(d: Any) -> "LaunchPlan":
        """Parse and check the shape of a plan; raises PlanError saying what is wrong."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except (ValueError, RecursionError) as e:
                raise PlanError(f"launch plan is not valid JSON: {e}") from e
        if not isinstance(d, dict) or not isinstance(d.get("kernels"), list) or not d["kernels"]:
            raise PlanError('launch plan must be an object with a non-empty "kernels" list')
        kernels = []
        for i, k in enumerate(d["kernels"]):
            if not isinstance(k, dict) or not isinstance(k.get("name"), str) or not k["name"].isidentifier():
                raise PlanError(f"kernel {i}: needs a \"name\" that is a C identifier")
            args = k.get("args", [])
            if not isinstance(args, list):
                raise PlanError(f"kernel {k['name']}: \"args\" must be a list")
            for a in args:
                if not isinstance(a, dict) or len(a) != 1 or next(iter(a)) not in ARG_KINDS:
                    raise PlanError(f"kernel {k['name']}: argument {a!r} must be one of {{kind: value}} with kind in {ARG_KINDS}")
                kind, v = next(iter(a.items()))
                if kind in ("f32", "f64"):
                    if not isinstance(v, (int, float)) or isinstance(v, bool):
                        raise PlanError(f"kernel {k['name']}: {kind} argument needs a number, got {v!r}")
                elif not _is_int(v):
                    raise PlanError(f"kernel {k['name']}: {kind} argument needs an integer, got {v!r}")
            smem = k.get("smem", 0)
            if not _is_int(smem) or smem < 0:
                raise PlanError(f"kernel {k['name']}: smem must be a non-negative integer")
            coop, pdl = k.get("cooperative", False), k.get("pdl", False)
            if not isinstance(coop, bool) or not isinstance(pdl, bool):
                raise PlanError(f"kernel {k['name']}: \"cooperative\" and \"pdl\" must be true or false")
            if coop and pdl:
                raise PlanError(f"kernel {k['name']}: a kernel is cooperative or pdl, not both")
            grid = _dim3(k.get("grid"), "grid")
            cluster = k.get("cluster", 0)
            if not _is_int(cluster) or not 0 <= cluster <= 16:
                raise PlanError(f"kernel {k['name']}: \"cluster\" must be 0 (none) to 16 blocks")
            if cluster and (coop or grid[0] % cluster):
                raise PlanError(f"kernel {k['name']}: a cluster of {cluster} blocks must divide grid x ({grid[0]}) "
                                f"and the kernel must not be cooperative")
            kernels.append(KernelLaunch(k["name"], grid, _dim3(k.get("block"), "block"), smem, list(args), coop, pdl,
                                        cluster))
        ws = d.get("workspace", [])
        opts = d.get("options", [])
        if not isinstance(ws, list) or not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
            raise PlanError('"workspace" must be a list and "options" a list of strings')
        for w in ws:
            _check_workspace(w)
        try:
            check_options(opts)
        except SourceRefused as e:
            raise PlanError(str(e)) from None
        return LaunchPlan(kernels, ws, opts)

    def validate(self, n_inputs: int, n_outputs: int) -> None:
        """Check the plan fits a card with this many inputs and outputs, and CUDA's limits."""
        n_ws = len(self.workspace)
        for k in self.kernels:
            threads = k.block[0] * k.block[1] * k.block[2]
            if not 1 <= threads <= MAX_THREADS or min(k.block) < 1:
                raise PlanError(f"kernel {k.name}: block {k.block} has {threads} threads; 1 to {MAX_THREADS} allowed")
            if min(k.grid) < 1 or any(g > m for g, m in zip(k.grid, MAX_GRID)):
                raise PlanError(f"kernel {k.name}: grid {k.grid} outside CUDA's limits {MAX_GRID}")
            if len(k.args) > MAX_ARGS:
                raise PlanError(f"kernel {k.name}: {len(k.args)} arguments; at most {MAX_ARGS} (CUDA's 4 KB of "
                                f"kernel parameters): pass fewer")
            for a in k.args:
                kind, v = next(iter(a.items()))
                limit = {"in": n_inputs, "out": n_outputs, "ws": n_ws}.get(kind)
                if limit is not None and not 0 <= v < limit:
                    raise PlanError(f"kernel {k.name}: argument {{{kind!r}: {v}}} but the card has {limit} {kind} buffer(s)")
                if kind == "i32" and not -(2**31) <= v < 2**31:
                    raise PlanError(f"kernel {k.name}: i32 argument {v} does not fit in 32 bits; use i64")
        uses_out = {next(iter(a.values())) for k in self.kernels for a in k.args if "out" in a}
        missing = set(range(n_outputs)) - uses_out
        if missing:
            raise PlanError(f"outputs {sorted(missing)} are never passed to a kernel; every output must be written")


@dataclass
class Candidate:
    source: str
    plan: LaunchPlan
    kind: str = "custom"
    proposer: str = "builtin"
    knobs: dict[str, Any] = field(default_factory=dict)  # template parameters, or LLM model/notes
    note: str = ""

    def __post_init__(self) -> None:
        # A reply may repeat a secret it saw; the source, note and plan are stored, shown and
        # re-sent. The plan's strings are scrubbed after its JSON was decoded: `sk\u002d...` in
        # the reply's text is a key only once decoded. A masked name or option fails its check later.
        self.source = scrub(self.source, limit=None)
        self.note = scrub(self.note)
        self.plan.options = [scrub(o, limit=None) for o in self.plan.options]
        for k in self.plan.kernels:
            k.name = scrub(k.name, limit=None)
        if self.kind not in KINDS:
            raise PlanError(f"candidate kind must be one of {KINDS}, got {self.kind!r}")

    def digest(self) -> str:
        """Identity of what would run: source and plan (not who proposed it)."""
        return hashlib.sha256((self.source + "\0" + self.plan.dumps()).encode()).hexdigest()[:20]

    def to_json(self) -> dict:
        return {"source": self.source, "plan": self.plan.to_json(), "kind": self.kind,
                "proposer": self.proposer, "knobs": self.knobs, "note": self.note}

    @staticmethod
    def from_json(d: dict) -> "Candidate":
        return Candidate(d["source"], LaunchPlan.from_json(d["plan"]), d.get("kind", "custom"),
                         d.get("proposer", "builtin"), d.get("knobs", {}), d.get("note", ""))
