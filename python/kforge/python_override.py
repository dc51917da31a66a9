"""The override of one op in Python: a torch.library kernel that checks calls against its
variants' guard specifications (kforge.guards), where kforge._dispatch cannot serve the op."""

from __future__ import annotations

import warnings

import torch

from . import composite
from .boxing import call_original
from .guards import GuardSpec, call_key_fns, nearest, slot_kind
from .variant import DispatchError, Variant

_OVERRIDE_WARNING = "(?s).*Overriding a previously registered kernel for the same operator.*"
_MISS_MEMO_LIMIT = 4096


def get_kernel(op: torch._ops.OpOverload, key: str):
    getter = getattr(torch.library, "get_kernel", None)
    if getter is None:
        raise DispatchError(f"guarded dispatch needs torch.library.get_kernel (torch >= 2.9); "
                          f"this is torch {torch.__version__}: upgrade torch")
    return getter(op, key)


class PythonOverride:
    """The torch.library kernel of one op at one dispatch key, in Python."""

    path = "python"

    def __init__(self, op: torch._ops.OpOverload, key: str):
        self.op = op
        schema = op._schema
        self._key_fns = call_key_fns(op)
        # Arguments the dispatcher may leave out: trailing defaults and kwarg-only ones.
        self._params = tuple((a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments)
        self._tensor_slots = tuple(i for i, a in enumerate(schema.arguments) if slot_kind(a) != "value")
        self._single = len(schema.returns) == 1
        self.table: dict[tuple, Variant] = {}
        self._variants: list[Variant] = []
        self._specs: list[GuardSpec] = []
        self._misses: dict[tuple, tuple[Variant, str]] = {}
        # Taken before the override exists: the kernel every miss goes to.
        self.original = get_kernel(op, key)
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
        self._variants = list(variants)
        self._specs = [v.guard for v in variants]
        self.table = {v.guard.key: v for v in variants}
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
        devices = v.guard.device_slots
        why = v.guard.unrunnable(ins, [vals[i] for i in devices] if devices else ())
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
            i, reason = nearest(key, self._specs)
            hit = (self._variants[i], reason)
            if len(self._misses) >= _MISS_MEMO_LIMIT:
                self._misses.clear()
            self._misses[key] = hit
        hit[0].counters.fell_back(hit[1])
