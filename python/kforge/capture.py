"""Model -> operator cards: record the aten calls that reach the backend, without touching the model.

How: a TorchDispatchMode sees every op that survives decomposition; each op that has a real
kernel at the device's backend key (CUDA, or CPU in tests) is then overridden there with
`torch.library` (the original kernel taken with `torch.library.get_kernel`), exactly where a
`.cast` package will intercept it later. Inside each override a fresh mode watches the calls the
kernel itself makes (clone -> empty_strided + copy_, mean -> sum + div_, ...), so nested calls
are found too. The model runs again until no new op shows up; the last run is the recording.

Shares: a card's share is `eager_us * calls / total_us`, where `total_us` sums the cards' time
over the calls that are not nested in another recorded call. The shares of top-level cards add up
to 1; a nested card's share is part of its parent's (the card's notes say so).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from . import composite
from .boxing import call_original
from .cards import (ArgSpec, Card, TensorMeta, encode_value, flatten_outputs, pack, save_card, save_sample, unpack)
from .errors import CaptureError, CardError
from .families import family_of

# Every family but views and vendor ops: whether a card is searched is then up to the
# proposer (`supports`), so `other` ops (cumsum, index, scatter, cat, ...) reach the LLM. A
# region card (capture(regions=True)) is searched like the families it fuses.
SEARCHABLE = frozenset({"pointwise", "reduction", "normalization", "pooling", "other", "region"})

_SKIP_REASONS = {
    "view": "view/metadata op: no kernel to write",
    "vendor": "vendor-backed (cuBLAS/cuDNN): skipped unless asked",
}

MAX_SAMPLE_BYTES = 256 * 2**20
_MAX_RUNS = 6  # discovery runs before giving up on ops that keep appearing
_ROOT = "(root)"  # module path of ops run by the model's own forward
# torch warns once per process when an aten kernel is overridden; that is what capture does on purpose.
_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel"


def skip_reason(card: Card) -> str | None:
    """Why the search leaves this card alone, or None when it is searchable."""
    if card.family in SEARCHABLE:
        return None
    return _SKIP_REASONS.get(card.family, f"family {card.family!r} is not searched")


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
    args, kwargs = _as_call(example_inputs, None if device is None else torch.device(device))
    dev = _model_device(model, args, kwargs)
    target = _Target.of(dev)

    with _model_state(model, eval_mode), (torch.no_grad() if no_grad else contextlib.nullcontext()):
        say(f"running the model on {dev} to record the ops it calls")
        rec, notes = _record(model, args, kwargs, target, max_samples_per_card, max_sample_bytes)
        say("timing the model's forward")
        model_us = _model_wall_us(model, args, kwargs, dev)
        region_entries = _capture_regions(model, args, kwargs, target, max_sample_bytes, notes) if regions else []
    cards = rec.finish()
    notes += rec.notes()
    if time_cards:
        for i, entry in enumerate(rec.entries.values()):
            if i % 25 == 0:
                say(f"timing cards: {i} of {len(rec.entries)}")
            _time_entry(entry, dev)
        if region_entries:
            from .region_capture import time_entries

            say(f"timing {len(region_entries)} region cards")
            time_entries(region_entries, dev, _time_fn)
    total_us = _assign_shares(rec)
    for e in region_entries:  # a share of the same runtime as the op cards', overlapping theirs
        c = e.card
        c.share = c.total_us / total_us if c.total_us is not None and total_us > 0 else None
        cards.append(c)
    cards.sort(key=lambda c: -(c.share or 0.0))
    say(f"writing {len(cards)} cards")
    # Made only now: a capture that fails must not leave an empty directory behind.
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="kforge-capture-"))
    result = CaptureResult(cards, run_dir, total_us, model_us, str(dev), notes)
    _write(result, rec, region_entries)
    return result


def _capture_regions(model, args, kwargs, target: _Target, max_sample_bytes: int, notes: list[str]) -> list:
    from . import graph
    from .region_capture import region_cards

    entries, more = region_cards(graph.trace(model, args, kwargs), target.arch, target.device_name,
                                 max_sample_bytes=max_sample_bytes)
    notes += more
    return entries


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


# ---- inputs and device ------------------------------------------------------------------

def _as_call(inputs: Any, move_to: torch.device | None) -> tuple[tuple, dict]:
    move = (lambda t: t.to(move_to)) if move_to is not None else (lambda t: t)
    if isinstance(inputs, torch.Tensor):
        return (move(inputs),), {}
    if isinstance(inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(move(t) for t in inputs), {}
    if isinstance(inputs, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in inputs.items()):
        return (), {k: move(v) for k, v in inputs.items()}
    raise CaptureError(
        f"example inputs must be a tensor, a tuple/list of tensors (passed positionally) or a dict of "
        f"tensors (passed as keywords); got {_describe(inputs)}. Wrap other arguments into the model "
        f"(a small nn.Module or functools.partial) so that only tensors are passed.")


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    if isinstance(x, dict):
        return f"dict of ({', '.join(f'{k!r}: {type(v).__name__}' for k, v in x.items())})"
    return type(x).__name__


def _model_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """The one device the model's parameters and all inputs are on."""
    tensors = [(f"input {i}", t) for i, t in enumerate(args)] + [(f"input {k!r}", t) for k, t in kwargs.items()]
    state = next(iter(model.parameters()), None)
    state = state if state is not None else next(iter(model.buffers()), None)
    if state is not None:
        dev, owner = state.device, "the model's parameters are"
    elif tensors:
        dev, owner = tensors[0][1].device, f"{tensors[0][0]} is"
    else:
        raise CaptureError("the model has no parameters and no example inputs: pass at least one input tensor")
    for where, t in tensors:
        if t.device != dev:
            raise CaptureError(
                f"{where} is on {t.device} but {owner} on {dev}: pass example inputs on {dev} "
                f"(x.to('{dev}')), or pass device= to capture() to move the model and the inputs together")
    if dev.type not in ("cpu", "cuda"):
        raise CaptureError(f"capture runs models on CPU or CUDA, not {dev.type}: move the model and inputs")
    return dev


