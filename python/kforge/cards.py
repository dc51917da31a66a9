"""Operator cards: one runtime-compatible variant of an aten call, with its evidence.

A card is identified by a stable hash of the op overload, every argument's metadata
(shape, stride, dtype, device type, pointer alignment, scalar values) and the device
arch. Its sample inputs and eager reference outputs are stored (kforge.card_files) each
tensor as the span of storage it views (pack/unpack here), so strides and alignment survive.

Tensor numbering used everywhere (launch plans, dispatch, evaluation):
  inputs  = every tensor argument in schema order, tensor lists flattened;
  outputs = every tensor the op returns, in order, tuples flattened.

A region card (`region` set, kforge.subgraph) stands for several aten calls fused: its args
are its input tensors ("in0", "in1", ...), its outputs the values the region returns, and
calling it eagerly replays the subgraph; its id hashes the subgraph too.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .errors import CardError

if TYPE_CHECKING:
    from .subgraph import Subgraph

CARD_FORMAT = 2  # 2: region cards (the `region` field)

# "region": a fused multi-op card (kforge.subgraph); the others are families of single aten ops.
FAMILIES = ("pointwise", "reduction", "normalization", "pooling", "vendor", "view", "other", "region")
REGION_NS = "region::"  # a region card's op: "region::" and its ops' names, "region::add+pow+mean+rsqrt+mul"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CardError(f"unknown dtype {name!r} in card")
    return dt


def pointer_alignment(ptr: int) -> int:
    """Largest power of two <= 16 that divides the address (what vector loads care about)."""
    for a in (16, 8, 4, 2):
        if ptr % a == 0:
            return a
    return 1


_OVERWRITES = frozenset({"copy_", "fill_", "zero_"})  # in-place ops that never read self's old values


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str  # device type: "cuda" or "cpu"; the index is not part of a card
    align: int = 16  # pointer alignment in bytes, capped at 16
    storage_offset: int = 0  # informational; the kernel only sees data_ptr()
    lo: float | None = None  # value range of integer/bool samples, for fresh inputs
    hi: float | None = None

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        lo = hi = None
        if not (t.is_floating_point() or t.is_complex()) and t.numel() and t.device.type != "meta":
            lo, hi = float(t.min()), float(t.max())
        return TensorMeta(
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            dtype=dtype_name(t.dtype),
            device=t.device.type,
            align=pointer_alignment(t.data_ptr()) if t.device.type != "meta" else 16,
            storage_offset=t.storage_offset(),
            lo=lo,
            hi=hi,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the elements this view addresses (what a kernel must read or write)."""
        return self.numel * self.itemsize

    def span(self) -> int:
        """Elements of storage the view touches, from its first element."""
        if self.numel == 0:
            return 0
        return 1 + sum((s - 1) * abs(st) for s, st in zip(self.shape, self.stride))

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.shape):
            expected.append(acc)
            acc *= max(s, 1)
        return all(s == 1 or st == e for s, st, e in zip(self.shape, self.stride, reversed(expected)))

    def key(self) -> tuple:
        """What a guard compares: everything that changes what a kernel must do."""
        return (self.shape, self.stride, self.dtype, self.device, self.align)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "TensorMeta":
        d = dict(d)
        d["shape"], d["stride"] = tuple(d["shape"]), tuple(d["stride"])
        return TensorMeta(**d)


# ---- non-tensor argument values, JSON encoded ----------------------------------------

def encode_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": repr(v)} if not math.isfinite(v) else v
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": v.type}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    if isinstance(v, torch.SymInt):
        return int(v)
    raise CardError(f"cannot record argument value of type {type(v).__name__}: {v!r}")


def decode_value(v: Any, device: str | None = None) -> Any:
    """encode_value's inverse; raises CardError for anything encode_value does not write
    (cards also come from packages, which are untrusted)."""
    if isinstance(v, list):
        return [decode_value(x, device) for x in v]
    if isinstance(v, dict):
        k, x = next(iter(v.items())) if len(v) == 1 else (None, None)
        if isinstance(x, str):
            if k == "float" and x.lstrip("+-") in ("inf", "nan"):
                return float(x)
            if k == "dtype":
                return dtype_from_name(x)
            if k == "device":
                try:
                    return torch.device(device or x)
                except RuntimeError as e:
                    raise CardError(f"unknown device {x!r} in card") from e
            kinds = {"memory_format": torch.memory_format, "layout": torch.layout}
            if k in kinds and isinstance(getattr(torch, x, None), kinds[k]):
                return getattr(torch, x)
        raise CardError(f"unknown encoded value {v!r}")
    return v


