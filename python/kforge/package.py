"""The .cast package: per card the kernel that won or the reason it falls back, and a loader
that treats every package as untrusted input. Which kernel wins is kforge.winners, writing one
kforge.package_write, its cards as loaded kforge.package_cards; this module loads and runs one.

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

import contextlib
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from rich.table import Table
from rich.text import Text

from .castfile import sha256
from .dispatch import Dispatcher, Launcher, RegistryLauncher, Variant, dispatch_blocker
from .errors import CudaUnavailableError, KforgeError, PackageError
from .guards import REASONS, meaning
from .manifest import read_manifest
from .package_cards import PackagedCard, parse_cards
from .package_write import check_package, record_model_check, write_package
from .verdict import EvalResult
from .winners import RegionOption, choose_regions

# Users write, choose and load packages through kforge.package (docs/interfaces.md); the
# writer and the choice of winners are modules of their own.
__all__ = ["CastPackage", "PackagedCard", "PackageFallbackWarning", "RegionOption", "choose_regions", "load",
           "check_package", "record_model_check", "write_package"]

log = logging.getLogger("kforge.package")


class PackageFallbackWarning(UserWarning):
    """A package loaded, but some or all of its kernels will not run on this machine."""


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
    pkg = CastPackage(path, manifest, parse_cards(path, manifest, members), integrity)
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
