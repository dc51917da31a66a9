"""What a card requires of a call, written once: the guard specification every dispatch path checks.

A GuardSpec is built once from a card (GuardSpec.of_card; a region's from its inputs,
GuardSpec.of_inputs): per schema argument, a tensor's exact shape, strides (hence memory
format), dtype, device type and pointer alignment, a tensor list's tensors, or a value
(1, 1.0 and True differ; so do 0.0 and -0.0; NaN is NaN). Its `key` is one hashable tuple.
The paths compare calls against it:

- the Python override (kforge.python_override) looks the call's key (CallKey) up in a dict
  of spec keys, and charges a miss to the nearest spec (nearest());
- the C++ override (kforge._dispatch) compares the call against spec.native(), the spec
  serialized in one versioned format (FORMAT);
- the compile pass (kforge.inductor) keys a traced call from its FakeTensors (traced_key):
  alignment from the storage offset, since storage bases are 16-byte aligned;
- kforge.optimize's region call keys a region's inputs, and a custom op (kforge.customops)
  its own, against GuardSpec.of_inputs.

What a key cannot see, spec.unrunnable() checks on the real tensors: every input on one
device, a device argument naming that device, and no input the kernel writes sharing
memory with another input. Every path counts fallbacks by the names in REASONS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .cards import Card, TensorMeta, decode_value, dtype_name, pointer_alignment
from .errors import CardError

# Bumped with any change to what GuardSpec.native() writes; kforge._dispatch reads exactly one.
FORMAT = 1

# Why a call fell back, most fundamental first (the order decides which variant a miss is
# charged to). The first six are guard differences; the rest are checked after a key hit.
_MEANINGS = {
    "no-variant": "no variant has the call's argument structure (a tensor where the card has None, another "
                  "list length, a Python scalar or a conjugate/negative view where the card has a tensor)",
    "device": "another device type, inputs on several devices, a device argument naming another device, "
              "or kernels that cannot load on this device",
    "dtype": "an input has another dtype",
    "scalar": "a non-tensor argument has another value",
    "shape": "an input has another shape",
    "stride": "an input has other strides (another memory format or view)",
    "alignment": "an input's data pointer is aligned to other than the card's bytes (up to 16)",
    "aliasing": "an input the kernel writes shares memory with another input",
    "autograd": "the call needs a backward (a composite op's override runs above autograd): eager's decomposition records it",
    "refused": "the driver refused the kernel before it ran (a cooperative grid that cannot be resident now)",
}
REASONS = tuple(_MEANINGS)


def meaning(reason: str) -> str:
    """What a fallback reason means, for reports."""
    return _MEANINGS[reason]


class NotNative(Exception):
    """A guard the C++ override cannot express (the op then dispatches in Python)."""


# ---- keys of calls ---------------------------------------------------------------------------

_ALIGN = tuple(pointer_alignment(low) for low in range(16))  # alignment (<= 16) depends on the low 4 bits


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A call's tensor as a guard sees it (TensorGuard.key's layout)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        # A Python scalar where the schema says Tensor (a wrapped number): never a guard's key.
        return ("not a tensor", type(t).__name__)
    # torch.Size hashes and compares like the tuple in the guard: no conversion on the hot path.
    # (t.is_cuda is ~0.35 us cheaper than building t.device.)
    return (t.shape, t.stride(), t.dtype, "cuda" if t.is_cuda else t.device.type, _ALIGN[t.data_ptr() & 15])


def _tensors_key(ts: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(tensor_key(t) for t in ts)


# Ops with a kernel at the Conjugate or Negative key (copy_, clone, mm, ...) receive conjugate
# and negative views unresolved: the bit is part of what the kernel must do, and no card has one.
_LAZY_VIEW = ("conjugate or negative view",)


def _lazy_view_key(t: torch.Tensor | None) -> tuple | None:
    if isinstance(t, torch.Tensor) and (t.is_conj() or t.is_neg()):
        return _LAZY_VIEW
    return tensor_key(t)


def _lazy_views_key(ts: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(_lazy_view_key(t) for t in ts)


def value_key(v: Any) -> Any:
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
        return tuple(value_key(x) for x in v)
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
    list: lambda v: tuple([value_key(x) for x in v]),
    tuple: lambda v: tuple([value_key(x) for x in v]),
}


def slot_kind(arg: torch.Argument) -> str:
    t = str(arg.type)
    if t in ("Tensor", "Optional[Tensor]"):
        return "tensor"
    if t in ("List[Tensor]", "List[Optional[Tensor]]"):
        return "tensors"
    return "value"


_KEY_FNS: dict[str, Callable[[Any], Any]] = {"tensor": tensor_key, "tensors": _tensors_key, "value": value_key}
_LAZY_KEY_FNS = {**_KEY_FNS, "tensor": _lazy_view_key, "tensors": _lazy_views_key}


def call_key_fns(op: torch._ops.OpOverload) -> tuple[Callable[[Any], Any], ...]:
    """Per schema argument, the function that keys a real call's value of it."""
    lazy = any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in ("Conjugate", "Negative"))
    fns = _LAZY_KEY_FNS if lazy else _KEY_FNS
    return tuple(fns[slot_kind(a)] for a in op._schema.arguments)


