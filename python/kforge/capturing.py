"""One capture of a model: its op cards recorded (kforge.op_capture) and, when asked, its region
cards (kforge.region_capture), each timed and given its share (kforge.shares), then written to
the run directory. `kforge.capture(...)` is `capture` here."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .card_files import save_card, save_sample
from .cards import Card
from .errors import CaptureError
from .modelrun import Target, as_call, model_device, model_state, model_wall_us
from .op_capture import Recorder, record
from .shares import assign_shares, time_entry, time_fn

MAX_SAMPLE_BYTES = 256 * 2**20


@dataclass
class CaptureResult:
    cards: list[Card]  # ranked by share
    run_dir: Path
    total_us: float  # captured runtime: card time over the calls not nested in another card's call
    model_us: float  # the model's measured wall time per forward, for context
    device: str
    notes: list[str] = field(default_factory=list)

    @property
    def coverage(self) -> float:
        """Captured runtime over measured wall time (the rest is Python and dispatch overhead)."""
        return self.total_us / self.model_us if self.model_us > 0 else 0.0

    def to_json(self) -> dict:
        return {"run_dir": str(self.run_dir), "device": self.device, "total_us": self.total_us,
                "model_us": self.model_us, "coverage": self.coverage, "notes": self.notes,
                "cards": [c.id for c in self.cards]}


def capture(model: torch.nn.Module, example_inputs: Any, run_dir: str | Path | None = None, *,
            device: str | torch.device | None = None, eval_mode: bool = True, no_grad: bool = True,
            max_samples_per_card: int = 1, max_sample_bytes: int = MAX_SAMPLE_BYTES,
            time_cards: bool = True, progress: Callable[[str], None] | None = None,
            regions: bool = False) -> CaptureResult:
    """Run `model` on `example_inputs` and write one card per distinct backend call under run_dir/cards/.

    regions: also trace the model into aten graphs and write a region card per distinct
    fusable region (kforge.region_capture); a model that cannot be traced still gets its op
    cards, and a note per graph break.

    example_inputs: a tensor, a tuple/list of tensors (positional) or a dict of tensors (keyword).
    device: when given, the model and the inputs are moved there first (the model in place).
    progress: called with a short line as each stage starts (a large model takes minutes).
    Raises CaptureError when the inputs do not fit or the model raises (naming module and op).
    """
    say = progress or (lambda line: None)
    if run_dir is not None:
        check_run_dir(Path(run_dir))
    if device is not None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise CaptureError(f"device={device!r} asked for, but torch sees no CUDA GPU here "
                               f"(torch {torch.__version__}; `kforge doctor` says more): capture on the CPU or on a GPU machine")
        model.to(device)
    args, kwargs = as_call(example_inputs, None if device is None else torch.device(device))
    dev = model_device(model, args, kwargs)
    target = Target.of(dev)

    with model_state(model, eval_mode), (torch.no_grad() if no_grad else contextlib.nullcontext()):
        say(f"running the model on {dev} to record the ops it calls")
        rec, notes = record(model, args, kwargs, target, max_samples_per_card, max_sample_bytes)
        say("timing the model's forward")
        model_us = model_wall_us(model, args, kwargs, dev)
        region_entries, alone = _capture_regions(model, args, kwargs, target, max_sample_bytes, notes) if regions \
            else ([], set())
    cards = rec.finish()
    notes += rec.notes()
    if time_cards:
        for i, entry in enumerate(rec.entries.values()):
            if i % 25 == 0:
                say(f"timing cards: {i} of {len(rec.entries)}")
            time_entry(entry, dev)
        if region_entries:
            from .region_capture import time_entries

            say(f"timing {len(region_entries)} region cards")
            time_entries(region_entries, dev, time_fn)
    total_us = assign_shares(rec)
    for e in region_entries:  # a share of the same runtime as the op cards', overlapping theirs
        c = e.card
        c.share = c.total_us / total_us if c.total_us is not None and total_us > 0 else None
        cards.append(c)
    cards.sort(key=lambda c: -(c.share or 0.0))
    say(f"writing {len(cards)} cards")
    # Made only now: a capture that fails must not leave an empty directory behind.
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="kforge-capture-"))
    result = CaptureResult(cards, run_dir, total_us, model_us, str(dev), notes)
    _write(result, rec, region_entries, alone)
    return result


def _capture_regions(model, args, kwargs, target: Target, max_sample_bytes: int,
                     notes: list[str]) -> tuple[list, set[str]]:
    from . import graph
    from .region_capture import region_cards

    entries, more, alone = region_cards(graph.trace(model, args, kwargs), target.arch, target.device_name,
                                        max_sample_bytes=max_sample_bytes)
    notes += more
    return entries, alone


def check_run_dir(run_dir: Path) -> None:
    """Before the model runs: a run directory the cards cannot go into, or one whose search
    log would be left describing other cards, is refused with what to do instead."""
    from .store import LOG_NAME

    if run_dir.exists() and not run_dir.is_dir():
        raise CaptureError(f"run directory {run_dir} is a file: give a directory (it is created when missing)")
    _check_writable(run_dir)
    if (run_dir / LOG_NAME).exists():
        raise CaptureError(
            f"{run_dir} already holds the search log of an earlier run ({LOG_NAME}); capturing there would "
            f"replace its cards under that log. Capture into a new directory, continue that run with "
            f"`kforge run --resume --run-dir {run_dir}`, or delete {run_dir} first.")


def _check_writable(run_dir: Path) -> None:
    """The directory can be made and written (not under a file, /proc or a read-only mount).
    Tried for real, since permission bits do not tell (root may write anywhere, /proc refuses
    mkdir); what the probe creates is removed, so a capture that fails leaves nothing behind."""
    missing, existing = [], run_dir
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise CaptureError(f"run directory {run_dir} is under {existing}, which is a file: give a directory path")
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as e:
        raise CaptureError(f"cannot write run directory {run_dir} ({e.strerror or e}): give a directory you can "
                           f"create files in, like ./runs/NAME") from None
    finally:
        for d in reversed(made):
            d.rmdir()


def _write(result: CaptureResult, rec: Recorder, region_entries: Sequence = (), alone: set[str] = frozenset()) -> None:
    """run_dir/cards/<id>/{card.json, sample<i>.safetensors} and run_dir/capture.json (replaced)."""
    cards_root = result.run_dir / "cards"
    if cards_root.exists():
        shutil.rmtree(cards_root)  # cards of an earlier capture must not mix with these
    for e in rec.entries.values():
        for i, (ins, outs) in enumerate(e.samples):
            save_sample(e.card, result.run_dir, i, ins, outs)
        save_card(e.card, result.run_dir)
    for e in region_entries:
        if e.sample is not None:
            save_sample(e.card, result.run_dir, 0, *e.sample)
        save_card(e.card, result.run_dir)
    if region_entries:  # where each region card was seen: the packager chooses among overlapping ones per site
        from .region_capture import SITES

        sites = [dict(site, card=e.card.id) for e in region_entries for site in e.sites]
        # and which op cards the traced graphs call outside every region (the search's order)
        (result.run_dir / SITES).write_text(json.dumps({"sites": sites, "alone": sorted(alone)}, indent=1))
    (result.run_dir / "capture.json").write_text(json.dumps(result.to_json(), indent=1))
