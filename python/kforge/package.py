"""The .cast package: per card the kernel that won or the reason it falls back, and a loader
that treats every package as untrusted input.

A .cast is a zip that holds no host code and no pickles:

    manifest.json              format, kforge/torch/NVRTC versions, GPU, one entry per card:
                               guard (the card key), decision and reason (eager dispatch),
                               compile decision and reason (kforge.compile's graphs), kind,
                               latencies, error and tolerance, launch plan, hashes
    kernels/<card>.cu          source of each dispatched kernel
    kernels/<card>.<sm>.cubin  its cubin, compiled for exactly that arch (never PTX)
    checksums.sha256           sha256 of every other entry (`sha256sum -c` reads it)
    checksums.sha256.sig       optional: Ed25519 signature of the checksums (`kforge package --sign`)

Loading decides two ways. A package that is corrupt, unsafe, malformed, too new, or (with
trusted_keys) not signed by a trusted key raises PackageError: kforge.castfile reads the
zip within size limits, kforge.manifest checks every field. A sound package built for
another GPU, or loaded where there is no GPU, loads with every card falling back to
PyTorch and a loud warning. Checksums catch corruption, not tampering (anyone who edits a
kernel can recompute them); only a signature checked against trusted keys shows who wrote
the package.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from rich.table import Table
from rich.text import Text

from . import castfile
from .candidate import Candidate, LaunchPlan
from . import customops
from .cards import CARD_FORMAT, Card, card_id, decode_value, load_card
from .castfile import CHECKSUMS, MANIFEST, SIGNATURE, sha256
from .dispatch import Counters, Dispatcher, Launcher, RegistryLauncher, Variant, dispatch_blocker
from .errors import CardError, CompileError, CudaUnavailableError, KforgeError, PackageError, PlanError
from .guards import REASONS, meaning
from .manifest import ARCH, FORMAT, MAX_TEXT, check_manifest, read_manifest
from .store import LOG_NAME, CandidateRecord, CardRecord, SQLiteStore
from .verdict import EvalResult, Verdict

# Without an IQR in the evidence a kernel must beat eager by this fraction to be dispatched.
DEFAULT_MARGIN = 0.03
_EM_CUDA = 190

log = logging.getLogger("kforge.package")


class PackageFallbackWarning(UserWarning):
    """A package loaded, but some or all of its kernels will not run on this machine."""


def cubin_sm(image: bytes) -> int | None:
    """The SM number a cubin was built for (90 for sm_90), or None if it is not a CUDA ELF (PTX, junk)."""
    if len(image) < 52 or image[:4] != b"\x7fELF" or image[4] != 2:
        return None
    if int.from_bytes(image[18:20], "little") != _EM_CUDA:
        return None
    flags = int.from_bytes(image[48:52], "little")
    # CUDA 12.8+ cubins (ELF ABI version >= 8) keep the SM in bits 8-15 of e_flags, older ones in bits 0-7.
    return (flags >> 8) & 0xFF if image[8] >= 8 else flags & 0xFF


def _arch_sm(arch: str) -> int | None:
    m = ARCH.match(arch or "")
    return int(m.group(1)) if m else None


# ---- choosing winners -------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    """Whether a card's kernel goes where one baseline runs: True (dispatched), False (fallback),
    None (no decision: nothing was timed to decide against); why, and the numbers it rests on."""

    dispatched: bool | None
    reason: str
    baseline_us: float | None = None
    kernel_us: float | None = None
    noise_us: float | None = None


def noise(baseline_us: float, baseline_iqr: float | None, kernel_iqr: float | None, *,
          noise_factor: float = 1.0, margin: float = DEFAULT_MARGIN) -> float:
    """How much faster than a baseline a kernel must be to count: noise_factor times half the sum
    of the two IQRs, or `margin` of the baseline when an IQR is missing."""
    if baseline_iqr is None or kernel_iqr is None:
        return margin * baseline_us
    return noise_factor * 0.5 * (baseline_iqr + kernel_iqr)


def beats(kernel_us: float, baseline_us: float, noise_us: float, baseline: str) -> Decision:
    """Dispatched where the kernel is faster than `baseline` (named in the reason) by more than the noise."""
    numbers = dict(baseline_us=baseline_us, kernel_us=kernel_us, noise_us=noise_us)
    if kernel_us >= baseline_us:
        return Decision(False, f"slower than {baseline} ({kernel_us:.2f} µs vs {baseline_us:.2f} µs)", **numbers)
    if baseline_us - kernel_us <= noise_us:
        return Decision(False, f"within timing noise of {baseline} ({kernel_us:.2f} µs vs {baseline_us:.2f} µs, "
                               f"noise {noise_us:.2f} µs)", **numbers)
    return Decision(True, f"{baseline_us / kernel_us:.2f}x faster than {baseline} ({kernel_us:.2f} µs vs "
                          f"{baseline_us:.2f} µs)", **numbers)


def decide(*, eager_us: float, dispatched_us: float, eager_noise_us: float, kernel_us: float | None,
           compile_us: float | None, compile_noise_us: float | None,
           no_compile: str = "never timed against torch.compile") -> tuple[Decision, Decision]:
    """The two decisions for one kernel: eager dispatch (pkg.apply) where it beats eager as
    dispatched, guard and launch included; compiled graphs (kforge.compile) where its GPU time
    beats the same card compiled alone by torch.compile, timed in the same reps. Without a
    torch.compile time there is no compile decision, and `no_compile` says why."""
    eager = beats(dispatched_us, eager_us, eager_noise_us, "eager as dispatched")
    if compile_us is None or kernel_us is None or compile_noise_us is None:
        return eager, Decision(None, no_compile)
    return eager, beats(kernel_us, compile_us, compile_noise_us, "torch.compile")


@dataclass
class Choice:
    """The candidate to ship for a card (None: nothing ships) and its two decisions."""

    candidate: CandidateRecord | None
    eager: Decision
    compiled: Decision

    @property
    def reason(self) -> str:
        return self.eager.reason


def _summary(evidence: dict, *names: str) -> dict:
    return next((evidence[n] for n in names if isinstance(evidence.get(n), dict)), {})


def _compile_decision(row: CandidateRecord, noise_factor: float, margin: float) -> tuple[float | None, str]:
    """(noise of the kernel against torch.compile, why there is no compile time) of a candidate."""
    evidence = row.evidence
    if row.compile_us is None:
        why = evidence.get("compile_error")
        return None, why if isinstance(why, str) and why else "never timed against torch.compile (searched without the compile baseline)"
    c_iqr, k_iqr = _summary(evidence, "compiled").get("iqr_us"), _summary(evidence, "kernel").get("iqr_us")
    return noise(row.compile_us, c_iqr, k_iqr, noise_factor=noise_factor, margin=margin), ""


def choose(rows: list[CandidateRecord], skip_reason: str | None, *, noise_factor: float = 1.0,
           margin: float = DEFAULT_MARGIN) -> Choice:
    """Decide twice (see decide()). For eager dispatch: the valid candidate with the lowest
    latency as dispatched, against eager as dispatched, noise from evidence["eager"/"dispatched"]
    IQRs (the kernel's standing in for the dispatched one). For compiled graphs: that same
    kernel when eager dispatches it (one kernel per card), else the valid candidate with the
    lowest GPU time, against its torch.compile time, noise from evidence["compiled"/"kernel"]."""
    def nothing(reason: str) -> Choice:
        return Choice(None, Decision(False, reason), Decision(False, reason))

    if skip_reason:
        return nothing(f"not searched: {skip_reason}")
    if not rows:
        return nothing("not searched: no candidate was evaluated")
    valid = [r for r in rows if r.verdict == Verdict.VALID.value]
    if not valid:
        counts = collections.Counter(r.verdict for r in rows)
        return nothing(f"no valid candidate ({len(rows)} tried: "
                       + ", ".join(f"{n} {v}" for v, n in counts.most_common()) + ")")
    trusted = [r for r in valid if "beyond_roofline" not in r.flags]
    if not trusted:
        return nothing("every valid candidate is faster than the HBM floor (flagged beyond_roofline); needs review")

    def compiled(row: CandidateRecord) -> Decision:
        c_noise, why = _compile_decision(row, noise_factor, margin)
        if c_noise is None:
            return Decision(None, why)
        return beats(row.kernel_us, row.compile_us, c_noise, "torch.compile")

    timed = [r for r in trusted if r.dispatched_us is not None]
    best = min(timed, key=lambda r: (r.dispatched_us, r.id)) if timed else None
    evidence = best.evidence if best is not None else {}
    eager_us = (_summary(evidence, "eager_dispatched").get("median_us") or best.eager_us) if best is not None else None
    if best is None or eager_us is None:
        eager = Decision(False, "valid, but never timed as dispatched (through the guard path)" if best is None
                         else "no eager timing to compare against")
    else:
        e_iqr = _summary(evidence, "eager_dispatched", "eager").get("iqr_us")
        d_iqr = _summary(evidence, "dispatched", "kernel").get("iqr_us")
        e_noise = noise(eager_us, e_iqr, d_iqr, noise_factor=noise_factor, margin=margin)
        c_noise, why = _compile_decision(best, noise_factor, margin)
        eager, on_compile = decide(eager_us=eager_us, dispatched_us=best.dispatched_us, eager_noise_us=e_noise,
                                   kernel_us=best.kernel_us, compile_us=best.compile_us,
                                   compile_noise_us=c_noise, no_compile=why)
        if eager.dispatched:
            return Choice(best, eager, on_compile)
    against = [r for r in trusted if r.compile_us is not None and r.kernel_us is not None]
    if not against:
        return Choice(None, eager, compiled(trusted[0]))
    fastest = min(against, key=lambda r: (r.kernel_us, r.id))
    on_compile = compiled(fastest)
    return Choice(fastest if on_compile.dispatched else None, eager, on_compile)


# ---- regions: what ships where they overlap ---------------------------------------------------

@dataclass(frozen=True)
class RegionOption:
    """A region card at one call site: the graph nodes it covers there and its evidence."""

    card: str
    nodes: frozenset  # node names of the call site's graph
    kernel_us: float | None  # the region's kernel as dispatched
    baseline_us: float | None  # the same nodes without it: their best op kernels, else eager

    @property
    def saving_us(self) -> float | None:
        return None if self.kernel_us is None or self.baseline_us is None else self.baseline_us - self.kernel_us


def choose_regions(options: Sequence[RegionOption], exact_limit: int = 16) -> list[RegionOption]:
    """Of a graph's region options, the non-overlapping set that saves the most time. An
    option saves its baseline minus its kernel (the nodes it does not cover keep their best
    op kernel or eager, so the total is minimal); one without both numbers or saving nothing
    is never chosen. Exact within each group of overlapping options of up to `exact_limit`,
    greedy by saving above that; ties go to the option listed first. Returned in input order."""
    useful = [o for o in options if o.saving_us is not None and o.saving_us > 0]
    groups: list[list[RegionOption]] = []
    for o in useful:  # connected components of the overlap relation
        touching = [g for g in groups if any(o.nodes & x.nodes for x in g)]
        merged = [x for g in touching for x in g] + [o]
        groups = [g for g in groups if g not in touching] + [merged]
    chosen: list[RegionOption] = []
    for g in groups:
        chosen += _best_disjoint(g) if len(g) <= exact_limit else _greedy_disjoint(g)
    order = {id(o): i for i, o in enumerate(options)}
    return sorted(chosen, key=lambda o: order[id(o)])


def _best_disjoint(group: list[RegionOption]) -> list[RegionOption]:
    best: tuple[float, list[RegionOption]] = (0.0, [])

    def walk(i: int, taken: list[RegionOption], covered: frozenset, saved: float) -> None:
        nonlocal best
        if i == len(group):
            if saved > best[0]:
                best = (saved, list(taken))
            return
        o = group[i]
        if not (o.nodes & covered):
            walk(i + 1, taken + [o], covered | o.nodes, saved + o.saving_us)
        walk(i + 1, taken, covered, saved)

    walk(0, [], frozenset(), 0.0)
    return best[1]


def _greedy_disjoint(group: list[RegionOption]) -> list[RegionOption]:
    taken: list[RegionOption] = []
    for o in sorted(group, key=lambda o: -o.saving_us):
        if not any(o.nodes & t.nodes for t in taken):
            taken.append(o)
    return taken


# ---- writing ------------------------------------------------------------------------------

def _compile_cubin(source: str, name: str, options: list[str], arch: str) -> bytes:
    from . import compiler

    return compiler.compile(source, name=name, options=options, arch=arch).cubin


def _nvrtc_version() -> str | None:
    from . import compiler

    try:
        return compiler.nvrtc_version()
    except CudaUnavailableError:
        return None


def _card_of(run_dir: Path, row: CardRecord) -> Card:
    """The card as saved under cards/, else as the log recorded it."""
    try:
        return load_card(run_dir, row.card_id)
    except CardError:
        return Card.from_json(row.card)


def _guard_entry(card: Card) -> dict:
    return {"id": card.id, "op": card.op, "schema": card.schema, "family": card.family, "summary": card.summary(),
            "calls": card.calls, "share": card.share, "module_paths": card.module_paths,
            "guard": {"args": [a.to_json() for a in card.args], "arch": card.arch},
            "outputs": [m.to_json() for m in card.outputs], "aliases": {str(k): v for k, v in card.aliases.items()},
            **({"region": card.region.to_json()} if card.region is not None else {})}


def _compile_entry(d: Decision) -> dict:
    decision = {True: "dispatched", False: "fallback", None: None}[d.dispatched]
    return {"decision": decision, "reason": d.reason[:MAX_TEXT], "compile_us": d.baseline_us, "kernel_us": d.kernel_us,
            "noise_us": d.noise_us}


def _card_entry(card: Card, choice: Choice, arch: str) -> tuple[dict, dict[str, bytes]]:
    """The manifest entry of one card and the files it adds. `decision` is eager dispatch's,
    `compile` kforge.compile's; the kernel ships where either dispatches it."""
    entry = _guard_entry(card)
    row = choice.candidate
    evidence = row.evidence if row is not None else {}
    entry.update(
        decision="fallback", reason=choice.eager.reason[:MAX_TEXT], kind=row.kind if row is not None else None,
        timing={"eager_us": row.eager_us if row is not None else card.eager_us,
                "kernel_us": row.kernel_us if row is not None else None,
                "eager_dispatched_us": choice.eager.baseline_us,
                "dispatched_us": row.dispatched_us if row is not None else None,
                "noise_us": choice.eager.noise_us},
        compile=_compile_entry(choice.compiled),
        error={"max_abs_err": row.max_abs_err if row is not None else None,
               "max_rel_err": row.max_rel_err if row is not None else None,
               "tolerances": evidence.get("tolerances")},
        flags=row.flags if row is not None else [],
        candidate=None, plan=None, files=None, hashes=None)
    if row is None:
        return entry, {}
    why = None if card.region is not None else dispatch_blocker(card)  # regions run through kforge.optimize
    if card.arch != arch:
        why = f"captured on {card.arch}, the package is for {arch}"
    if why:
        entry["reason"] = why
        if choice.compiled.dispatched:
            entry["compile"].update(decision="fallback", reason=why)
        return entry, {}
    plan = LaunchPlan.from_json(row.plan)
    try:
        cubin = _compile_cubin(row.source, f"{card.id}.cu", plan.options, arch)
    except (CompileError, CudaUnavailableError) as e:
        log.warning("card %s: recompiling its winner for %s failed; it falls back: %s", card.id, arch, e)
        first_line = str(e).splitlines()[0]
        entry["reason"] = f"the winning kernel did not compile for {arch} at packaging time: {first_line}"[:MAX_TEXT]
        if choice.compiled.dispatched:
            entry["compile"].update(decision="fallback", reason=entry["reason"])
        return entry, {}
    if cubin_sm(cubin) != _arch_sm(arch):
        raise PackageError(f"the compiler returned no {arch} cubin for card {card.id} (got sm {cubin_sm(cubin)}); "
                           "a package must carry cubins for its exact arch")
    if choice.compiled.dispatched:
        blocked = None if card.region is not None else customops.op_blocker(card)  # a region's op: kforge.compile's pass
        if blocked:
            entry["compile"].update(decision="fallback", reason=f"stays out of compiled graphs: {blocked}")
    if choice.eager.dispatched:
        entry["decision"] = "dispatched"
    if "dispatched" not in (entry["decision"], entry["compile"]["decision"]):
        return entry, {}
    source = row.source.encode()
    files = {"source": f"kernels/{card.id}.cu", "cubin": f"kernels/{card.id}.{arch}.cubin"}
    entry.update(plan=plan.to_json(), files=files,
                 hashes={"source": sha256(source), "cubin": sha256(cubin)},
                 candidate={"log_id": row.id, "digest": row.digest, "proposer": row.proposer,
                            "knobs": row.knobs, "note": (row.note or "")[:MAX_TEXT]})
    return entry, {files["source"]: source, files["cubin"]: cubin}


def write_package(run_dir: str | Path, out: str | Path, *, run_id: str | None = None, noise_factor: float = 1.0,
                  margin: float = DEFAULT_MARGIN, sign_key: str | Path | bytes | None = None) -> Path:
    """Package a search run: per card two decisions (see choose()), eager dispatch against eager
    as dispatched and compiled graphs against torch.compile, each beyond noise, and the kernel
    where either dispatches it; else the reasons it falls back. Returns the .cast path.
    With `sign_key` (an Ed25519 private key, PEM path or bytes) the checksums are signed.

    Raises PackageError when there is no log or run to package; a winner that no longer
    compiles falls back (logged) instead of failing the package.
    """
    import kforge

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / LOG_NAME).exists():
        raise PackageError(f"no search log in {run_dir}: run `kforge search` (or kforge.run) first")
    with SQLiteStore(run_dir) as slog:
        run_id = run_id or slog.latest_run()
        run = slog.run(run_id)
        if run is None:
            raise PackageError(f"no run {run_id!r} in {run_dir / LOG_NAME}: pass a run id the log holds")
        if not run.validated:
            raise PackageError(f"run {run_id} in {run_dir} ran without a GPU (compile-only): its kernels were never "
                               f"checked or timed, so none could be dispatched. Search on a machine with the GPU "
                               f"the package is for (`kforge search {run_dir}`, or `kforge run`), then package")
        card_rows = slog.cards(run_id)
        cards = [_card_of(run_dir, r) for r in card_rows]
        arch = run.arch or (cards[0].arch if cards else "")
        entries, members = [], {}
        for card, row in zip(cards, card_rows):
            choice = choose(slog.candidates(run_id, card.id), row.skip_reason, noise_factor=noise_factor, margin=margin)
            entry, files = _card_entry(card, choice, arch)
            entries.append(entry)
            members.update(files)
    regions = _region_decisions(run_dir, entries, members)
    dispatched = sum("dispatched" in (e["decision"], e["compile"]["decision"]) for e in entries)
    manifest = {
        "format": FORMAT, "kforge": kforge.__version__, "torch": torch.__version__,
        "cuda": {"nvrtc": _nvrtc_version() if dispatched else None, "torch_cuda": torch.version.cuda},
        "gpu": {"name": run.device or next((c.device_name for c in cards if c.device_name), ""), "arch": arch},
        "run_id": run_id, "selection": {"noise_factor": noise_factor, "margin": margin},
        "cards": entries,
        **({"regions": regions} if regions is not None else {}),
    }
    members[MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True).encode()
    check_manifest(out, members[MANIFEST])  # never write what load() would refuse
    castfile.write_zip(out, members, sign_key)
    log.info("packaged %s: a kernel for %d of %d cards, for %s", out, dispatched, len(entries), arch)
    return out


