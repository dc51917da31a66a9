"""The kernel IR: what a generated kernel computes, with no CUDA in it.

A `Program` is one kernel's worth of memory-bound work over an iteration `domain` (a
shape). Every tensor it touches carries its strides over that domain (0 where it
broadcasts), so any layout is indexed through its own strides and nothing is copied.

- Pointwise: each output is an `Expr` evaluated at every point of the domain.
- A scan: `scan` folds the prologue along one dim, every output point seeing the running
  state (cumsum, cumprod; reversed and exclusive forms for regions).
- A windowed fold: `window` (max/avg pooling over the last two dims, with indices).
- One reduction level: `reduction` folds an `Expr` (the prologue) over the domain's
  `reduce_dims` with a `ReductionKind` (reductions.REDUCTIONS); the outputs are then `Expr`s that
  may use the reduction's state (`Expr.var("s0")`, ...). An output with stride 0 over the
  reduced dims is written once per kept point (the epilogue: mean's divide, std's sqrt);
  one that varies over them makes the program a normalization (`normalizes`): its epilogue
  runs at every point of the domain and may read any input there ((x - mean) * rstd * w,
  exp(x - max) / sum). Group norm's domain splits the channel dim into (groups, channels
  per group), so its statistics are per (sample, group).

`Expr` is a small immutable tree (a DAG once equal subtrees are shared) of primitives
(`PRIMS`). Values are in their compute dtype: float16/bfloat16 are loaded as float32 and
rounded once on store (eager's opmath); ints and bool compute in their own dtype. The same
tree is lowered to CUDA (lower/) and evaluated by the reference interpreter (interp.py).

Builder API (for single-op cards and for fused regions):

    from kforge.codegen.build import from_nodes
    prog = from_nodes(nodes, inputs, outputs, out_metas, aliases, sources)   # Program, or a str: why not

    nodes:   [Node(op, args, metas), ...] in execution order; `op` is an aten overload name
             ("aten::add.Tensor"); `args` maps every schema argument name to its value, a
             tensor being `Ref("in", i)` (inputs[i]) or `Ref("node", j, k)` (output k of
             node j); `metas` are the node's output TensorMetas (eager rounds every node's
             result to its dtype, and so does the program).
    inputs:  the region's input TensorMetas (launch-plan numbering).
    outputs: [Ref, ...] the values the kernel writes; out_metas: their TensorMetas.
    aliases: output index -> input index it overwrites (in-place and out= ops).
    sources: the launch-plan input each of `inputs` reads (None: each its own); the builder
             adds inputs of its own (per-channel vectors, an input read after a reshape).

A node's expression comes from ops.py (the one pointwise table) or reductions.py; at most one node may be a
reduction, a normalization (reductions.NORM_OPS) or a scan, nodes before it form its prologue and
nodes after it its epilogue (over the whole domain after a keepdim reduction or a norm op).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable

FLOATS = ("float64", "float32", "float16", "bfloat16")
INTS = ("int64", "int32", "int16", "int8", "uint8")
DTYPES = FLOATS + INTS + ("bool",)


def opmath(dtype: str) -> str:
    """The dtype eager computes a `dtype` op in: float32 for the 16-bit floats, else itself."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


# name -> (arity, result: "same" (the operands' dtype) | "bool", which dtypes it takes)
# "float": floating only, "int": integers and bool, "any": everything.
PRIMS: dict[str, tuple[int, str, str]] = {
    **{n: (1, "same", "float") for n in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "asin",
        "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "lgamma",
        "ceil", "floor", "trunc", "rint", "j0", "j1", "i0", "i1")},
    **{n: (2, "same", "float") for n in ("pow", "atan2", "fmod", "hypot", "copysign", "nextafter", "fmax", "fmin")},
    **{n: (1, "same", "any") for n in ("neg", "abs")},
    **{n: (2, "same", "any") for n in ("add", "sub", "mul", "div", "max", "min")},
    **{n: (2, "same", "int") for n in ("and", "or", "xor", "shl", "shr", "mod")},
    "not": (1, "same", "int"),
    **{n: (2, "bool", "any") for n in ("lt", "le", "gt", "ge", "eq", "ne")},
    **{n: (1, "bool", "any") for n in ("isnan", "isinf", "signbit")},
    "where": (3, "same", "any"),  # where(cond: bool, a, b): a and b's dtype
}