@dataclass
class ArgSpec:
    """One schema argument: a tensor, a list of tensors (None items allowed), or a value."""

    name: str
    kind: str  # "tensor" | "tensors" | "value"
    kwarg_only: bool = False
    tensor: TensorMeta | None = None
    tensors: list[TensorMeta | None] | None = None
    value: Any = None  # JSON-encoded (encode_value)
    written: bool = False  # schema alias info says the op writes it

    def key(self) -> tuple:
        if self.kind == "tensor":
            return ("t", self.tensor.key(), self.written)
        if self.kind == "tensors":
            return ("l", tuple(m.key() if m else None for m in self.tensors), self.written)
        return ("v", json.dumps(self.value, sort_keys=True))

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "kwarg_only": self.kwarg_only, "written": self.written}
        if self.kind == "tensor":
            d["tensor"] = self.tensor.to_json()
        elif self.kind == "tensors":
            d["tensors"] = [m.to_json() if m else None for m in self.tensors]
        else:
            d["value"] = self.value
        return d

    @staticmethod
    def from_json(d: dict) -> "ArgSpec":
        return ArgSpec(
            name=d["name"],
            kind=d["kind"],
            kwarg_only=d.get("kwarg_only", False),
            tensor=TensorMeta.from_json(d["tensor"]) if d.get("tensor") else None,
            tensors=[TensorMeta.from_json(m) if m else None for m in d["tensors"]] if d.get("tensors") is not None else None,
            value=d.get("value"),
            written=d.get("written", False),
        )


def qualified_name(op: torch._ops.OpOverload) -> str:
    """The name a card holds for `op`: its qualified overload name, "aten::_softmax.default"."""
    return f"{op._schema.name}.{op._overloadname}"