def _region_decisions(run_dir: Path, entries: list[dict], members: dict[str, bytes]) -> dict | None:
    """Region cards overlap each other and the op cards inside them. Each region's baseline is
    its eager replay less what the dispatched op cards of its nodes save; per captured call
    site (run_dir/regions.json) choose_regions keeps the non-overlapping set that saves the
    most. A dispatched region chosen at no site falls back. Returns the manifest's evidence."""
    from .region_capture import SITES

    by_id = {e["id"]: e for e in entries}
    region_entries = {e["id"]: e for e in entries if "region" in e}
    if not region_entries:
        return None
    for e in region_entries.values():
        eager = e["timing"]["eager_dispatched_us"] or e["timing"]["eager_us"]
        savings = {}
        for n in e["region"]["nodes"]:
            op = by_id.get(n.get("op_card"))
            if op is not None and op["decision"] == "dispatched":
                savings[op["id"]] = op["timing"]["eager_dispatched_us"] - op["timing"]["dispatched_us"]
        e["baseline"] = {"eager_us": eager, "op_savings_us": savings,
                         "baseline_us": eager - sum(savings.values()) if eager is not None else None}
    path = run_dir / SITES
    sites = json.loads(path.read_text())["sites"] if path.exists() else []
    report, chosen_ids = [], set()
    for graph in sorted({s["graph"] for s in sites}):
        here = [s for s in sites if s["graph"] == graph and s["card"] in region_entries]
        options = [RegionOption(s["card"], frozenset(s["nodes"]), region_entries[s["card"]]["timing"]["dispatched_us"],
                                region_entries[s["card"]]["baseline"]["baseline_us"])
                   for s in here if region_entries[s["card"]]["decision"] == "dispatched"]
        chosen = {id(o) for o in choose_regions(options)}
        chosen_ids |= {o.card for o in options if id(o) in chosen}
        report.append({"graph": graph, "options": [{"card": o.card, "nodes": sorted(o.nodes), "kernel_us": o.kernel_us,
                                                    "baseline_us": o.baseline_us, "chosen": id(o) in chosen}
                                                   for o in options]})
    for e in region_entries.values():
        if e["decision"] == "dispatched" and e["id"] not in chosen_ids:
            e.update(decision="fallback", reason="overlapping regions or the op kernels inside it save more at every "
                                                 "call site")
            if e["compile"]["decision"] != "dispatched":  # kforge.compile's pass chooses its own regions
                for name in e["files"].values():
                    members.pop(name, None)
                e.update(plan=None, files=None, hashes=None)
    return {"sites": report}


