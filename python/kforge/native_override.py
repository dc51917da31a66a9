"""The override of one op in C++ (kforge._dispatch, csrc/torch_dispatch.cpp): whether it can
serve an op here, and the description of each variant it takes (the variant's guard
specification in its serialized form, kforge.guards.GuardSpec.native, plus how to launch)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import composite, env, guards, runtime
from .cards import dtype_name
from .errors import CardError
from .variant import Variant

_native: tuple[Any, str] | None = None  # (kforge._dispatch or None, why)
_stream_checked = False


def native_module() -> tuple[Any, str]:
    """(kforge._dispatch, why) where it loads and reads this kforge's guards, else (None, why not)."""
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
            elif tuple(mod.REASONS) != guards.REASONS:
                _native = None, "kforge._dispatch counts other fallback reasons than kforge.guards: rebuild kforge"
            elif getattr(mod, "GUARD_FORMAT", None) != guards.FORMAT:
                _native = None, (f"kforge._dispatch reads guard format {getattr(mod, 'GUARD_FORMAT', 0)}, kforge "
                                 f"writes {guards.FORMAT}: rebuild kforge")
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
    mod, why = native_module()
    if mod is None:
        return False, why
    if key == "CUDA":
        bad = _check_stream(mod)
        if bad:
            return False, bad
    return True, why


def _description(v: Variant, native: Any) -> tuple:
    """The description kforge._dispatch.Override.set_variants takes, or guards.NotNative."""
    how = getattr(v.launcher, "native", None)
    info = how(v.vid) if how is not None else None
    if info is None:
        raise guards.NotNative(f"{type(v.launcher).__name__} launches from Python only")
    fn, vid, context = info
    outputs = [(src, list(shape), list(stride), dtype_name(dt)) for src, shape, stride, dt in v.out_specs]
    return v.guard.native(), outputs, list(v.workspace), fn, vid, context, v.counters.native_cell(native)


def native_variants(variants: Sequence[Variant], key: str) -> tuple[list | None, str]:
    """(descriptions for kforge._dispatch, why) or (None, why the op stays in Python)."""
    ok, why = native_status(key)
    if not ok:
        return None, why
    native, _ = native_module()
    descriptions = []
    for v in variants:
        try:
            descriptions.append(_description(v, native))
        except (guards.NotNative, CardError) as e:
            return None, f"card {v.card.id}: {e}"
    return descriptions, why


class NativeOverride:
    """The boxed C++ kernel of one op at one dispatch key (kforge._dispatch.Override)."""

    path = "native"

    def __init__(self, op: torch._ops.OpOverload, key: str):
        self.op = op
        native, _ = native_module()
        schema = op._schema
        self._impl = native.Override(schema.name, schema.overload_name, key, composite.override_key(op, key))

    def set_variants(self, descriptions: list) -> None:
        self._impl.set_variants(descriptions)

    def destroy(self) -> None:
        self._impl.destroy()