@dataclass(frozen=True)
class _Target:
    """Where calls are intercepted: the backend dispatch key, and what cards say of the device."""

    device: torch.device
    key: str  # "CUDA" or "CPU"
    arch: str
    device_name: str

    @staticmethod
    def of(dev: torch.device) -> "_Target":
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            return _Target(dev, "CUDA", f"sm_{major}{minor}", torch.cuda.get_device_name(dev))
        return _Target(dev, "CPU", "cpu", "cpu")


@contextlib.contextmanager
def _model_state(model: torch.nn.Module, eval_mode: bool) -> Iterator[None]:
    """eval() for the capture, then give every module back the training flag it had."""
    flags = {m: m.training for m in model.modules()}
    if eval_mode:
        model.eval()
    try:
        yield
    finally:
        for m, training in flags.items():
            m.training = training


def _run_model(model, args, kwargs):
    return model(*args, **kwargs)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _model_wall_us(model, args, kwargs, dev: torch.device, reps: int = 3) -> float:
    """Median wall time of plain forwards (no overrides, no hooks)."""
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        _run_model(model, args, kwargs)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# ---- where in the model ---------------------------------------------------------------

class _ModulePaths:
    """The path of the innermost module whose forward is running, kept with forward hooks.

    Post-hooks do not run when a forward raises, so after an error the stack still ends at the
    module that raised: that is what the error message names.
    """

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.kinds: dict[str, str] = {}
        self._handles = []
        for name, m in model.named_modules():
            path = name or _ROOT
            self.kinds[path] = type(m).__name__
            self._handles.append(m.register_forward_pre_hook(lambda _m, _a, p=path: self.stack.append(p)))
            self._handles.append(m.register_forward_hook(lambda _m, _a, _o, p=path: self._leave(p)))

    def _leave(self, path: str) -> None:
        # Pop down to this module: a child that raised and was caught never popped itself.
        while self.stack and self.stack.pop() != path:
            pass

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else _ROOT

    def describe(self, path: str) -> str:
        return f"module '{path}' ({self.kinds[path]})" if path in self.kinds else f"module '{path}'"

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ---- one recorded card ----------------------------------------------------------------