def record_model_check(path: str | Path, verdict: dict) -> None:
    """Write the model check's verdict on kforge.compile (kforge.modelcheck.ModelCheck.compile_record)
    into the .cast at `path`, as its manifest's "model_check", which kforge.compile follows. A
    signed package is refused: the rewrite changes its checksums, so the signature would not hold."""
    path = Path(path)
    members = castfile.read_members(path)
    castfile.verify_checksums(path, members)
    if SIGNATURE in members:
        raise PackageError(f"{path} is signed, and recording the model check would void its signature: re-sign it "
                           "after `kforge package` on an unsigned copy, or pass use_verdict=False to kforge.compile")
    manifest = check_manifest(path, members[MANIFEST])
    manifest.update(format=FORMAT, model_check=verdict)
    members[MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True).encode()
    check_manifest(path, members[MANIFEST])  # never write what load() would refuse
    castfile.write_zip(path, {k: v for k, v in members.items() if k != CHECKSUMS})


# ---- the manifest ---------------------------------------------------------------------------

def _present(e: dict, key: str, where: str) -> Any:
    if e.get(key) is None:
        raise PackageError(f"malformed manifest: {where}.{key} must be present for a dispatched card; rebuild the "
                           "package with `kforge package`")
    return e[key]


def _check_card(card: Card) -> None:
    """Raise CardError unless every field install() and report() read has the type they expect:
    a manifest is untrusted, and a bad field must fail the load, not a later install."""
    def ints(xs: Any, lo: int | None = None) -> bool:
        return isinstance(xs, tuple) and all(type(x) is int and (lo is None or x >= lo) for x in xs)

    if not isinstance(card.op, str) or not all(isinstance(a.name, str) for a in card.args):
        raise CardError("op and argument names must be strings")
    for a in card.args:
        if a.kind == "value":
            decode_value(a.value)
        elif not ((a.kind == "tensor" and a.tensor is not None) or (a.kind == "tensors" and isinstance(a.tensors, list))):
            raise CardError(f"argument {a.name!r} of kind {a.kind!r} carries no tensor metadata")
    for m in card.inputs + card.outputs:
        if not (ints(m.shape, 0) and ints(m.stride) and len(m.shape) == len(m.stride) and isinstance(m.device, str)
                and m.align in (1, 2, 4, 8, 16)):
            raise CardError(f"tensor metadata {m} is malformed")
        m.torch_dtype  # raises CardError for a dtype this torch does not have
    if not all(type(k) is int and type(v) is int for k, v in card.aliases.items()):
        raise CardError(f"aliases {card.aliases} must map output indices to input indices")