@dataclass(frozen=True)
class Expr:
    """op: a PRIMS name, or "load" (value: (input index, stored dtype)), "const" (value: the
    number), "cast" (to `dtype`; value ("round", d): rounded to storage dtype d, held in
    float32), "var" (value: a name the kernel binds: "ridx", the flat row-major index of the
    reduced element, int64; the reduction's state "s0", "s1", ... in the epilogue; merge's
    operands "a0", "b0", ... inside a ReductionKind)."""

    op: str
    args: tuple["Expr", ...] = ()
    dtype: str = "float32"
    value: Any = None

    # ---- building -------------------------------------------------------------------
    @staticmethod
    def const(v: float | int | bool, dtype: str) -> "Expr":
        if dtype == "bool":
            v = bool(v)
        elif dtype in INTS:
            v = int(v)
        else:
            v = float(v)
        return Expr("const", (), dtype, v)

    @staticmethod
    def load(i: int, stored: str) -> "Expr":
        return Expr("load", (), opmath(stored), (i, stored))

    @staticmethod
    def var(name: str, dtype: str) -> "Expr":
        return Expr("var", (), dtype, name)

    def cast(self, dtype: str) -> "Expr":
        """To compute dtype `dtype` (a storage dtype rounds: cast(x, "bfloat16") is x rounded to
        bf16 and held as float32)."""
        if dtype in ("float16", "bfloat16"):  # a value already exact in it rounds to itself
            exact = self.dtype == "float32" and _exact_in(self, dtype)
            return self if exact else Expr("cast", (self,), "float32", ("round", dtype))
        return self if dtype == self.dtype else Expr("cast", (self,), dtype)

    def _lift(self, x) -> "Expr":
        return x if isinstance(x, Expr) else Expr.const(x, self.dtype)

    def __add__(self, o): return prim("add", self, o)
    def __radd__(self, o): return prim("add", self._lift(o), self)
    def __sub__(self, o): return prim("sub", self, o)
    def __rsub__(self, o): return prim("sub", self._lift(o), self)
    def __mul__(self, o): return prim("mul", self, o)
    def __rmul__(self, o): return prim("mul", self._lift(o), self)
    def __truediv__(self, o): return prim("div", self, o)
    def __rtruediv__(self, o): return prim("div", self._lift(o), self)
    def __neg__(self): return prim("neg", self)
    def __lt__(self, o): return prim("lt", self, o)
    def __le__(self, o): return prim("le", self, o)
    def __gt__(self, o): return prim("gt", self, o)
    def __ge__(self, o): return prim("ge", self, o)
    def __and__(self, o): return prim("and", self, o)
    def __or__(self, o): return prim("or", self, o)
    def __invert__(self): return prim("not", self)
    # == and != stay structural (Expr is a dict key); use eq(a, b) / ne(a, b).

    def walk(self):
        """Every node once, operands before users."""
        seen: dict[Expr, None] = {}

        def go(e: Expr):
            if e in seen:
                return
            for a in e.args:
                go(a)
            seen[e] = None
        go(self)
        return list(seen)


def prim(name: str, *args) -> Expr:
    """A primitive applied to operands; Python numbers take the dtype of the Expr operands."""
    arity, result, takes = PRIMS[name]
    if len(args) != arity:
        raise TypeError(f"{name} takes {arity} operands")
    ref = next((a for a in (args[1:] if name == "where" else args) if isinstance(a, Expr)), None)
    if ref is None:
        raise TypeError(f"{name}: at least one operand must be an Expr")
    ops = []
    for i, a in enumerate(args):
        if name == "where" and i == 0:
            ops.append(a if isinstance(a, Expr) else Expr.const(a, "bool"))
        else:
            ops.append(a.cast(ref.dtype) if isinstance(a, Expr) else Expr.const(a, ref.dtype))
    dtype = "bool" if result == "bool" else ref.dtype
    if takes == "float" and ref.dtype not in FLOATS:
        raise TypeError(f"{name} needs a floating operand, got {ref.dtype}")
    if takes == "int" and ref.dtype in FLOATS:
        raise TypeError(f"{name} needs an integer or bool operand, got {ref.dtype}")
    return Expr(name, tuple(ops), dtype)