@dataclass
class _Entry:
    card: Card
    top_calls: int = 0  # calls not nested in another recorded call
    parents: Counter = field(default_factory=Counter)  # op of the recorded call it ran inside -> calls
    samples: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)  # CPU copies
    outputs_vary: bool = False


@dataclass
class _Call:
    entry: _Entry
    op: torch._ops.OpOverload
    inputs_copy: list[torch.Tensor] | None  # CPU copies taken before the call, when sampling


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """cards.faithful_clone onto the CPU: strides, storage offset and alignment kept."""
    return unpack(pack(t), TensorMeta.of(t), "cpu")


def _bytes(ts: list[torch.Tensor]) -> int:
    return sum(TensorMeta.of(t).span() * t.element_size() for t in ts)


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every argument; boxed kernels leave defaults out."""
    bound = []
    for i, a in enumerate(op._schema.arguments):
        if not a.kwarg_only and i < len(args):
            v = args[i]
        elif a.name in kwargs:
            v = kwargs[a.name]
        else:
            v = a.default_value if a.has_default_value() else None
        bound.append((a, v))
    return bound


def _arg_specs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list[ArgSpec], list[torch.Tensor]]:
    """ArgSpecs in schema order and the tensor inputs in cards' launch-plan order."""
    specs, tensors = [], []
    for a, v in _bind(op, args, kwargs):
        written = a.alias_info is not None and a.alias_info.is_write
        if isinstance(v, torch.Tensor):
            specs.append(ArgSpec(a.name, "tensor", a.kwarg_only, tensor=TensorMeta.of(v), written=written))
            tensors.append(v)
        elif isinstance(v, (list, tuple)) and "Tensor" in str(a.type):
            specs.append(ArgSpec(a.name, "tensors", a.kwarg_only, written=written,
                                 tensors=[TensorMeta.of(t) if t is not None else None for t in v]))
            tensors += [t for t in v if t is not None]
        else:
            specs.append(ArgSpec(a.name, "value", a.kwarg_only, value=encode_value(v)))
    return specs, tensors


def _aliases(op: torch._ops.OpOverload, specs: list[ArgSpec], out: Any) -> dict[int, int]:
    """Output index -> input index for outputs the schema says are a written input (relu_, add_, out=)."""
    written_at, idx = {}, 0
    for a, spec in zip(op._schema.arguments, specs):
        if spec.kind == "tensor":
            if a.alias_info is not None and a.alias_info.is_write:
                written_at[frozenset(a.alias_info.before_set)] = idx
            idx += 1
        elif spec.kind == "tensors":
            idx += sum(m is not None for m in spec.tensors)
    rets = op._schema.returns
    values = [out] if len(rets) == 1 else list(out) if isinstance(out, (tuple, list)) else []
    aliases, j = {}, 0
    for r, v in zip(rets, values):
        n = len(flatten_outputs(v))
        if n == 1 and r.alias_info is not None and r.alias_info.is_write:
            i = written_at.get(frozenset(r.alias_info.before_set))
            if i is not None:
                aliases[j] = i
        j += n
    return aliases


# ---- the recorder -------------------------------------------------------------------