@dataclass
class Card:
    op: str  # qualified_name() of the op
    schema: str
    args: list[ArgSpec]
    outputs: list[TensorMeta]
    arch: str  # "sm_90", or "cpu" for cards captured on the CPU
    family: str = "other"
    aliases: dict[int, int] = field(default_factory=dict)  # output index -> input index it is
    device_name: str = ""
    calls: int = 0
    top_calls: int | None = None  # calls not nested inside another recorded call (None: not recorded)
    module_paths: list[str] = field(default_factory=list)
    eager_us: float | None = None  # per call, measured by replaying the card
    total_us: float | None = None  # eager_us * calls (or profiler time)
    share: float | None = None  # of the captured runtime
    samples: int = 0  # sample sets stored on disk
    notes: list[str] = field(default_factory=list)
    region: "Subgraph | None" = None  # the fused aten calls of a region card (kforge.subgraph)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = card_id(self.op, self.args, self.arch, self.region)

    # ---- views of the arguments ---------------------------------------------------------
    @property
    def inputs(self) -> list[TensorMeta]:
        """Tensor inputs in launch-plan order (None items of tensor lists are skipped)."""
        return [m for _, m in self._tensor_args()]

    def _tensor_args(self):
        """(its ArgSpec, its meta) for every tensor input, in `inputs` order."""
        for a in self.args:
            metas = [a.tensor] if a.kind == "tensor" else a.tensors or [] if a.kind == "tensors" else []
            yield from ((a, m) for m in metas if m is not None)

    @property
    def written_inputs(self) -> set[int]:
        """Indices (in `inputs`) of tensors the op writes: in-place and out= arguments."""
        return {i for i, (a, _) in enumerate(self._tensor_args()) if a.written}

    @property
    def write_only_inputs(self) -> set[int]:
        """Indices (in `inputs`) of written tensors whose old values the op never reads: out=
        arguments, and self of an op that overwrites it (copy_, fill_, zero_)."""
        try:
            outs = {a.name for a in torch._C.parse_schema(self.schema).arguments if a.is_out}
        except Exception:  # noqa: BLE001 (no parsable schema: out= arguments are named out)
            outs = {"out"}
        overwrites = self.name.split(".")[0] in _OVERWRITES
        return {i for i, (a, _) in enumerate(self._tensor_args())
                if a.written and (a.name in outs or overwrites and a.name == "self")}

    @property
    def name(self) -> str:
        return self.op.removeprefix("aten::")

    @property
    def device_type(self) -> str:
        ins = self.inputs
        return ins[0].device if ins else (self.outputs[0].device if self.outputs else "cpu")

    def summary(self) -> str:
        """One line for tables: op and its tensor shapes/dtypes."""
        parts = [f"{'x'.join(map(str, m.shape)) or 'scalar'}:{m.dtype}" for m in self.inputs]
        return f"{self.name}({', '.join(parts)})"

    def io_bytes(self) -> int:
        """Fewest bytes a kernel must move: every input it reads read once (not an out= argument
        or copy_'s destination), every output written once."""
        skip = self.write_only_inputs
        reads = sum(m.nbytes for i, m in enumerate(self.inputs) if i not in skip)
        writes = sum(m.nbytes for m in self.outputs)  # an in-place output is still a write
        returned = set(self.aliases.values())
        writes += sum(self.inputs[i].nbytes for i in self.written_inputs if i not in returned)
        return reads + writes

    def key(self) -> tuple:
        region = self.region.key() if self.region is not None else None
        return (self.op, tuple(a.key() for a in self.args), self.arch, region)

    def retarget(self, device: str, arch: str) -> "Card":
        """The same call on another device type: what a CPU capture would be on the GPU.
        Kernels can be generated and compiled for it; it has no samples of its own."""
        from dataclasses import replace

        def move(m: TensorMeta | None) -> TensorMeta | None:
            return replace(m, device=device) if m is not None else None

        args = [replace(a, tensor=move(a.tensor), tensors=[move(m) for m in a.tensors] if a.tensors is not None else None)
                for a in self.args]
        region = self.region.retarget(device) if self.region is not None else None
        return replace(self, args=args, outputs=[move(m) for m in self.outputs], arch=arch, id="", samples=0, region=region,
                       notes=self.notes + [f"retargeted from a {self.device_type} capture ({self.id}) to {device} {arch}"])

    # ---- the op itself ------------------------------------------------------------------
    def overload(self) -> torch._ops.OpOverload:
        if self.region is not None:
            raise CardError(f"{self.op} is a region of {len(self.region.nodes)} aten calls, not one overload: "
                            "run it with call_eager")
        ns, sep, rest = self.op.partition("::")
        name, _, ov = rest.partition(".")
        try:
            op = None if not sep or ns.startswith("__") else getattr(getattr(getattr(torch.ops, ns), name), ov or "default")
        except AttributeError as e:
            raise CardError(f"op {self.op} does not exist in torch {torch.__version__}") from e
        if not isinstance(op, torch._ops.OpOverload):  # "__class__::__init__.__call__" walks Python attributes
            raise CardError(f"op {self.op!r} is not an operator overload (ns::name.overload) of torch {torch.__version__}")
        return op

    def build_call(self, tensors: list[torch.Tensor], device: str | torch.device | None = None) -> tuple[list, dict]:
        """Put `tensors` (in `inputs` order) back into the schema's args and kwargs."""
        it = iter(tensors)
        args, kwargs = [], {}
        dev = str(device) if device is not None else None
        for a in self.args:
            if a.kind == "tensor":
                v = next(it)
            elif a.kind == "tensors":
                v = [next(it) if m is not None else None for m in a.tensors]
            else:
                v = decode_value(a.value, dev)
            (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
        return args, kwargs

    def call_eager(self, tensors: list[torch.Tensor], device=None) -> list[torch.Tensor]:
        """Run the op through PyTorch; returns its outputs flattened (aliases included). A
        region replays its aten calls one by one."""
        if self.region is not None:
            return self.region.replay(tensors, device)
        args, kwargs = self.build_call(tensors, device)
        return flatten_outputs(self.overload()(*args, **kwargs))

    # ---- fresh inputs ---------------------------------------------------------------------
    def random_inputs(self, seed: int, device: str | torch.device = "cuda") -> list[torch.Tensor]:
        """Fresh inputs with the card's exact metadata and values drawn like the samples', drawn on
        `device` (a seed gives the same values on every device of one type: drawn on the CPU and
        copied over, the fresh sets of a 100 MB card took 0.25-0.5 s each on the H200's host, most
        of the time a search spent on such a card before its first candidate)."""
        dev = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(seed)
        return [random_like(m, g) for m in self.inputs]

    # ---- storage ----------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": CARD_FORMAT,
            "id": self.id,
            "op": self.op,
            "schema": self.schema,
            "args": [a.to_json() for a in self.args],
            "outputs": [m.to_json() for m in self.outputs],
            "aliases": {str(k): v for k, v in self.aliases.items()},
            "arch": self.arch,
            "family": self.family,
            "device_name": self.device_name,
            "calls": self.calls,
            "top_calls": self.top_calls,
            "module_paths": self.module_paths,
            "eager_us": self.eager_us,
            "total_us": self.total_us,
            "share": self.share,
            "samples": self.samples,
            "notes": self.notes,
            **({"region": self.region.to_json()} if self.region is not None else {}),
        }

    @staticmethod
    def from_json(d: dict) -> "Card":
        if d.get("format", 0) > CARD_FORMAT:
            raise CardError(f"card format {d.get('format')} is newer than this kforge reads ({CARD_FORMAT}); upgrade kforge")
        return Card(
            op=d["op"],
            schema=d["schema"],
            args=[ArgSpec.from_json(a) for a in d["args"]],
            outputs=[TensorMeta.from_json(m) for m in d["outputs"]],
            aliases={int(k): v for k, v in d.get("aliases", {}).items()},
            arch=d["arch"],
            family=d.get("family", "other"),
            device_name=d.get("device_name", ""),
            calls=d.get("calls", 0),
            top_calls=d.get("top_calls"),
            module_paths=d.get("module_paths", []),
            eager_us=d.get("eager_us"),
            total_us=d.get("total_us"),
            share=d.get("share"),
            samples=d.get("samples", 0),
            notes=d.get("notes", []),
            region=_region_from_json(d["region"]) if d.get("region") is not None else None,
            id=d["id"],
        )