@dataclass(eq=False)
class PackagedCard:
    """One card of a package as it stands on this machine (decisions may differ from the manifest's)."""

    card: Card
    decision: str  # eager dispatch (pkg.apply): "dispatched" | "fallback"
    reason: str
    kind: str | None
    entry: dict  # the manifest entry: guard, evidence, hashes
    candidate: Candidate | None = None  # the kernel, where either decision dispatches it
    cubin: bytes | None = None
    counters: Counters = field(default_factory=Counters)
    compile_decision: str | None = None  # compiled graphs (kforge.compile): "dispatched" | "fallback" | None
    compile_reason: str = ""

    @property
    def id(self) -> str:
        return self.card.id

    @property
    def dispatched(self) -> bool:
        return self.decision == "dispatched"

    @property
    def compiled(self) -> bool:
        """Whether kforge.compile puts this card's kernel into compiled graphs."""
        return self.compile_decision == "dispatched"

    def fall_back(self, why: str) -> None:
        """Neither eager dispatch nor compiled graphs run the kernel here, because of `why`."""
        if self.dispatched:
            self.decision, self.reason = "fallback", why
        if self.compiled:
            self.compile_decision, self.compile_reason = "fallback", why


_OLD_FORMAT = ("the package predates torch.compile baselines (package format 1): its kernels stay out of "
               "compiled graphs; rebuild it with `kforge package` to decide them")


