"""Model -> op cards: record the aten calls that reach the backend, without touching the model.

How: a TorchDispatchMode sees every op that survives decomposition; each op that has a real
kernel at the device's backend key (CUDA, or CPU in tests) is then overridden there with
`torch.library` (the original kernel taken with `torch.library.get_kernel`), exactly where a
`.cast` package will intercept it later. Inside each override a fresh mode watches the calls the
kernel itself makes (clone -> empty_strided + copy_, mean -> sum + div_, ...), so nested calls
are found too. The model runs again until no new op shows up; the last run is the recording.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from . import composite
from .boxing import call_original, rewrap
from .callspec import arg_specs, cpu_copy, output_aliases
from .cards import Card, TensorMeta, flatten_outputs, qualified_name
from .errors import CaptureError, CardError
from .families import family_of
from .modelrun import Target, run_model, sync

_MAX_RUNS = 6  # discovery runs before giving up on ops that keep appearing
_ROOT = "(root)"  # module path of ops run by the model's own forward
# torch warns once per process when an aten kernel is overridden; that is what capture does on purpose.
_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel"


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
class Entry:
    card: Card
    top_calls: int = 0  # calls not nested in another recorded call
    parents: Counter = field(default_factory=Counter)  # op of the recorded call it ran inside -> calls
    samples: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)  # CPU copies
    outputs_vary: bool = False


@dataclass
class _Call:
    entry: Entry
    op: torch._ops.OpOverload
    inputs_copy: list[torch.Tensor] | None  # CPU copies taken before the call, when sampling


def _bytes(ts: list[torch.Tensor]) -> int:
    return sum(TensorMeta.of(t).span() * t.element_size() for t in ts)


# ---- the recorder -------------------------------------------------------------------

class Recorder:
    """Everything one run of the model saw: ops, cards, samples, and where it failed."""

    def __init__(self, target: Target, paths: _ModulePaths, max_samples: int, byte_budget: int):
        self.target = target
        self.paths = paths
        self.max_samples = max_samples
        self.byte_budget = byte_budget
        self.bytes_used = 0
        self.budget_hit = False
        self.seen: dict[str, torch._ops.OpOverload] = {}  # overridable ops seen at the Python key
        self.entries: dict[str, Entry] = {}  # card id -> entry, in first-call order
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
        name = qualified_name(op)
        if name not in self.seen and _overridable(op, self.target.key):
            self.seen[name] = op

    def failed(self, err: BaseException, op: torch._ops.OpOverload) -> None:
        # The innermost handler sees the error first; outer ones see the same error in its chain.
        if self.failure is None or not _in_chain(err, self.failure[0]):
            self.failure = (err, qualified_name(op), self.paths.current)

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
                specs, tensors = arg_specs(op, args, kwargs)
            except CardError as e:
                # The message embeds the value's repr (a whole storage, say): keep the first words.
                self.unrecorded[qualified_name(op)] += 1
                self.unrecorded_why.setdefault(qualified_name(op), _shorten(str(e)))
                return None
            card = Card(op=qualified_name(op), schema=str(op._schema), args=specs, outputs=[], arch=self.target.arch,
                        family=family_of(op), device_name=self.target.device_name)
            entry = self.entries.get(card.id)
            if entry is None:
                entry = self.entries[card.id] = Entry(card)
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
                copies = [cpu_copy(t) for t in tensors]  # before the call: in-place ops overwrite them
            return _Call(entry, op, copies)

    def _wants_sample(self, entry: Entry, tensors: list[torch.Tensor]) -> bool:
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
                card.aliases = output_aliases(call.op, card.args, out)
            elif [m.key() for m in metas] != [m.key() for m in card.outputs]:
                entry.outputs_vary = True
            if call.inputs_copy is None:
                return
            nbytes = _bytes(call.inputs_copy) + _bytes(outs)
            if self.bytes_used + nbytes > self.byte_budget:
                self.budget_hit = True
                return
            self.bytes_used += nbytes
            entry.samples.append((call.inputs_copy, [cpu_copy(t) for t in outs]))

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
                c.notes.append(f"{c.calls - e.top_calls} of {c.calls}{NESTED_NOTE}{qualified_name(parent)}: "
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

    def __init__(self, rec: Recorder):
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
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                # A composite's part (`idx % 49`: remainder.Tensor; `2 ** x`) takes its scalar as a
                # wrapped-number tensor, which reaches this mode as a plain number; ops other than
                # arithmetic's refuse one where their schema says Tensor. Nothing ran: the call is
                # made again with the tensor (made quietly: it is not the model's call).
                if not is_op or "Expected a value of type 'Tensor'" not in str(e):
                    raise
            with self.rec._quietly():
                args, kwargs = rewrap(func, args, kwargs)
            return func(*args, **kwargs)
        except Exception as e:
            if is_op:
                self.rec.failed(e, func)
            raise

def _shorten(text: str, limit: int = 100) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


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
def _overrides(ops: dict[str, torch._ops.OpOverload], rec: Recorder) -> Iterator[None]:
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


def record(model, args, kwargs, target: Target, max_samples: int, byte_budget: int) -> tuple[Recorder, list[str]]:
    """Run the model until the set of ops settles; the last run is the recording. The composite
    ops kforge fuses are watched from the first run: the dispatch mode never sees them."""
    composites = {qualified_name(op): op for op in composite.captured_ops()}
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


def _run_once(model, args, kwargs, target, known, max_samples, byte_budget) -> Recorder:
    paths = _ModulePaths(model)
    rec = Recorder(target, paths, max_samples, byte_budget)
    try:
        with _overrides(known, rec), _SeeOps(rec):
            run_model(model, args, kwargs)
        sync(target.device)
    except CaptureError:
        raise
    except Exception as e:
        raise _model_error(e, rec) from e
    finally:
        paths.remove()
    return rec


def _model_error(err: Exception, rec: Recorder) -> CaptureError:
    if rec.failure is not None and _in_chain(err, rec.failure[0]):
        _, op, path = rec.failure
        where = f"in {rec.paths.describe(path)} while running {op}"
    else:
        where = f"in {rec.paths.describe(rec.paths.current)} (outside any aten op)"
    return CaptureError(f"the model raised {type(err).__name__} {where}: {err}\n"
                        f"capture runs the model unchanged: check that it runs eagerly on these example inputs")


NESTED_NOTE = " calls run inside "  # the nesting note's words, written at capture and read by cards_table


def nested_in(card: Card) -> str | None:
    """The op a card's calls run inside when all of them do, from its capture note."""
    if card.top_calls is None or card.top_calls > 0:
        return None
    for note in card.notes:
        _, sep, rest = note.partition(NESTED_NOTE)
        if sep:
            return rest.partition(": ")[0].removeprefix("aten::")
    return None