def where(c: Expr, a, b) -> Expr:
    return prim("where", c, a, b)


def eq(a: Expr, b) -> Expr:
    return prim("eq", a, b)


def ne(a: Expr, b) -> Expr:
    return prim("ne", a, b)


def isnan(a: Expr) -> Expr:
    return prim("isnan", a) if a.dtype in FLOATS else Expr.const(False, "bool")


# ---- programs -------------------------------------------------------------------------

@dataclass(frozen=True)
class ReductionKind:
    """A fold as data: `lift(x, ridx)` makes one element's state, `merge(a, b)` combines two
    states (a holds the elements before b's: merge must be associative, not commutative),
    `identity` is the state of no elements; states are tuples of Exprs whose dtypes are
    `state(x.dtype)`; the epilogue sees the folded state as Expr.var("s<i>")."""

    name: str
    state: Callable[[str], tuple[str, ...]]
    identity: Callable[[str], tuple]
    lift: Callable[[Expr, Expr], tuple]
    merge: Callable[[tuple, tuple], tuple]
    # The same state as a sequence of simpler folds, for elements a thread holds (staged): phase
    # i folds lift_i(x, states of phases < i) with its own kind into state component i. The
    # online logsumexp's merge is a chain of dependent exps per element; max, then the sum of
    # exp(x - max), keeps only an add on the chain.
    phases: tuple = ()  # of (ReductionKind, Callable[[Expr, tuple[Expr, ...]], Expr])
    # The state of a few consecutive elements at once, all present (a vector a thread loaded),
    # where that is cheaper than lifting and merging each: Welford's count, mean and squared
    # deviations of the chunk, one division per merge of the chunk rather than one per element.
    chunk: "Callable[[tuple[Expr, ...]], tuple] | None" = None

    def merge_exprs(self, dtype: str) -> tuple[tuple[Expr, ...], tuple[Expr, ...], tuple[Expr, ...]]:
        """merge over variables: (a vars, b vars, merged state)."""
        st = self.state(dtype)
        a = tuple(Expr.var(f"a{i}", d) for i, d in enumerate(st))
        b = tuple(Expr.var(f"b{i}", d) for i, d in enumerate(st))
        return a, b, tuple(m.cast(d) for m, d in zip(self.merge(a, b), st))

    def lift_exprs(self, x: "Expr | tuple[Expr, ...]", ridx: "Expr | None" = None) -> tuple[Expr, ...]:
        """One element's state from the prologue value x, a tuple of values for sibling folds
        (`siblings`), at reduced index `ridx` (default: var "ridx")."""
        first = x[0] if isinstance(x, tuple) else x
        ridx = Expr.var("ridx", "int64") if ridx is None else ridx
        return tuple(e if isinstance(e, Expr) else Expr.const(e, d)
                     for e, d in zip(self.lift(x, ridx), self.state(first.dtype)))

    def chunk_exprs(self, xs: tuple[Expr, ...]) -> tuple[Expr, ...]:
        """The state of the elements xs (prologue values, in order), by `chunk`."""
        return tuple(e.cast(d) if isinstance(e, Expr) else Expr.const(e, d)
                     for e, d in zip(self.chunk(xs), self.state(xs[0].dtype)))

    def identity_exprs(self, dtype: str) -> tuple[Expr, ...]:
        return tuple(Expr.const(v, d) for v, d in zip(self.identity(dtype), self.state(dtype)))