def _parse_compile(e: dict) -> tuple[str | None, str]:
    """(decision, reason) for compiled graphs (types checked by kforge.manifest); a format 1 entry has none."""
    c = e.get("compile")
    return (None, _OLD_FORMAT) if c is None else (c.get("decision"), c.get("reason") or "")


def _parse_card(e: dict, i: int, arch: str, members: dict[str, bytes]) -> PackagedCard:
    """One entry, already type-checked by kforge.manifest, as a typed card."""
    where = f"cards[{i}]"
    cid, guard, decision, reason = e["id"], e.get("guard") or {}, e["decision"], e["reason"]
    try:
        card = Card.from_json({"format": CARD_FORMAT, "id": cid, "op": e["op"], "schema": e["schema"],
                               "args": guard["args"], "outputs": e["outputs"], "aliases": e["aliases"],
                               "arch": guard["arch"], "family": e.get("family", "other"), "calls": e.get("calls", 0),
                               "share": e.get("share"), "module_paths": e.get("module_paths", []),
                               "region": e.get("region")})
        _check_card(card)
        if card.region is not None:
            card.region.check(len(card.inputs))
        hashes_to_id = card_id(card.op, card.args, card.arch, card.region) == cid
    except (KeyError, TypeError, ValueError, AttributeError, CardError) as err:
        raise PackageError(f"malformed manifest: {where} is not a valid card ({err!r}); rebuild the package") from err
    if not hashes_to_id:
        raise PackageError(f"malformed manifest: {where}'s guard does not hash to its id {cid}; the manifest was edited")
    compile_decision, compile_reason = _parse_compile(e)
    decisions = dict(compile_decision=compile_decision, compile_reason=compile_reason)
    if "dispatched" not in (decision, compile_decision):
        return PackagedCard(card, decision, reason, e.get("kind"), e, **decisions)
    kind, files, hashes = (_present(e, k, where) for k in ("kind", "files", "hashes"))
    want = {"source": f"kernels/{cid}.cu", "cubin": f"kernels/{cid}.{arch}.cubin"}
    if files != want or card.arch != arch:
        raise PackageError(f"malformed manifest: {where} must name files {want} and arch {arch}")
    for what, name in want.items():
        if name not in members or sha256(members[name]) != hashes[what]:
            raise PackageError(f"{where}: {name} is missing or does not match its hash in the manifest; rebuild the package")
    cubin = members[want["cubin"]]
    if cubin_sm(cubin) != _arch_sm(arch):
        raise PackageError(f"{where}: {want['cubin']} is not a cubin for {arch} (PTX or another arch); rebuild the package")
    try:
        plan = LaunchPlan.from_json(_present(e, "plan", where))
        plan.validate(len(card.inputs), len(card.outputs))
        source = members[want["source"]].decode()
    except (PlanError, UnicodeDecodeError) as err:
        raise PackageError(f"malformed manifest: {where}'s kernel is unusable: {err}") from err
    return PackagedCard(card, decision, reason, kind, e, Candidate(source, plan, kind), cubin, **decisions)


