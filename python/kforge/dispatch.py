"""Guarded dispatch: route exact matches of a card's key to its kernel, everything else to PyTorch.

One torch.library override per aten op, at the backend key (CUDA; CPU stands in for tests),
below autograd, so autograd, no_grad and inference_mode behave as in eager and the op's
saved outputs (mean/rstd of layer_norm, ...) are the ones we return. A composite op
(softmax with dtype=, kforge.composite) has no backend kernel: its override sits above
autograd and sends calls that need a backward to eager's decomposition. The override
multiplexes every installed package's variants of the op: a call's guard key (per tensor
argument shape, stride, dtype, device type and pointer alignment; every other argument's
value) is looked up in one dict. A hit allocates outputs from the caching allocator and
launches on the current stream, so the path records into CUDA graphs; a miss calls the
kernel that was registered before the override (taken with torch.library.get_kernel) and
counts why it missed. Removing the last variant of an op destroys its override, which
restores the dispatcher's previous kernel exactly.

Two implementations of the override, the same guards and counts: a boxed C++ kernel
(kforge._dispatch, csrc/torch_dispatch.cpp) wherever it is built, every variant of the op
launches through the C++ registry (a launcher with native()) and every card argument has a
C++ guard; else a Python torch.library kernel (_OpOverride). KFORGE_DISPATCH=python forces
Python, KFORGE_DISPATCH=native makes a missing C++ path an error; native_status() says
which path an override at a key takes and why.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from . import composite, env, runtime
from .boxing import call_original
from .candidate import Candidate
from .cards import Card, TensorMeta, decode_value, dtype_name, pointer_alignment
from .errors import CardError, CudaError, KforgeError, LaunchError, LaunchRefused

# Why a call fell back, most fundamental first. "no-variant": no installed variant has the
# call's argument structure (a tensor where the card has None, another list length).
# "aliasing" is not a guard difference: the call matched, but an input the kernel writes shares
# memory with another input (add.out(a, b, out=a)), which the captured call did not do.
# "refused": the driver refused the kernel before it ran (a cooperative grid that cannot be
# resident on the GPU right now); eager served the call.
# "autograd": an override of a composite op runs above autograd (kforge.composite); a call
# that needs a backward went to eager's decomposition, which records it.
REASONS = ("no-variant", "device", "dtype", "scalar", "shape", "stride", "alignment", "aliasing", "autograd", "refused")

_OVERRIDE_WARNING = "(?s).*Overriding a previously registered kernel for the same operator.*"
_ALIGN = tuple(pointer_alignment(low) for low in range(16))  # alignment (<= 16) depends on the low 4 bits
_MISS_MEMO_LIMIT = 4096

log = logging.getLogger("kforge.dispatch")


class DispatchError(KforgeError):
    """A card cannot be dispatched, or the dispatcher was misused."""


class NotPrepared(LaunchError):
    """The kernels could not be loaded on this device (another GPU architecture, ...):
    nothing ran, and calls on that device go to PyTorch."""


class Counters:
    """What the override did for one card; read by CastPackage.report().

    Calls served in C++ count into a kforge._dispatch.Counts cell, which `hits` and
    `fallbacks` read through. Inside a CUDA graph only the capture goes through the
    override: replays are not counted.
    """

    __slots__ = ("_hits", "_fallbacks", "_cell")

    def __init__(self, hits: int = 0, fallbacks: dict[str, int] | None = None):
        self._hits = hits
        self._fallbacks = collections.Counter(fallbacks or {})
        self._cell: Any = None

    @property
    def hits(self) -> int:
        return self._hits + (self._cell.hits if self._cell is not None else 0)

    @property
    def fallbacks(self) -> collections.Counter:
        """Fallbacks by reason (see REASONS); a snapshot."""
        if self._cell is None:
            return collections.Counter(self._fallbacks)
        return self._fallbacks + collections.Counter(self._cell.fallbacks())

    def hit(self) -> None:
        self._hits += 1

    def fell_back(self, reason: str) -> None:
        self._fallbacks[reason] += 1

    def native_cell(self, native: Any) -> Any:
        """The C++ counts of these counters (created on first use, kept for good)."""
        if self._cell is None:
            self._cell = native.Counts()
        return self._cell

    def __repr__(self) -> str:
        return f"Counters(hits={self.hits}, fallbacks={dict(self.fallbacks)})"


class Launcher(Protocol):
    """Runs variant `vid` on `inputs` (Card.inputs order) into `outputs` (Card.outputs order)."""

    def launch(self, vid: int, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               workspaces: Sequence[torch.Tensor], device: torch.device) -> None: ...


class RegistryLauncher:
    """Launches through the C++ registry (kforge._C.Registry), one registry per device.

    Variant ids are the positions in `entries`. Plans are built for a device on first use;
    call prepare() for the devices you will run on so that loading happens at install
    time, not inside a model's forward (or a CUDA graph capture).
    """

    def __init__(self, entries: Sequence[tuple[Candidate, bytes]]):
        from . import _C

        self._entries = list(entries)
        self._registries: dict[int, Any] = {}
        # One registry per device, built once: kforge._dispatch caches a registry's raw
        # address, so a registry must never be replaced (and freed) once handed out.
        self._lock = threading.Lock()
        self._unprepared: dict[int | None, str] = {}  # device index -> why its kernels could not load
        self._launch_address = _C.Registry.launch_address()

    def prepare(self, device: torch.device | int | str) -> Any:
        from . import _C

        ordinal = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        ordinal = ordinal.index if ordinal.index is not None else torch.cuda.current_device()
        reg = self._registries.get(ordinal)
        if reg is not None:
            return reg
        with self._lock:
            reg = self._registries.get(ordinal)
            if reg is None:
                reg = _C.Registry()
                for i, (candidate, cubin) in enumerate(self._entries):
                    vid = reg.add(runtime.build_plan(candidate, cubin, ordinal))
                    if vid != i:
                        raise LaunchError(f"registry gave id {vid} to entry {i}; a registry must start empty")
                self._registries[ordinal] = reg
        return reg

    def native(self, vid: int) -> tuple[int, int, Callable[[int], int]]:
        """How kforge._dispatch launches variant `vid`: (address of the C launch function, id,
        device index -> launcher context, here the device's registry)."""
        return self._launch_address, vid, self._registry_address

    def _registry_address(self, index: int) -> int:
        return self.prepare(index).address()

    def launch(self, vid, inputs, outputs, workspaces, device) -> None:
        reg = self._registries.get(device.index)
        if reg is None:
            if device.index in self._unprepared:
                raise NotPrepared(self._unprepared[device.index])
            try:
                reg = self.prepare(device)
            except Exception as e:  # nothing has run yet: whatever stopped the load, PyTorch serves the call
                self._unprepared[device.index] = f"kforge could not prepare its kernels on {device}: {e}"
                warnings.warn(self._unprepared[device.index] + "; calls there run PyTorch's kernel", stacklevel=2)
                raise NotPrepared(self._unprepared[device.index]) from e
        try:
            reg.launch(vid, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                       [t.data_ptr() for t in workspaces], runtime.current_stream(device.index))
        except LaunchRefused:
            raise  # nothing ran: the override serves the call with eager
        except CudaError as e:
            raise LaunchError.from_cuda(f"dispatched kernel {self._entries[vid][0].plan.kernels[0].name} "
                                        f"(variant {vid}) failed: {e}", e) from e


class PlanLauncher:
    """One resolved plan (kforge.runtime.build_plan), launched through kforge.runtime: what the
    evaluation worker has in hand when it times a candidate as dispatched."""

    def __init__(self, plan: Any, device: int | None = None):
        self._plan = plan
        self._device = device  # the plan's device, when known: other devices are refused
        self._registry: Any = None

    def native(self, vid: int) -> tuple[int, int, Callable[[int], int]] | None:
        """The plan as entry 0 of a registry of its own, for kforge._dispatch (see RegistryLauncher.native)."""
        from . import _C

        if not isinstance(self._plan, _C.Plan):
            return None
        if self._registry is None:
            self._registry = _C.Registry()
            self._registry.add(self._plan)
        return _C.Registry.launch_address(), 0, self._registry_address

    def _registry_address(self, index: int) -> int:
        if self._device is not None and index != self._device:
            raise LaunchError(f"this plan was loaded on cuda:{self._device}, not cuda:{index}")
        return self._registry.address()

    def launch(self, vid, inputs, outputs, workspaces, device) -> None:
        runtime.launch(self._plan, inputs, outputs, workspaces, runtime.current_stream(device.index))


# ---- guard keys -------------------------------------------------------------------------

def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        # A Python scalar where the schema says Tensor (a wrapped number): never a guard's key.
        return ("not a tensor", type(t).__name__)
    # torch.Size hashes and compares like the tuple in the guard: no conversion on the hot path.
    # (t.is_cuda is ~0.35 us cheaper than building t.device.)
    return (t.shape, t.stride(), t.dtype, "cuda" if t.is_cuda else t.device.type, _ALIGN[t.data_ptr() & 15])


def _tensors_key(ts: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(_tensor_key(t) for t in ts)


# Ops with a kernel at the Conjugate or Negative key (copy_, clone, mm, ...) receive conjugate
# and negative views unresolved: the bit is part of what the kernel must do, and no card has one.
def _lazy_view_key(t: torch.Tensor | None) -> tuple | None:
    if isinstance(t, torch.Tensor) and (t.is_conj() or t.is_neg()):
        return ("conjugate or negative view",)
    return _tensor_key(t)


def _lazy_views_key(ts: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(_lazy_view_key(t) for t in ts)


def _value_key(v: Any) -> Any:
    """A hashable key that tells apart what encode_value tells apart (1, 1.0 and True differ)."""
    fast = _VALUE_KEY_BY_TYPE.get(type(v))
    if fast is not None:
        return fast(v)
    if v is None or isinstance(v, (str, torch.dtype, torch.memory_format, torch.layout)):
        return v
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, (int, torch.SymInt)):
        return ("i", int(v))
    if isinstance(v, float):
        return _float_key(v)
    if isinstance(v, torch.device):
        return ("device", v.type)
    if isinstance(v, (list, tuple)):
        return tuple(_value_key(x) for x in v)
    return ("?", type(v).__name__, repr(v))  # never equal to a recorded value: the call falls back


def _float_key(v: float) -> tuple:
    # 0.0 == -0.0 and nan != nan, but cards tell the zeros apart and every nan from a number.
    return ("f", v) if v and v == v else ("f", repr(v))


# Exact-type fast paths for the values calls carry most (the isinstance chain is the slow path).
_VALUE_KEY_BY_TYPE: dict[type, Callable[[Any], Any]] = {
    type(None): lambda v: None,
    bool: lambda v: ("b", v),
    int: lambda v: ("i", v),
    float: _float_key,
    list: lambda v: tuple([_value_key(x) for x in v]),
    tuple: lambda v: tuple([_value_key(x) for x in v]),
}


def _meta_key(m: TensorMeta | None) -> tuple | None:
    return None if m is None else (tuple(m.shape), tuple(m.stride), m.torch_dtype, m.device, m.align)


def _slot_kind(arg: torch.Argument) -> str:
    t = str(arg.type)
    if t in ("Tensor", "Optional[Tensor]"):
        return "tensor"
    if t in ("List[Tensor]", "List[Optional[Tensor]]"):
        return "tensors"
    return "value"


_KEY_FNS: dict[str, Callable[[Any], Any]] = {"tensor": _tensor_key, "tensors": _tensors_key, "value": _value_key}


def dispatch_blocker(card: Card) -> str | None:
    """Why this card's kernel cannot be dispatched through an override, or None if it can."""
    try:
        schema = card.overload()._schema
    except CardError as e:
        return str(e)
    if not all(str(r.type) == "Tensor" for r in schema.returns) or not schema.returns:
        return f"cannot dispatch: {card.op} does not return plain tensors"
    if len(card.outputs) != len(schema.returns):
        return f"cannot dispatch: card has {len(card.outputs)} outputs, {card.op} returns {len(schema.returns)}"
    if not card.inputs:
        return "cannot dispatch: the op has no tensor inputs to guard on"
    if len({m.device for m in card.inputs}) > 1:
        return "cannot dispatch: its inputs are on more than one device type (a CPU scalar tensor beside GPU tensors)"
    if any(not 0 <= i < len(card.inputs) for i in card.aliases.values()):
        return f"cannot dispatch: aliases {card.aliases} name inputs the card does not have"
    names = {a.name for a in schema.arguments}
    if any(a.name not in names for a in card.args):
        return f"cannot dispatch: card arguments do not match the schema of {card.op} in torch {torch.__version__}"
    return None


# ---- variants -----------------------------------------------------------------------------

@dataclass(eq=False)
class Variant:
    """One card's kernel as the override sees it."""

    card: Card
    vid: int
    launcher: Launcher
    workspace: tuple[int, ...] = ()  # bytes per workspace buffer (the plan zeroes those that ask)
    counters: Counters = field(default_factory=Counters)
    written: tuple = field(init=False)
    out_specs: tuple = field(init=False)

    def __post_init__(self) -> None:
        why = dispatch_blocker(self.card)
        if why:
            raise DispatchError(f"card {self.card.id} ({self.card.summary()}): {why}")
        self.written = tuple(sorted(self.card.written_inputs))  # inputs the kernel writes
        # (aliased input index or None, shape, stride, dtype) per output, resolved once.
        self.out_specs = tuple(
            (self.card.aliases.get(j), tuple(m.shape), tuple(m.stride), m.torch_dtype)
            for j, m in enumerate(self.card.outputs))

    def run(self, ins: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The kernel on `ins` (Card.inputs order) into outputs from the caching allocator, on the
        current stream; counts the hit. None, with the reason counted, when it did not run: its
        kernels cannot load on this device ("device"), or the driver refused the launch ("refused")."""
        dev = ins[0].device
        outs = [ins[src] if src is not None else torch.empty_strided(shape, stride, dtype=dt, device=dev)
                for src, shape, stride, dt in self.out_specs]
        ws = [torch.empty(n, dtype=torch.uint8, device=dev) for n in self.workspace]
        try:
            self.launcher.launch(self.vid, ins, outs, ws, dev)
        except NotPrepared:
            self.counters.fell_back("device")
            return None
        except LaunchRefused:
            self.counters.fell_back("refused")
            return None
        self.counters.hit()
        return outs


def _guard_key(card: Card, schema: torch.FunctionSchema) -> tuple:
    """The key a call must produce to hit this card: one entry per schema argument."""
    by_name = {a.name: a for a in card.args}
    key = []
    for arg in schema.arguments:
        spec, kind = by_name.get(arg.name), _slot_kind(arg)
        if spec is None:  # the card omitted a defaulted argument: the call key sees the default
            key.append(_KEY_FNS[kind](arg.default_value if arg.has_default_value() else None))
        elif spec.kind == "tensor":
            key.append(_meta_key(spec.tensor))
        elif spec.kind == "tensors":
            key.append(tuple(_meta_key(m) for m in spec.tensors))
        else:
            key.append(_value_key(decode_value(spec.value)))
    return tuple(key)


_TENSOR_FIELDS = ("shape", "stride", "dtype", "device", "alignment")  # order of _tensor_key


def _tensor_differences(a: tuple | None, b: tuple | None) -> list[str]:
    if a == b:
        return []
    if a is None or b is None or len(a) != len(_TENSOR_FIELDS) or len(b) != len(_TENSOR_FIELDS):
        return ["no-variant"]  # None, a Python scalar or a lazy view where the other has a tensor
    return [n for n, x, y in zip(_TENSOR_FIELDS, a, b) if x != y]


def differences(call_key: tuple, guard_key: tuple, kinds: Sequence[str]) -> list[str]:
    """Every way (see REASONS) a call key differs from a guard key, most fundamental first."""
    found: list[str] = []
    for kind, a, b in zip(kinds, call_key, guard_key):
        if a == b:
            continue
        if kind == "tensor":
            found += _tensor_differences(a, b)
        elif kind == "tensors":
            found += ["no-variant"] if len(a) != len(b) else [r for x, y in zip(a, b) for r in _tensor_differences(x, y)]
        else:
            found.append("scalar")
    return sorted(found, key=REASONS.index)


# ---- the override of one op ---------------------------------------------------------------

def _get_kernel(op: torch._ops.OpOverload, key: str):
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        raise DispatchError(f"guarded dispatch needs torch.library.get_kernel (torch >= 2.9); "
                            f"this is torch {torch.__version__}: upgrade torch")
    return get_kernel(op, key)


def _unrunnable(v: Variant, ins: Sequence[torch.Tensor], devices: Sequence = ()) -> str | None:
    """What a guard key cannot see (as kforge._dispatch checks it): every input on one device,
    and any device argument naming that device, an index-less one meaning the current device
    (the key holds device types, not indices: x.to("cuda:1") of a cuda:0 tensor is eager's),
    and no input the kernel writes sharing memory with another input. None when the kernel
    may run."""
    if len(ins) > 1:
        dev = ins[0].device
        if any(t.device != dev for t in ins):
            return "device"
    for x in devices:  # the call's Device arguments
        if isinstance(x, torch.device):
            if x.index is None and x.type == "cuda":  # "cuda" is whichever device is current
                x = torch.device("cuda", torch.cuda.current_device())
            if x.index is not None and x != ins[0].device:
                return "device"
    for w in v.written:
        storage = ins[w].untyped_storage()
        if any(i != w and t.untyped_storage().data_ptr() == storage.data_ptr() for i, t in enumerate(ins)):
            return "aliasing"
    return None


class _OpOverride:
    """The torch.library kernel of one op at one dispatch key, in Python."""

    path = "python"

    def __init__(self, op: torch._ops.OpOverload, key: str):
        self.op = op
        schema = op._schema
        self.kinds = tuple(_slot_kind(a) for a in schema.arguments)
        lazy_views = any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in ("Conjugate", "Negative"))
        key_fns = {**_KEY_FNS, "tensor": _lazy_view_key, "tensors": _lazy_views_key} if lazy_views else _KEY_FNS
        self._key_fns = tuple(key_fns[k] for k in self.kinds)
        # Arguments the dispatcher may leave out: trailing defaults and kwarg-only ones.
        self._params = tuple((a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments)
        self._tensor_slots = tuple(i for i, k in enumerate(self.kinds) if k != "value")
        self._device_slots = tuple(i for i, a in enumerate(schema.arguments) if "Device" in str(a.type))
        self._single = len(schema.returns) == 1
        self.table: dict[tuple, Variant] = {}
        self._guards: list[tuple[tuple, Variant]] = []
        self._misses: dict[tuple, tuple[Variant, str]] = {}
        # Taken before the override exists: the kernel every miss goes to.
        self.original = _get_kernel(op, key)
        at = composite.override_key(op, key)
        self._above_autograd = at != key
        name = schema.name.split("::", 1)[1] + (f".{schema.overload_name}" if schema.overload_name else "")
        self.lib = torch.library.Library(op.namespace, "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING)
                self.lib.impl(name, self, at, with_keyset=True, allow_override=True)
        except BaseException:
            self.lib._destroy()  # a failed registration must not leave half an override behind
            raise

    def set_variants(self, variants: list[Variant]) -> None:
        """Later variants win on equal keys (the package installed last)."""
        schema = self.op._schema
        self._guards = [(_guard_key(v.card, schema), v) for v in variants]
        self.table = dict(self._guards)
        self._misses = {}

    def destroy(self) -> None:
        self.lib._destroy()

    def __call__(self, keyset, *args, **kwargs):
        if self._above_autograd and composite.wrapped(keyset):  # not a call for a kernel: not counted
            return call_original(self.original, self.op, keyset, args, kwargs)
        params = self._params
        vals = list(args)
        for name, default in params[len(args):]:
            vals.append(kwargs.get(name, default))
        key = tuple([f(x) for f, x in zip(self._key_fns, vals)])
        v = self.table.get(key)
        if v is None:
            self._count_miss(key)
            return call_original(self.original, self.op, keyset, args, kwargs)
        ins: list[torch.Tensor] = []
        for i in self._tensor_slots:
            x = vals[i]
            if isinstance(x, torch.Tensor):
                ins.append(x)
            elif x is not None:
                ins += [t for t in x if t is not None]
        why = _unrunnable(v, ins, [vals[i] for i in self._device_slots] if self._device_slots else ())
        if not why and self._above_autograd and composite.needs_grad(ins):
            why = "autograd"
        if why:
            v.counters.fell_back(why)
        else:
            outs = v.run(ins)
            if outs is not None:
                return outs[0] if self._single else tuple(outs)
        return call_original(self.original, self.op, keyset, args, kwargs)

    def _count_miss(self, key: tuple) -> None:
        hit = self._misses.get(key)
        if hit is None:
            # Charge the miss to the nearest variant: its most fundamental difference is the least
            # fundamental, then it differs in the fewest ways, then it was installed first.
            scored = []
            for i, (guard, v) in enumerate(self._guards):
                diffs = differences(key, guard, self.kinds) or ["no-variant"]
                scored.append(((REASONS.index(diffs[0]), -len(diffs), -i), diffs[0], v))
            _, reason, nearest = max(scored, key=lambda s: s[0])
            hit = (nearest, reason)
            if len(self._misses) >= _MISS_MEMO_LIMIT:
                self._misses.clear()
            self._misses[key] = hit
        hit[0].counters.fell_back(hit[1])


# ---- the override of one op in C++ (kforge._dispatch) ---------------------------------------

class _NotNative(Exception):
    """Why a variant cannot be served by the C++ override (the op stays on the Python path)."""


_native: tuple[Any, str] | None = None  # (kforge._dispatch or None, why)
_stream_checked = False


def _native_module() -> tuple[Any, str]:
    global _native
    if _native is None:
        try:
            from . import _dispatch as mod
        except ImportError as e:
            _native = None, (f"kforge._dispatch is not built or does not load ({e}); build it with "
                              "`pip install --no-build-isolation -e .` where torch is installed")
        else:
            if mod.TORCH_VERSION != torch.__version__:
                _native = None, (f"kforge._dispatch was built against torch {mod.TORCH_VERSION}, this is torch "
                                 f"{torch.__version__}: rebuild kforge (`pip install --no-build-isolation -e .`)")
            elif tuple(mod.REASONS) != REASONS:
                _native = None, "kforge._dispatch counts other fallback reasons than kforge.dispatch: rebuild kforge"
            else:
                _native = mod, f"kforge._dispatch, built against torch {mod.TORCH_VERSION}"
    return _native


def _check_stream(mod: Any) -> str | None:
    """The stream the C++ path launches on must be torch's current stream: checked once, on
    the current device, against the handle torch itself gives Python."""
    global _stream_checked
    if _stream_checked or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    ours, torchs = mod.current_stream("cuda", index), runtime.current_stream(index)
    if ours != torchs:
        return (f"kforge._dispatch reads stream {ours:#x} on cuda:{index} where torch's current stream is "
                f"{torchs:#x}; a torch API changed: dispatching in Python")
    _stream_checked = True
    return None


def native_status(key: str = "CUDA") -> tuple[bool, str]:
    """Whether overrides at `key` can run in C++ (kforge._dispatch), and why or why not.
    Per op, the C++ path also needs every variant's launcher to have native() and every
    card argument a C++ guard."""
    if env.dispatch_path() == "python":
        return False, "KFORGE_DISPATCH=python"
    if key not in ("CPU", "CUDA"):
        return False, f"kforge._dispatch serves the CPU and CUDA keys, not {key}"
    mod, why = _native_module()
    if mod is None:
        return False, why
    if key == "CUDA":
        bad = _check_stream(mod)
        if bad:
            return False, bad
    return True, why


def _native_tensor(m: TensorMeta | None) -> tuple | None:
    return None if m is None else (list(m.shape), list(m.stride), m.dtype, m.device, m.align)


def _native_value(v: Any) -> tuple:
    """The C++ guard of a value: what _value_key tells apart, it tells apart."""
    if v is None:
        return ("none",)
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, (int, torch.SymInt)):
        return ("int", int(v))
    if isinstance(v, float):
        return ("float", v)
    if isinstance(v, str):
        return ("str", v)
    if isinstance(v, torch.dtype):
        return ("enum", dtype_name(v))
    if isinstance(v, (torch.memory_format, torch.layout)):
        return ("enum", str(v).removeprefix("torch."))
    if isinstance(v, torch.device):
        return ("device", v.type)
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) for x in v):
        return ("ints", [int(x) for x in v])
    raise _NotNative(f"no C++ guard for the value {v!r}")


def _native_slot(kind: str, arg: torch.Argument, spec: Any) -> tuple:
    if spec is None:  # the card omitted a defaulted argument: the call key sees the default
        default = arg.default_value if arg.has_default_value() else None
        if kind == "value":
            return ("value", _native_value(default))
        if kind == "tensor" and default is None:
            return ("tensor", None)
        raise _NotNative(f"argument {arg.name} is left out of the card")
    if spec.kind == kind == "tensor":
        return ("tensor", _native_tensor(spec.tensor))
    if spec.kind == kind == "tensors":
        return ("tensors", [_native_tensor(m) for m in spec.tensors])
    value = decode_value(spec.value) if spec.kind == "value" else spec
    if kind == "value":
        return ("value", _native_value(value))
    if kind == "tensor" and value is None:  # a card records None in a Tensor? slot as a value
        return ("tensor", None)
    if kind == "tensors" and isinstance(value, list) and not value:
        return ("tensors", [])
    raise _NotNative(f"argument {arg.name} is a {spec.kind} in the card and a {kind} in the schema")


def _native_variant(v: Variant, schema: torch.FunctionSchema, native: Any) -> tuple:
    """The description kforge._dispatch.Override.set_variants takes, or _NotNative."""
    how = getattr(v.launcher, "native", None)
    info = how(v.vid) if how is not None else None
    if info is None:
        raise _NotNative(f"{type(v.launcher).__name__} launches from Python only")
    fn, vid, context = info
    by_name = {a.name: a for a in v.card.args}
    slots = [_native_slot(_slot_kind(arg), arg, by_name.get(arg.name)) for arg in schema.arguments]
    outputs = [(src, list(shape), list(stride), dtype_name(dt)) for src, shape, stride, dt in v.out_specs]
    return slots, outputs, list(v.workspace), fn, vid, context, v.counters.native_cell(native), list(v.written)


def _native_variants(variants: Sequence[Variant], key: str) -> tuple[list | None, str]:
    """(descriptions for kforge._dispatch, why) or (None, why the op stays in Python)."""
    ok, why = native_status(key)
    if not ok:
        return None, why
    native, _ = _native_module()
    schema = variants[0].card.overload()._schema
    descriptions = []
    for v in variants:
        try:
            descriptions.append(_native_variant(v, schema, native))
        except (_NotNative, CardError) as e:
            return None, f"card {v.card.id}: {e}"
    return descriptions, why


class _NativeOverride:
    """The boxed C++ kernel of one op at one dispatch key (kforge._dispatch.Override)."""

    path = "native"

    def __init__(self, op: torch._ops.OpOverload, key: str):
        self.op = op
        native, _ = _native_module()
        schema = op._schema
        self._impl = native.Override(schema.name, schema.overload_name, key, composite.override_key(op, key))

    def set_variants(self, descriptions: list) -> None:
        self._impl.set_variants(descriptions)

    def destroy(self) -> None:
        self._impl.destroy()


# ---- the dispatcher ------------------------------------------------------------------------

class Dispatcher:
    """Every override kforge holds at one dispatch key, shared by all installed packages.

    Owners (packages) add their variants together and remove them together; an op keeps
    one override while any owner has a variant of it.
    """

    _shared: dict[str, "Dispatcher"] = {}

    def __init__(self, key: str = "CUDA"):
        self.key = key
        self._owners: list[tuple[object, list[Variant]]] = []
        self._ops: dict[str, _OpOverride | _NativeOverride] = {}
        self._why: dict[str, str] = {}

    @classmethod
    def shared(cls, key: str = "CUDA") -> "Dispatcher":
        """The process-wide dispatcher for `key` (what CastPackage.install uses by default)."""
        if key not in cls._shared:
            cls._shared[key] = cls(key)
        return cls._shared[key]

    @property
    def ops(self) -> list[str]:
        """Ops overridden right now."""
        return sorted(self._ops)

    def path(self, op: str) -> tuple[str, str] | None:
        """("native" or "python", why) for an overridden op, None if it is not overridden."""
        override = self._ops.get(op)
        return None if override is None else (override.path, self._why[op])

    def owns(self, owner: object) -> bool:
        return any(o is owner for o, _ in self._owners)

    def add(self, owner: object, variants: Sequence[Variant]) -> None:
        if self.owns(owner):
            raise DispatchError(f"{owner!r} is already installed at {self.key}; uninstall it first")
        self._owners.append((owner, list(variants)))
        try:
            self._sync({v.card.op for v in variants})
        except Exception:
            self.remove(owner)
            raise

    def remove(self, owner: object) -> None:
        gone = [vs for o, vs in self._owners if o is owner]
        self._owners = [(o, vs) for o, vs in self._owners if o is not owner]
        self._sync({v.card.op for vs in gone for v in vs}, removing=True)

    def _sync(self, ops: set[str], removing: bool = False) -> None:
        """Bring each op's override in line with the owners' variants. Every op is synced
        even when one fails (the first error is raised after), so a package being removed
        never leaves kernels of its own installed."""
        errors: list[BaseException] = []
        for name in sorted(ops):
            try:
                self._sync_op(name, removing)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _sync_op(self, name: str, removing: bool) -> None:
        variants = [v for _, vs in self._owners for v in vs if v.card.op == name]
        override = self._ops.get(name)
        descriptions, why = _native_variants(variants, self.key) if variants else (None, "")
        if override is not None and (not variants or override.path != ("native" if descriptions else "python")):
            override.destroy()  # gone, or moving between C++ and Python: the original kernel comes back first
            del self._ops[name]
            override = None
        if not variants:
            self._why.pop(name, None)
            return
        if descriptions is not None:
            try:
                override = override or _NativeOverride(variants[0].card.overload(), self.key)
                override.set_variants(descriptions)
            except Exception as e:  # the C++ side refused a guard: the Python path serves the op
                if override is not None:
                    override.destroy()
                self._ops.pop(name, None)  # never keep a destroyed override
                override, descriptions = None, None
                why = f"kforge._dispatch refused the variants ({type(e).__name__}: {e})"
                log.warning("%s dispatches in Python: %s", name, why)
        if descriptions is None:
            if env.dispatch_path() == "native" and not removing:
                raise DispatchError(f"KFORGE_DISPATCH=native, but {name} cannot dispatch in C++: {why}")
            override = override or _OpOverride(variants[0].card.overload(), self.key)
            override.set_variants(variants)
        self._ops[name] = override
        self._why[name] = why


@contextlib.contextmanager
def installed(card: Card, launcher: Launcher, *, vid: int = 0, workspace: Sequence[int] = (),
              key: str = "CUDA") -> Iterator[Variant]:
    """One card's kernel dispatched through the real override while the block runs: calling
    the op (card.call_eager) inside takes the guard path exactly as a package would, so its
    latency is the latency as dispatched. Eager timed inside the block would hit the kernel
    too: time eager outside it."""
    variant = Variant(card, vid, launcher, tuple(workspace))
    dispatcher = Dispatcher(key)
    dispatcher.add(variant, [variant])
    try:
        yield variant
    finally:
        dispatcher.remove(variant)