class _Recorder:
    """Everything one run of the model saw: ops, cards, samples, and where it failed."""

    def __init__(self, target: _Target, paths: _ModulePaths, max_samples: int, byte_budget: int):
        self.target = target
        self.paths = paths
        self.max_samples = max_samples
        self.byte_budget = byte_budget
        self.bytes_used = 0
        self.budget_hit = False
        self.seen: dict[str, torch._ops.OpOverload] = {}  # overridable ops seen at the Python key
        self.entries: dict[str, _Entry] = {}  # card id -> entry, in first-call order
        self.unrecorded: Counter = Counter()  # op -> calls that could not be recorded
        self.unrecorded_why: dict[str, str] = {}  # op -> the first reason
        self.failure: tuple[BaseException, str, str] | None = None  # (error, op, module path), innermost
        self.composites = frozenset(composite.captured_ops())  # watched from the start, recorded when worth it
        self._local = threading.local()

    # Capture's own tensor copies and metadata reads run aten ops too; they must not be recorded.
    @property
    def quiet(self) -> bool:
        return getattr(self._local, "quiet", False)

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        before = self.quiet
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = before

    @property
    def _running(self) -> set:
        """(op, id of its first tensor) of the calls whose original kernel is running under
        this thread's overrides."""
        if not hasattr(self._local, "running"):
            self._local.running = set()
        return self._local.running

    @property
    def _stack(self) -> list[_Call]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def saw(self, op: torch._ops.OpOverload) -> None:
        name = _op_name(op)
        if name not in self.seen and _overridable(op, self.target.key):
            self.seen[name] = op

    def failed(self, err: BaseException, op: torch._ops.OpOverload) -> None:
        # The innermost handler sees the error first; outer ones see the same error in its chain.
        if self.failure is None or not _in_chain(err, self.failure[0]):
            self.failure = (err, _op_name(op), self.paths.current)

    def kernel(self, op: torch._ops.OpOverload, original: Any) -> Callable:
        """The override registered at the backend key: record the call, run the original.

        Below the Python key the dispatch mode is off, so a fresh one watches the kernel's
        own calls. A composite op runs above it, where a mode is on (the model's, or under
        inference_mode the one that decomposes it) and sees the decomposition's calls
        itself (a second mode there recurses); only when none is on is one pushed."""

        fused = op in self.composites

        def recorded(keyset, *args, **kwargs):
            if self.quiet:
                return call_original(original, op, keyset, args, kwargs)
            running = self._running
            # An op re-entered on the same tensor from its own kernel (detach under autograd
            # calls detach again through the Python key) is part of the outer call: recording
            # it, or pushing a mode for it, would recurse without end.
            this = (op, id(next((a for a in args if isinstance(a, torch.Tensor)), None)))
            if this in running or (fused and not composite.worth(op, args, kwargs)):
                return call_original(original, op, keyset, args, kwargs)
            call = self._begin(op, args, kwargs)
            if call is not None:
                self._stack.append(call)
            running.add(this)
            watch = not fused or _current_mode() is None
            try:
                with _SeeOps(self) if watch else contextlib.nullcontext():
                    out = call_original(original, op, keyset, args, kwargs)
            except Exception as e:
                self.failed(e, op)
                raise
            finally:
                running.discard(this)
                if call is not None:
                    self._stack.pop()
            if call is not None:
                self._end(call, out)
            return out

        return recorded

    def _begin(self, op, args, kwargs) -> _Call | None:
        with self._quietly():
            try:
                specs, tensors = _arg_specs(op, args, kwargs)
            except CardError as e:
                # The message embeds the value's repr (a whole storage, say): keep the first words.
                self.unrecorded[_op_name(op)] += 1
                self.unrecorded_why.setdefault(_op_name(op), _shorten(str(e)))
                return None
            card = Card(op=_op_name(op), schema=str(op._schema), args=specs, outputs=[], arch=self.target.arch,
                        family=family_of(op), device_name=self.target.device_name)
            entry = self.entries.get(card.id)
            if entry is None:
                entry = self.entries[card.id] = _Entry(card)
            c = entry.card
            c.calls += 1
            path = self.paths.current
            if path not in c.module_paths:
                c.module_paths.append(path)
            if self._stack:
                entry.parents[self._stack[-1].op] += 1
            else:
                entry.top_calls += 1
            copies = None
            if self._wants_sample(entry, tensors):
                copies = [_cpu_copy(t) for t in tensors]  # before the call: in-place ops overwrite them
            return _Call(entry, op, copies)

    def _wants_sample(self, entry: _Entry, tensors: list[torch.Tensor]) -> bool:
        # Vendor-backed calls (matmul/conv inputs and weights) are the largest and are not
        # searched by default: spending the budget on them left later norm and softmax
        # cards of big models without a sample. A call that does not fit is skipped, but
        # smaller later ones still get theirs.
        if entry.card.family in _NO_SAMPLE or len(entry.samples) >= self.max_samples:
            return False
        if self.bytes_used + _bytes(tensors) > self.byte_budget:
            self.budget_hit = True
            return False
        return True

    def _end(self, call: _Call, out: Any) -> None:
        with self._quietly():
            outs = flatten_outputs(out)
            metas = [TensorMeta.of(t) for t in outs]
            entry, card = call.entry, call.entry.card
            if card.calls == 1:
                card.outputs = metas
                card.aliases = _aliases(call.op, card.args, out)
            elif [m.key() for m in metas] != [m.key() for m in card.outputs]:
                entry.outputs_vary = True
            if call.inputs_copy is None:
                return
            nbytes = _bytes(call.inputs_copy) + _bytes(outs)
            if self.bytes_used + nbytes > self.byte_budget:
                self.budget_hit = True
                return
            self.bytes_used += nbytes
            entry.samples.append((call.inputs_copy, [_cpu_copy(t) for t in outs]))

    # ---- after the run ------------------------------------------------------------------
    def finish(self) -> list[Card]:
        budget_mib = self.byte_budget / 2**20
        for e in self.entries.values():
            c = e.card
            c.samples = len(e.samples)
            c.top_calls = e.top_calls
            if c.family in _NO_SAMPLE:
                c.notes.append(f"no sample stored: {c.family} op (evaluated on fresh inputs when searched)")
            elif not e.samples:
                c.notes.append(f"no sample stored: the {budget_mib:g} MiB sample budget was spent "
                               f"(raise max_sample_bytes to keep one)")
            if e.parents:
                (parent, n), = e.parents.most_common(1)
                c.notes.append(f"{c.calls - e.top_calls} of {c.calls}{_INSIDE}{_op_name(parent)}: "
                               f"their time is also in that card's share")
            if e.outputs_vary:
                c.notes.append("output shapes vary between calls (data-dependent): outputs are the first call's")
        return [e.card for e in self.entries.values()]

    def notes(self) -> list[str]:
        out = [f"{op}: {n} call(s) not recorded ({self.unrecorded_why[op]})" for op, n in self.unrecorded.items()]
        if self.budget_hit:
            out.append(f"sample budget of {self.byte_budget / 2**20:g} MiB spent: some cards have no stored sample")
        return out