def _region_from_json(d: Any) -> "Subgraph":
    from .subgraph import Subgraph

    try:
        return Subgraph.from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CardError(f"region of card is malformed ({e!r})") from e


def card_id(op: str, args: list[ArgSpec], arch: str, region: "Subgraph | None" = None) -> str:
    parts = [op, [a.key() for a in args], arch] + ([region.key()] if region is not None else [])
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        flat: list[torch.Tensor] = []
        for o in out:
            flat += flatten_outputs(o)
        return flat
    return []


# ---- faithful tensors -----------------------------------------------------------------

def _min_offset(m: TensorMeta) -> int:
    """Lowest storage index the view touches, relative to its storage_offset (<= 0 for negative strides)."""
    return sum((s - 1) * st for s, st in zip(m.shape, m.stride) if st < 0 and s > 0)


def empty_like_meta(m: TensorMeta, device: str | torch.device) -> torch.Tensor:
    """An uninitialised tensor with m's shape, stride, dtype and pointer alignment."""
    item = m.itemsize
    pad = (m.align % 16) // item if m.align < 16 else 0  # shift so data_ptr % 16 == align
    lo = _min_offset(m)
    base = torch.empty(m.span() + pad + 16, dtype=m.torch_dtype, device=device)
    return base.as_strided(m.shape, m.stride, pad - lo)


def random_like(m: TensorMeta, g: torch.Generator) -> torch.Tensor:
    """A tensor with `m`'s metadata on the generator's device, values drawn there (over its storage
    where its elements share memory: an expand, a class token broadcast over the batch)."""
    dev, dt = g.device, m.torch_dtype
    target = t = empty_like_meta(m, dev)
    if t.numel() and torch._debug_has_internal_overlap(t) != 0:
        target = t.as_strided((m.span(),), (1,), t.storage_offset() + _min_offset(m))
    if dt.is_floating_point or dt.is_complex:
        vals = torch.randn(target.shape, generator=g, dtype=torch.float32, device=dev)
    elif dt == torch.bool:
        vals = torch.rand(target.shape, generator=g, device=dev) < 0.5
    else:
        lo = int(m.lo) if m.lo is not None else 0
        hi = int(m.hi) if m.hi is not None else 100
        vals = torch.randint(lo, hi + 1, target.shape, generator=g, dtype=torch.int64, device=dev)
    target.copy_(vals.to(dt))
    return t


def pack(t: torch.Tensor) -> torch.Tensor:
    """The 1-D span of storage a view touches, as a contiguous CPU tensor (for safetensors)."""
    m = TensorMeta.of(t) if t.device.type != "meta" else None
    span = m.span() if m else 0
    lo = _min_offset(m) if m else 0
    flat = t.as_strided((span,), (1,), t.storage_offset() + lo) if span else t.new_empty(0)
    return flat.detach().to("cpu", copy=True).contiguous()


def unpack(flat: torch.Tensor, m: TensorMeta, device) -> torch.Tensor:
    t = empty_like_meta(m, device)
    if m.span():
        lo = _min_offset(m)
        t.as_strided((m.span(),), (1,), t.storage_offset() + lo).copy_(flat)
    return t


def faithful_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy that keeps shape, strides and alignment (clone() would make it contiguous)."""
    return unpack(pack(t), TensorMeta.of(t), t.device) if t.numel() else t.clone()