def _parse_cards(path: Path, manifest: dict, members: dict[str, bytes]) -> list[PackagedCard]:
    arch = manifest["gpu"]["arch"]
    cards = [_parse_card(e, i, arch, members) for i, e in enumerate(manifest["cards"])]
    referenced = {MANIFEST, CHECKSUMS, SIGNATURE} | {n for c in cards if c.candidate is not None
                                                     for n in c.entry["files"].values()}
    stray = sorted(set(members) - referenced)
    if stray:
        raise PackageError(f"{path} is not a safe .cast package: entries {stray} are not referenced by the manifest; "
                           "refusing to load it. Use packages written by `kforge package` from a source you trust.")
    return cards


def _device_arch() -> tuple[str | None, str]:
    """(arch, name) of the current CUDA device, or (None, why there is none)."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}", torch.cuda.get_device_name()


def load(path: str | Path, *, arch: str | None = None,
         trusted_keys: Iterable[str | Path | bytes] | None = None) -> "CastPackage":
    """Open a .cast. Raises PackageError if it is corrupt, unsafe, malformed or too new, or,
    given `trusted_keys` (Ed25519 public keys: PEM file paths or PEM bytes), if none of them
    signed it. Without trusted keys the audit (report()) says whether it was signed.

    `arch` is the GPU the package will run on (default: the current CUDA device's). When it
    differs from the package's, or there is no GPU, the package loads with every card
    falling back, and a PackageFallbackWarning says why.
    """
    path = Path(path)
    manifest, members, integrity = read_manifest(path, trusted_keys)
    pkg = CastPackage(path, manifest, _parse_cards(path, manifest, members), integrity)
    here, name = (arch, arch) if arch else _device_arch()
    if here is None:
        pkg._fall_back(f"{name}; the package's kernels need a {pkg.arch} GPU")
    elif here != pkg.arch:
        pkg._fall_back(f"the package was built for {pkg.arch} ({pkg.gpu}), this GPU is {here} ({name}); "
                       "rebuild the package on this GPU")
    for c in pkg.cards:
        why = (c.dispatched or c.compiled) and c.card.region is None and dispatch_blocker(c.card)
        if why:  # e.g. the op changed in this torch version
            c.fall_back(why)
            _warn(f"{path}: card {c.id} falls back: {why}")
    return pkg


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, PackageFallbackWarning, stacklevel=3)


# ---- the package -----------------------------------------------------------------------------

class CastPackage:
    """A loaded .cast: install() routes its dispatched cards' exact calls to its kernels."""

    def __init__(self, path: Path, manifest: dict, cards: list[PackagedCard],
                 integrity: str = "built in memory, not read from a .cast"):
        self.path = path
        self.manifest = manifest
        self.cards = cards
        self.integrity = integrity  # signed by a trusted key, signed but unchecked, or unsigned
        self._dispatcher: Dispatcher | None = None

    @property
    def arch(self) -> str:
        return self.manifest["gpu"]["arch"]

    @property
    def gpu(self) -> str:
        return self.manifest["gpu"]["name"]

    @property
    def installed(self) -> bool:
        return self._dispatcher is not None

    def _fall_back(self, why: str) -> None:
        active = [c for c in self.cards if c.dispatched or c.compiled]
        for c in active:
            c.fall_back(why)
        if active:
            which = "its kernel falls" if len(active) == 1 else f"all {len(active)} kernels fall"
            _warn(f"{self.path}: {which} back to PyTorch: {why}")

    # ---- installing -------------------------------------------------------------------
    def install(self, *, dispatcher: Dispatcher | None = None, launcher: Launcher | None = None) -> None:
        """Override the ops of the dispatched cards. `dispatcher` defaults to the shared CUDA one,
        `launcher` to the C++ registry with this package's cubins loaded on the current device
        (see variants(): without a GPU that registry's absence makes every card fall back)."""
        if self.installed:
            raise PackageError(f"{self.path} is already installed; call uninstall() first")
        dispatcher = dispatcher or Dispatcher.shared("CUDA")
        active = self.variants(launcher)
        if active:
            dispatcher.add(self, active)
        self._dispatcher = dispatcher
        log.info("installed %s: %d kernels over %s", self.path, len(active), ", ".join(sorted({v.card.op for v in active})))

    def variants(self, launcher: Launcher | None = None, *, compiled: bool = False) -> list[Variant]:
        """The dispatched single-op cards' kernels, in card order, launched by `launcher`
        (default: a new self.launcher()); each counts into its card's counters. compiled=True:
        the cards kforge.compile dispatches (their compile decision) instead of eager's. Variant
        ids are positions among kernel_cards() (the launcher's registry order); region cards
        are dispatched by kforge.optimize, not by an aten override. Where the default launcher
        cannot be made (no GPU or driver, a cubin the driver refuses) every card falls back,
        with a PackageFallbackWarning, and there are none: a package never fails the program."""
        active = [(i, c) for i, c in enumerate(self.kernel_cards())
                  if c.card.region is None and (c.compiled if compiled else c.dispatched)]
        if not active:
            return []
        if launcher is None:
            try:
                launcher = self.launcher()
            except KforgeError as e:  # nothing has run yet: PyTorch serves every call
                self._fall_back(f"its kernels cannot be loaded here: {e}")
                return []
        return [Variant(c.card, i, launcher, tuple(n for n, _ in c.candidate.plan.workspace_bytes()), c.counters)
                for i, c in active]

    def kernel_cards(self) -> list[PackagedCard]:
        """The cards whose kernel runs here, eager or compiled: the launcher's registry order."""
        return [c for c in self.cards if c.dispatched or c.compiled]

    def launcher(self) -> RegistryLauncher:
        """The C++ registry of the dispatched cards' kernels, loaded on the current device (in
        install()'s variant order). install() makes one each time unless given one: pass the
        same launcher to install the package again and again without reloading its cubins.
        Raises CudaUnavailableError without a GPU, LaunchError if the driver refuses a cubin."""
        if not torch.cuda.is_available():
            raise CudaUnavailableError(f"no CUDA GPU or driver is visible, and the package's kernels need a {self.arch} GPU")
        registry = RegistryLauncher([(c.candidate, c.cubin) for c in self.kernel_cards()])
        registry.prepare(torch.cuda.current_device())  # load now, not inside a forward or a graph capture
        return registry

    def uninstall(self) -> None:
        """Remove this package's kernels; other installed packages keep theirs."""
        if self._dispatcher is not None:
            self._dispatcher.remove(self)
            self._dispatcher = None

    def optimize(self, model: torch.nn.Module, **options: Any):
        """kforge.optimize(model, self): the model traced, with this package's region kernels
        in its graphs and its op kernels through the aten overrides."""
        from .optimize import optimize

        return optimize(model, self, **options)

    @contextlib.contextmanager
    def apply(self, **install_options: Any) -> Iterator["CastPackage"]:
        """`with pkg.apply(): model(x)`: installed inside the block, uninstalled after, even on error."""
        self.install(**install_options)
        try:
            yield self
        finally:
            self.uninstall()

    # ---- inside torch.compile (kforge.inductor) ---------------------------------------
    @property
    def digest(self) -> str:
        """Identity of what this package does here: its manifest (which holds every kernel's hash)
        and each card's decision on this machine. Inductor's caches key on it."""
        state = [self.manifest, [(c.id, c.decision, c.compile_decision) for c in self.cards]]
        return sha256(json.dumps(state, sort_keys=True, default=str).encode())

    def compile(self, model: Any, **torch_compile_options: Any) -> Any:
        """kforge.compile(model, self, ...): torch.compile with this package's kernels in the graphs."""
        from .inductor import compile

        return compile(model, self, **torch_compile_options)

    def inductor_options(self, *, launcher: Launcher | None = None) -> dict:
        """Options for torch.compile(model, options=...) that install this package's pass (see
        kforge.inductor.options)."""
        from .inductor import options

        return options(self, launcher=launcher)

    def compile_verdict(self) -> str:
        """One line: what the model check found of kforge.compile against torch.compile, and what
        kforge.compile does with this package because of it."""
        check = self.manifest.get("model_check")
        if not check:
            return "model check: kforge.compile not checked against torch.compile on the model (cards decide alone)"
        line = (f"model check on {check.get('device') or self.gpu}: torch.compile {check['torch_compile_us']:.1f} µs, "
                f"kforge.compile {check['kforge_compile_us']:.1f} µs, {check['verdict']}")
        if check["use"] == "torch.compile":
            return line + ": kforge.compile runs plain torch.compile for this package"
        drop = check.get("drop") or []
        return line + (f": kforge.compile leaves out {', '.join(drop)}" if drop else ": kforge.compile uses its kernels")

    # ---- auditing ---------------------------------------------------------------------
    def report(self, fmt: str = "dict") -> dict | Table:
        """Per card: dispatched or fallback and why, in eager dispatch and in compiled graphs
        (compile: none where there was no torch.compile time to decide against), kind, hits,
        fallbacks by reason; and what the package's integrity rests on (signature or checksums
        only). fmt="table" gives a rich Table. Calls replayed from a CUDA graph are not counted."""
        rows = [{"id": c.id, "op": c.card.op, "summary": c.card.summary(), "decision": c.decision,
                 "reason": c.reason, "compile": c.compile_decision or "none", "compile_reason": c.compile_reason,
                 "kind": c.kind, "hits": c.counters.hits, "fallbacks": dict(c.counters.fallbacks)} for c in self.cards]
        if fmt == "dict":
            return {"package": str(self.path), "gpu": self.gpu, "arch": self.arch, "installed": self.installed,
                    "integrity": self.integrity, "dispatched": sum(c.dispatched for c in self.cards),
                    "model_check": self.manifest.get("model_check"), "cards": rows}
        if fmt != "table":
            raise ValueError(f"fmt must be 'dict' or 'table', got {fmt!r}")
        # Every cell is Text: package text is data, never rich markup ("[/]" or "[link=...]" in a reason).
        seen = [r for r in REASONS if any(r in row["fallbacks"] for row in rows)]  # what each counted reason means
        caption = "\n".join([self.integrity] + [f"{r}: {meaning(r)}" for r in seen])
        table = Table(title=Text(f"{self.path.name} ({self.arch}, {'installed' if self.installed else 'not installed'})"),
                      caption=Text(caption))
        for col in ("card", "op", "decision", "compile", "kind", "hits", "fallbacks", "why", "why (compile)"):
            table.add_column(col, justify="right" if col == "hits" else "left")
        for r in rows:
            falls = ", ".join(f"{k} {v}" for k, v in sorted(r["fallbacks"].items())) or "-"
            table.add_row(*map(Text, (r["id"], r["summary"], r["decision"], r["compile"], r["kind"] or "-",
                                      str(r["hits"]), falls, r["reason"], r["compile_reason"])))
        return table

    def verify(self, *, devices: list[int] | None = None, **evaluator_options: Any) -> dict[str, EvalResult]:
        """Re-validate every kernel the package runs (eager or compiled) on this machine through
        kforge.evaluate (fresh inputs, the same checks as the search; no torch.compile baseline
        unless asked). Kernels that fail fall back from now on. Raises CudaUnavailableError
        without a GPU."""
        if not torch.cuda.is_available():
            raise CudaUnavailableError("verify() re-runs every dispatched kernel on this GPU, and no CUDA GPU is "
                                       "visible here: run it on the machine that will use the package")
        from . import evaluate

        results: dict[str, EvalResult] = {}
        with tempfile.TemporaryDirectory(prefix="kforge-verify-") as run_dir:
            evaluator = evaluate.make_evaluator(run_dir, devices=devices,
                                                **{"compile_baseline": False, **evaluator_options})
            try:
                for c in [c for c in self.cards if c.dispatched or c.compiled]:
                    results[c.id] = evaluator.evaluate(c.card, c.candidate)
            finally:
                evaluator.close()
        failed = [c for c in self.cards if c.id in results and results[c.id].verdict.failed]
        for c in failed:
            why = f"failed verification here: {results[c.id].verdict.value}: {results[c.id].message}"
            c.fall_back(why)
            _warn(f"{self.path}: card {c.id} {why}")
        if failed and self.installed:
            dispatcher = self._dispatcher
            self.uninstall()
            self.install(dispatcher=dispatcher)
        return results