_NO_SAMPLE = frozenset({"view", "vendor"})


class _SeeOps(TorchDispatchMode):
    """Notes every op reaching the Python key (for discovery) and the op an error came from."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        is_op = isinstance(func, torch._ops.OpOverload)
        if is_op and not self.rec.quiet:
            self.rec.saw(func)
        try:
            if is_op and composite.is_composite(func, self.rec.target.key):
                # Under inference_mode no autograd key decomposes a composite op first, so it
                # reaches this mode whole; its parts, the calls the backend runs, are seen only
                # if it is decomposed with the mode on. Through the dispatcher's own kernel:
                # func.decompose() would prefer a Python decomposition where torch registers
                # one (dropout, matmul, one_hot, ...), which makes calls that eager does not.
                with self:
                    return func._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
            return func(*args, **kwargs)
        except Exception as e:
            if is_op:
                self.rec.failed(e, func)
            raise


def _shorten(text: str, limit: int = 100) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _op_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def _overridable(op: torch._ops.OpOverload, key: str) -> bool:
    """The op has a real kernel at `key` (not only a decomposition): calls reach the backend as this op."""
    name = op.name()  # the dispatcher's spelling: no ".default"
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
               for k in (key, "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"))


def _in_chain(err: BaseException | None, target: BaseException) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        if err is target:
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def _overrides(ops: dict[str, torch._ops.OpOverload], rec: _Recorder) -> Iterator[None]:
    """Override `ops` at the backend key (composite ops above autograd, kforge.composite) for the
    duration; the dispatch table is restored on exit."""
    if not hasattr(torch.library, "get_kernel"):
        raise CaptureError(f"capture needs torch.library.get_kernel (torch >= 2.9); this is torch {torch.__version__}")
    libs: dict[str, torch.library.Library] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING, category=UserWarning)
            for op in ops.values():
                if op.namespace not in libs:
                    libs[op.namespace] = torch.library.Library(op.namespace, "IMPL")
                original = torch.library.get_kernel(op, rec.target.key)
                libs[op.namespace].impl(op, rec.kernel(op, original), composite.override_key(op, rec.target.key),
                                        with_keyset=True, allow_override=True)
        yield
    finally:
        for lib in libs.values():
            lib._destroy()


def _record(model, args, kwargs, target: _Target, max_samples: int, byte_budget: int) -> tuple[_Recorder, list[str]]:
    """Run the model until the set of ops settles; the last run is the recording. The composite
    ops kforge fuses are watched from the first run: the dispatch mode never sees them."""
    composites = {_op_name(op): op for op in composite.captured_ops()}
    known: dict[str, torch._ops.OpOverload] = dict(composites)
    for _ in range(_MAX_RUNS):
        rec = _run_once(model, args, kwargs, target, known, max_samples, byte_budget)
        new = {k: v for k, v in rec.seen.items() if k not in known}
        if not new and len(known) > len(composites):
            return rec, []
        known.update(new)
        if len(known) == len(composites):
            raise CaptureError(f"the model ran no aten op with a {target.key} kernel: nothing to capture")
    return rec, [f"ops kept appearing after {_MAX_RUNS} runs (data-dependent control flow?); "
                 f"not captured: {', '.join(sorted(new))}"]


def _run_once(model, args, kwargs, target, known, max_samples, byte_budget) -> _Recorder:
    paths = _ModulePaths(model)
    rec = _Recorder(target, paths, max_samples, byte_budget)
    try:
        with _overrides(known, rec), _SeeOps(rec):
            _run_model(model, args, kwargs)
        _sync(target.device)
    except CaptureError:
        raise
    except Exception as e:
        raise _model_error(e, rec) from e
    finally:
        paths.remove()
    return rec


def _model_error(err: Exception, rec: _Recorder) -> CaptureError:
    if rec.failure is not None and _in_chain(err, rec.failure[0]):
        _, op, path = rec.failure
        where = f"in {rec.paths.describe(path)} while running {op}"
    else:
        where = f"in {rec.paths.describe(rec.paths.current)} (outside any aten op)"
    return CaptureError(f"the model raised {type(err).__name__} {where}: {err}\n"
                        f"capture runs the model unchanged: check that it runs eagerly on these example inputs")


# ---- timing and shares ------------------------------------------------------------------

def _time_entry(entry: _Entry, dev: torch.device) -> None:
    card = entry.card
    try:
        if entry.samples:
            inputs = [unpack(pack(t), TensorMeta.of(t), dev) for t in entry.samples[0][0]]
        else:
            inputs = card.random_inputs(seed=0, device=dev)
        args, kwargs = card.build_call(inputs, dev)
        op = card.overload()
        card.eager_us = _time_fn(lambda: op(*args, **kwargs), dev)
    except Exception as e:  # an op that cannot be replayed alone is reported, not fatal
        card.notes.append(f"not timed: replay raised {type(e).__name__}: {e}")
        return
    card.total_us = card.eager_us * card.calls


def _time_fn(fn: Callable[[], Any], dev: torch.device, cpu_reps: int = 5) -> float:
    """Median microseconds per call: CUDA events with L2 flushed on the GPU, perf_counter on the CPU."""
    if dev.type == "cuda":
        from . import timing

        (m,) = timing.time_fns([fn], min_reps=20, min_ms=10.0, warmup_ms=5.0, device=dev)
        return m.median
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _assign_shares(rec: _Recorder) -> float:
    total = sum(e.card.eager_us * e.top_calls for e in rec.entries.values() if e.card.eager_us is not None)
    for e in rec.entries.values():
        c = e.card
        c.share = c.total_us / total if c.total_us is not None and total > 0 else None
    return total


def shares_by_family(cards: Sequence[Card]) -> dict[str, float]:
    """Share of the captured runtime per family, counting only calls not nested in another
    recorded call (a nested call's time is inside its parent's), so the shares add up to 1."""
    times: dict[str, float] = {}
    for c in cards:
        if c.eager_us is not None:
            top = c.calls if c.top_calls is None else c.top_calls
            times[c.family] = times.get(c.family, 0.0) + c.eager_us * top
    total = sum(times.values())
    return {f: t / total for f, t in sorted(times.items(), key=lambda kv: -kv[1])} if total > 0 else {}


# ---- output -----------------------------------------------------------------------------

def _write(result: CaptureResult, rec: _Recorder, region_entries: Sequence = ()) -> None:
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
        (result.run_dir / SITES).write_text(json.dumps({"sites": sites}, indent=1))
    (result.run_dir / "capture.json").write_text(json.dumps(result.to_json(), indent=1))


def cards_table(cards: list[Card], limit: int | None = None, searchable_only: bool = False):
    """A rich Table of cards ranked by share: op with shapes/dtypes, family, calls, time, share,
    status, card id (what `kforge search --cards` takes) and where in the model it ran. With
    `searchable_only`, cards the search leaves alone (view ops, vendor libraries) are left out."""
    from rich.table import Table

    ranked = sorted(cards, key=lambda c: -(c.share or 0.0))
    picked = [c for c in ranked if skip_reason(c) is None] if searchable_only else ranked
    shown = picked[:limit] if limit is not None else picked
    table = Table(title="operator cards", show_lines=False)
    for name, justify in (("#", "right"), ("op (shapes:dtypes)", "left"), ("family", "left"), ("calls", "right"),
                          ("eager µs", "right"), ("share", "right"), ("status", "left"), ("card", "left"),
                          ("module", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    nested = 0
    for i, c in enumerate(shown, 1):
        status = skip_reason(c) or "searchable"
        inside = _nested_in(c)
        if inside:
            nested += 1
            status += f"; inside {inside}"
        table.add_row(str(i), c.summary(), c.family, str(c.calls), _fmt(c.eager_us, "{:.1f}"),
                      _fmt(c.share, "{:.1%}"), status, c.id, module_path(c))
    hidden = len(ranked) - len(shown)
    captions = [f"{hidden} more cards not shown" + (" (--all lists them)" if searchable_only else "")] if hidden else []
    if nested:
        captions.append("a card marked 'inside' runs within another card's calls: its share is also in that "
                        "card's share (the other cards' shares add up to 100 %)")
    table.caption = "\n".join(captions) or None
    return table


def module_path(card: Card) -> str:
    """Where in the model a card ran: its first module path, and how many others there are."""
    paths = card.module_paths or []
    return (paths[0] + (f" (+{len(paths) - 1})" if len(paths) > 1 else "")) if paths else "-"


_INSIDE = " calls run inside "  # the nesting note's words, written at capture and read by cards_table


def _nested_in(card: Card) -> str | None:
    """The op a card's calls run inside when all of them do, from its capture note."""
    if card.top_calls is None or card.top_calls > 0:
        return None
    for note in card.notes:
        _, sep, rest = note.partition(_INSIDE)
        if sep:
            return rest.partition(": ")[0].removeprefix("aten::")
    return None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or math.isnan(x) else spec.format(x)


class _CallableModule(types.ModuleType):
    """`kforge.capture` names both this module and its `capture` function. Importing the
    module (`from kforge.capture import cards_table`, or kforge.run) binds the package's
    attribute to the module, so calling the module calls the function."""

    def __call__(self, *args, **kwargs) -> CaptureResult:
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