def call_values(schema: torch.FunctionSchema, args: Sequence, kwargs: dict) -> list:
    """Every schema argument's value in a call: the dispatcher leaves out trailing defaults
    and passes kwarg-only ones by name."""
    return list(args) + [kwargs.get(a.name, a.default_value if a.has_default_value() else None)
                         for a in schema.arguments[len(args):]]


class _Symbolic(Exception):
    """A traced call whose key is not static (symbolic shapes or values)."""


def _static(xs: Sequence) -> tuple:
    if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in xs):
        raise _Symbolic
    return tuple(xs)


def _traced_tensor_key(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return tensor_key(t)  # None, or a Python scalar (or an untraced node) where the schema says Tensor
    if t.is_conj() or t.is_neg():
        return _LAZY_VIEW
    offset = t.storage_offset()
    if isinstance(offset, torch.SymInt):
        raise _Symbolic
    return (_static(t.shape), _static(t.stride()), t.dtype, t.device.type, pointer_alignment(offset * t.element_size()))


def _traced_value_key(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        _static(v)
    elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    return value_key(v)


_TRACED_KEY_FNS: dict[str, Callable[[Any], Any]] = {
    "tensor": _traced_tensor_key,
    "tensors": lambda ts: tuple(_traced_tensor_key(t) for t in ts),
    "value": _traced_value_key,
}


def traced_key(schema: torch.FunctionSchema, vals: Sequence) -> tuple | None:
    """The key of a traced call (its tensors FakeTensors, as node.meta["val"] holds them), or
    None where it is not static: a symbolic call never hits a card."""
    try:
        return tuple(_TRACED_KEY_FNS[slot_kind(a)](x) for a, x in zip(schema.arguments, vals))
    except _Symbolic:
        return None


# ---- the specification ------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorGuard:
    """A tensor argument as the card recorded it: the call's must be exactly this."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str  # device type; the index is checked by unrunnable()
    align: int  # bytes, <= 16

    @staticmethod
    def of(m: TensorMeta | None) -> "TensorGuard | None":
        return None if m is None else TensorGuard(tuple(m.shape), tuple(m.stride), m.torch_dtype, m.device, m.align)

    @property
    def key(self) -> tuple:
        return (self.shape, self.stride, self.dtype, self.device, self.align)

    def native(self) -> tuple:
        return (list(self.shape), list(self.stride), dtype_name(self.dtype), self.device, self.align)


def _native_value(v: Any) -> tuple:
    """A value's C++ guard: what value_key tells apart, it tells apart."""
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
    raise NotNative(f"no C++ guard for the value {v!r}")


@dataclass(frozen=True)
class Slot:
    """What one schema argument must be: a tensor (None: the call passes None), a list of
    tensors, or a value."""

    name: str
    kind: str  # "tensor" | "tensors" | "value"
    tensor: TensorGuard | None = None
    tensors: tuple[TensorGuard | None, ...] = ()
    value: Any = None

    @property
    def key(self) -> Any:
        if self.kind == "tensor":
            return None if self.tensor is None else self.tensor.key
        if self.kind == "tensors":
            return tuple(None if g is None else g.key for g in self.tensors)
        return value_key(self.value)

    def native(self) -> tuple:
        if self.kind == "tensor":
            return ("tensor", None if self.tensor is None else self.tensor.native())
        if self.kind == "tensors":
            return ("tensors", [None if g is None else g.native() for g in self.tensors])
        return ("value", _native_value(self.value))


def _slot(arg: torch.Argument, spec: Any) -> Slot:
    """The slot of schema argument `arg` from the card's ArgSpec (None: the card left a defaulted
    argument out, and calls see the default)."""
    kind = slot_kind(arg)
    if spec is None:
        default = arg.default_value if arg.has_default_value() else None
        if kind == "value":
            return Slot(arg.name, kind, value=default)
        if default is None:
            return Slot(arg.name, kind)
        raise CardError(f"argument {arg.name} is left out of the card and its default is not None")
    if spec.kind == kind == "tensor":
        return Slot(arg.name, kind, tensor=TensorGuard.of(spec.tensor))
    if spec.kind == kind == "tensors":
        return Slot(arg.name, kind, tensors=tuple(TensorGuard.of(m) for m in spec.tensors))
    if spec.kind == "value":
        value = decode_value(spec.value)
        if kind == "value":
            return Slot(arg.name, kind, value=value)
        if kind == "tensor" and value is None:  # a card records None in a Tensor? slot as a value
            return Slot(arg.name, kind)
        if kind == "tensors" and isinstance(value, list) and not value:
            return Slot(arg.name, kind)
    raise CardError(f"argument {arg.name} is a {spec.kind} in the card and a {kind} in the schema")


@dataclass(frozen=True)
class GuardSpec:
    """What a call must be to run a card's kernel: one slot per schema argument (see the module doc)."""

    slots: tuple[Slot, ...]
    written: tuple[int, ...] = ()  # inputs (Card.inputs order) the kernel writes: none may share memory with another
    device_slots: tuple[int, ...] = ()  # Device arguments: each must name the inputs' device
    key: tuple = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", tuple(s.key for s in self.slots))

    @staticmethod
    def of_card(card: Card, schema: torch.FunctionSchema | None = None) -> "GuardSpec":
        """Raises CardError where the card does not fit the op's schema."""
        schema = schema or card.overload()._schema
        by_name = {a.name: a for a in card.args}
        return GuardSpec(tuple(_slot(arg, by_name.get(arg.name)) for arg in schema.arguments),
                         tuple(sorted(card.written_inputs)),
                         tuple(i for i, a in enumerate(schema.arguments) if "Device" in str(a.type)))

    @staticmethod
    def of_inputs(metas: Sequence[TensorMeta]) -> "GuardSpec":
        """A call of tensors only (a region's inputs, a custom op's): one tensor slot each."""
        return GuardSpec(tuple(Slot(f"x{i}", "tensor", tensor=TensorGuard.of(m)) for i, m in enumerate(metas)))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.slots)

    def differences(self, call_key: tuple) -> list[str]:
        return differences(call_key, self.key, self.kinds)

    def unrunnable(self, ins: Sequence[torch.Tensor], devices: Sequence = ()) -> str | None:
        """What a key cannot see, as kforge._dispatch checks it: every input on one device, and
        any device argument naming that device, an index-less one meaning the current device
        (keys hold device types, not indices: x.to("cuda:1") of a cuda:0 tensor is eager's),
        and no input the kernel writes sharing memory with another input. None when the
        kernel may run."""
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
        for w in self.written:
            storage = ins[w].untyped_storage()
            if any(i != w and t.untyped_storage().data_ptr() == storage.data_ptr() for i, t in enumerate(ins)):
                return "aliasing"
        return None

    def native(self) -> tuple:
        """The spec as kforge._dispatch reads it: (FORMAT, slots, written, device_slots). Raises NotNative."""
        return (FORMAT, [s.native() for s in self.slots], list(self.written), list(self.device_slots))


_TENSOR_FIELDS = ("shape", "stride", "dtype", "device", "alignment")  # order of tensor_key


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


def nearest(call_key: tuple, specs: Sequence[GuardSpec]) -> tuple[int, str]:
    """The spec a missed call is charged to, and why: the one whose most fundamental difference
    is the least fundamental, then that differs in the fewest ways, then the first (as
    kforge._dispatch charges a miss)."""
    best: tuple | None = None
    for i, spec in enumerate(specs):
        diffs = spec.differences(call_key) or ["no-variant"]
        score = (REASONS.index(diffs[0]), -len(diffs), -i)
        if best is None or score > best[0]:
            best = (score, i, diffs[0])
    if best is None:
        raise ValueError("nearest() needs at least one spec")
    return best[1], best[2]