def siblings(parts: list[tuple[ReductionKind, str]]) -> ReductionKind:
    """Folds of several operands over the same elements as one kind: its state is theirs side by
    side, its lift takes one value per operand (a tuple, in order), its merge merges each part
    (two norms of a triplet loss, a sum and a sum of squares). `state`, `identity` and `merge_exprs`
    ignore the dtype they are given: each part keeps its operand's."""
    sizes = [len(k.state(d)) for k, d in parts]
    cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    def each(t: tuple) -> list[tuple]:
        return [tuple(t[cuts[i]:cuts[i + 1]]) for i in range(len(parts))]

    return ReductionKind(
        "+".join(k.name for k, _ in parts),
        lambda _: tuple(t for k, d in parts for t in k.state(d)),
        lambda _: tuple(v for k, d in parts for v in k.identity(d)),
        lambda xs, ridx: tuple(e for (k, _), x in zip(parts, xs) for e in k.lift(x, ridx)),
        lambda a, b: tuple(m for (k, _), pa, pb in zip(parts, each(a), each(b)) for m in k.merge(pa, pb)))


@dataclass
class Reduction:
    kind: ReductionKind
    operand: Expr  # the prologue: evaluated at every point of the domain
    dims: tuple[int, ...]  # reduced dims of the domain
    # further operands folded beside `operand` over the same elements: `kind` is then
    # siblings(...) of one kind per operand, and its lift takes (operand, *siblings)
    siblings: tuple[Expr, ...] = ()

    @property
    def operands(self) -> tuple[Expr, ...]:
        return (self.operand, *self.siblings)

    def loads(self) -> list[int]:
        """The inputs the prologue reads, in order."""
        return sorted({e.value[0] for o in self.operands for e in o.walk() if e.op == "load"})

    def lifted(self, names: str = "x") -> tuple[tuple[Expr, ...], tuple[Expr, ...]]:
        """(the operand variables x (x0, x1, ... for siblings), one element's state from them)."""
        if not self.siblings:
            x = Expr.var(names, self.operand.dtype)
            return (x,), self.kind.lift_exprs(x)
        xs = tuple(Expr.var(f"{names}{i}", o.dtype) for i, o in enumerate(self.operands))
        return xs, self.kind.lift_exprs(xs)


@dataclass
class Scan:
    """A running fold along one dim of the domain: the output at each point sees the state of
    the elements up to it (`exclusive`: before it; `reverse`: from the far end)."""

    kind: ReductionKind
    operand: Expr  # the prologue, at every point of the domain
    dim: int
    reverse: bool = False
    exclusive: bool = False


@dataclass
class Window:
    """A fold over a window of the last len(kernel) dims of `frame` (the pooled tensor's shape)
    per output point (pooling, 2-D or 3-D): output (.., o1, o2[, o3]) folds the pooled tensor
    at (.., o*stride - pad + k*dilation, ...) for k inside `kernel`, skipping points in the
    padding. `operand` is the pooled tensor's value at a frame point: a load of an input, or a
    pointwise prologue over loads (batch norm -> relu before a max pool), every loaded input's
    in_strides over the frame; the epilogue may read inputs too, at each output point, their
    in_strides over the domain. The element's index in its plane or volume (row-major over the
    pooled dims: ih * W + iw, or (id * H + ih) * W + iw) is var "ridx"; the epilogue sees the
    state (s0, ...) and the divisor eager's avg_pool uses (var "count", int64)."""

    kind: ReductionKind
    operand: Expr
    frame: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    count_include_pad: bool = True
    divisor_override: int | None = None


