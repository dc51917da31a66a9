"""Writing a .cast from a search run: the winners (kforge.winners) recompiled for the package's
arch, their manifest entries, and the zip (kforge.castfile); and the model check's verdict
written into a package afterwards."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from . import castfile, customops
from .candidate import LaunchPlan
from .card_files import load_card
from .cards import Card
from .castfile import CHECKSUMS, MANIFEST, SIGNATURE, sha256
from .dispatch import dispatch_blocker
from .errors import CardError, CompileError, CudaUnavailableError, PackageError
from .manifest import FORMAT, MAX_TEXT, arch_sm, check_manifest, cubin_sm
from .store import LOG_NAME, CardRecord, SQLiteStore
from .winners import DEFAULT_MARGIN, Choice, Decision, RegionOption, choose, choose_regions

log = logging.getLogger("kforge.package")


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
    if cubin_sm(cubin) != arch_sm(arch):
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


def _gpu_times(e: dict) -> tuple[float, float] | None:
    """(eager, kernel) GPU time of an entry's call, each timed alone, or None where either is missing."""
    t = e.get("timing") or {}
    return (t["eager_us"], t["kernel_us"]) if t.get("eager_us") and t.get("kernel_us") else None


def _region_decisions(run_dir: Path, entries: list[dict], members: dict[str, bytes]) -> dict | None:
    """Region cards overlap each other and the op cards inside them. Each region's baseline is
    its eager time less what the dispatched op cards of its nodes save; per captured call
    site (run_dir/regions.json) choose_regions keeps the non-overlapping set that saves the
    most. A dispatched region chosen at no site falls back. Returns the manifest's evidence.

    The times are GPU times, each call timed alone ("basis": "gpu"), where the region and the op
    cards inside it have them, else as dispatched ("dispatched"). Overlapping regions of a few
    small kernels differ by less than the host's jitter as dispatched: ConvNeXt-V2-T's GELU + norm
    of 6272 x 1536 saved 18 µs of GPU time against its GELU alone's 12 on the H100, yet lost to it,
    and the norm ran eagerly (a replay from CUDA graphs pays GPU time alone)."""
    from .region_capture import SITES

    by_id = {e["id"]: e for e in entries}
    region_entries = {e["id"]: e for e in entries if "region" in e}
    if not region_entries:
        return None
    for e in region_entries.values():
        ops = [op for n in e["region"]["nodes"] if (op := by_id.get(n.get("op_card"))) is not None
               and op["decision"] == "dispatched"]
        gpu = [_gpu_times(x) for x in (e, *ops)]
        if all(t is not None for t in gpu):
            basis, (eager, kernel) = "gpu", gpu[0]
            savings = {op["id"]: eager_op - kernel_op for op, (eager_op, kernel_op) in zip(ops, gpu[1:])}
        else:
            basis, eager, kernel = "dispatched", e["timing"]["eager_dispatched_us"] or e["timing"]["eager_us"], \
                e["timing"]["dispatched_us"]
            savings = {op["id"]: op["timing"]["eager_dispatched_us"] - op["timing"]["dispatched_us"] for op in ops}
        e["baseline"] = {"basis": basis, "eager_us": eager, "kernel_us": kernel, "op_savings_us": savings,
                         "baseline_us": eager - sum(savings.values()) if eager is not None else None}
    path = run_dir / SITES
    sites = json.loads(path.read_text())["sites"] if path.exists() else []
    report, chosen_ids = [], set()
    for graph in sorted({s["graph"] for s in sites}):
        here = [s for s in sites if s["graph"] == graph and s["card"] in region_entries]
        options = [RegionOption(s["card"], frozenset(s["nodes"]), region_entries[s["card"]]["baseline"]["kernel_us"],
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


def check_package(model: Any, example_inputs: Any, package, *, leave_one_out: int = 0,
                  **install_options: Any) -> Any:
    """kforge.modelcheck.check_model as `kforge run` makes it, its ModelCheck returned:
    kforge.compile timed too where the package has kernels for compiled graphs, and the verdict
    on it written into the package file (manifest "model_check"), which kforge.compile follows."""
    from .modelcheck import check_model

    check = check_model(model, example_inputs, package, with_compile=any(c.compiled for c in package.cards),
                        leave_one_out=leave_one_out, **install_options)
    record = check.compile_record()
    if record is not None:
        record_model_check(package.path, record)
    return check