@dataclass
class Program:
    domain: tuple[int, ...]
    inputs: list  # TensorMeta per launch-plan input
    outputs: list  # TensorMeta per output
    in_strides: dict[int, tuple[int, ...]]  # input index -> strides over the domain (only inputs read)
    out_strides: list[tuple[int, ...]]  # per output: strides over the domain (0 over reduced dims)
    results: list[Expr]  # per output: its value
    reduction: Reduction | None = None
    aliases: dict[int, int] = field(default_factory=dict)  # output -> input it overwrites
    scan: Scan | None = None  # outputs over the whole domain see the running state as var "s0"...
    window: Window | None = None  # the domain is the output shape; in_strides are over window.frame
    # per input: the launch-plan input whose memory it reads (a region's view of an input is
    # an input of its own, with the view's shape and strides); None: every input is its own
    sources: list[int] | None = None
    # A pointwise region whose outputs have different shapes (rotary embeddings: q, k and the
    # cos and sin they return) is one program per shape, each a kernel of one launch plan: the
    # first is this program, the rest its `parts`; `out_index[j]` is the card output that
    # output j is (None: output j is the card's output j). A cat cut into slabs (concat.py)
    # is one part per slab, each writing its slab of the card outputs: `out_offsets[j]` is
    # where output j starts, in elements past the card output's pointer (None: at it), and
    # the first program's `card_outputs` are the card's output TensorMetas the slabs make up.
    out_index: list[int] | None = None
    # input i -> (index input j, stride, rows): input i is read at its strides over the domain
    # plus the value of input j there times `stride` (an embedding's row: codegen/gather.py)
    gathers: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    parts: list["Program"] = field(default_factory=list)
    out_offsets: list[int] | None = None
    card_outputs: list | None = None

    def card_output(self, j: int) -> int:
        """The card output (launch-plan {"out": n}) that output j is."""
        return j if self.out_index is None else self.out_index[j]

    def out_offset(self, j: int) -> int:
        """Elements past the card output's pointer where output j starts (a slab of it)."""
        return 0 if self.out_offsets is None else self.out_offsets[j]

    def source(self, i: int) -> int:
        """The launch-plan input ({"in": n}) that program input i reads."""
        return i if self.sources is None else self.sources[i]

    def offset(self, i: int) -> int:
        """Elements past the launch-plan input's pointer where program input i starts (a view at
        an offset: a slice, one tensor of an unbind or a split)."""
        return self.inputs[i].storage_offset - self.inputs[self.source(i)].storage_offset

    @property
    def reduce_dims(self) -> tuple[int, ...]:
        return self.reduction.dims if self.reduction else ()

    @property
    def normalizes(self) -> bool:
        """A normalization: an output varies over the reduced dims, so the epilogue runs at
        every point of the domain (softmax, layer/group norm), not once per kept point."""
        return any(st[d] for st in self.out_strides for d in self.reduce_dims)



def broadcast_strides(shape: tuple[int, ...], stride: tuple[int, ...], domain: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides of a tensor of `shape` broadcast to `domain` (right-aligned; leading size-1 dims
    beyond the domain's are dropped), or None."""
    lead = len(domain) - len(shape)
    if lead < 0:
        if any(n != 1 for n in shape[:-lead]):
            return None
        shape, stride, lead = shape[-lead:], stride[-lead:], 0
    out = []
    for d, size in enumerate(domain):
        k = d - lead
        if k < 0 or shape[k] == 1:
            out.append(0)
        elif shape[k] != size:
            return None
        else:
            out.append(stride[k])
    return tuple(out)


# ---- what the builder takes (build.from_nodes) ------------------------------------------

@dataclass(frozen=True)
class Ref:
    """A tensor argument of a node: ("in", i) is inputs[i], ("node", j, k) output k of node j."""

    kind: str
    index: int
    output: int = 0


@dataclass
class Node:
    op: str  # "aten::name.overload"
    args: dict  # schema argument name -> Ref, a list of Refs, or a plain value
    metas: list  # TensorMeta per output


def _exact_in(e: Expr, dtype: str) -> bool:
    """Whether value `e` is exactly representable in half type `dtype` by construction: a load
    of a `dtype` tensor, a rounding to it, a constant it holds, or a choice among such values
    (max, min, where's branches, neg, abs: relu after a rounded batch norm)."""
    if e.op == "load":
        return e.value[1] == dtype
    if e.op == "cast":
        return e.value == ("round", dtype)
    if e.op == "const":
        return e.dtype in FLOATS and _holds(dtype, float(e.value))
    if e.op in ("max", "min", "neg", "abs"):
        return all(_exact_in(a, dtype) for a in e.args)
    if e.op == "where":
        return _exact_in(e.args[1], dtype) and _exact_in(e.args[2], dtype)
    return False


def _holds(dtype: str, v: float) -> bool:
    """Whether half type `dtype` holds the number v exactly (NaN and the infinities included)."""
    if v != v:
        return True
    try:
        if dtype == "float16":
            return struct.unpack("e", struct.pack("e", v))[0] == v
        f32 = struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return False
    return f32 == v and struct.unpack("I", struct.pack("f", f32))[0] & 0xFFFF == 0
