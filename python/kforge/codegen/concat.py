"""Concatenation in generated kernels: pointwise work that reads aten::cat values, as one
program per slab of the output along the concatenated dim.

A cat's output is, slab by slab, one of its pieces: cutting the output along the cat dim at
every piece boundary (of every cat, when several concatenate along the same dim), each slab
reads exactly one piece of each cat, so the slab's program has no cat in it. A slab of a
value is that value's nodes over the slab, their inputs narrowed to it (a narrowed input is a
view at an offset, read in place); a cat in a slab is the piece the slab falls in, narrowed.
The slabs' programs are the parts of one launch plan (ir.Program.parts), each writing its
slab of the outputs at an offset (ir.Program.out_offsets). Rotary embeddings are the case
that matters: rotate_half is cat(-x2, x1), and the angles are cat(freqs, freqs).

The concatenated dim is counted from the right (pointwise values broadcast right-aligned),
and every value between a cat and the outputs keeps it there: what moves it (a permute of
it, a view that regroups it) is declined, as are cats beside a reduction. An inference batch
norm is an affine map per channel: in a slab of its channels it reads that slab of its
per-channel vectors (DenseNet's cat of features into each layer's batch norm). Cats along another
dim are cut in the slabs, each slab of them again (a rotary embedding along the last dim
feeding a key cache's cat along the sequence). A 1-D empty piece is skipped, as torch.cat
skips it (transformers' caches start as `torch.tensor([])`); a cat of one piece is that piece.
"""

from __future__ import annotations

from dataclasses import replace

from ..cards import TensorMeta, pointer_alignment
from ..families import family_of, packet_name
from .ir import Node, Ref
from .reductions import NORM_OPS, PER_CHANNEL
from .views import Decline, contiguous

# The slabs are one launch, each a device function over its own range of blocks with its own
# pointer parameters: 64 slabs of about six tensors (a piece, a batch norm's four vectors, the
# output) are 3 KB of the 4 KB of parameters every toolkit takes. DenseNet-201's deepest cat has 49 pieces.
MAX_SLABS = 64
ROLL = "aten::roll.default"


def is_cat(op: str) -> bool:
    return op.removeprefix("aten::").partition(".")[0] == "cat"


def roll_nodes(node: Node, inputs: list[TensorMeta], out: TensorMeta) -> tuple[list[Node], list[TensorMeta], list[int], Ref] | str:
    """torch.roll as cats of its input's slices: along a dim rolled by s (mod its size n), the
    output is the input's last s elements, then its first n - s; a roll along several dims is a
    cat of such cats, each piece an input narrowed along every rolled dim, so one launch copies
    each of the 2^k blocks once (eager rolls one dim at a time: a pass over the tensor each;
    Swin's shifted windows roll two). (nodes, program inputs, their launch-plan inputs, the
    output's ref), or why not."""
    src, shifts, dims = node.args.get("self"), list(node.args.get("shifts") or []), list(node.args.get("dims") or [])
    if not isinstance(src, Ref) or src.kind != "in":
        return "a roll of a value the card does not read"
    x = inputs[src.index]
    if not dims or len(dims) != len(shifts) or not x.shape:
        return "a roll of the flattened tensor (no dims): not generated"
    nd = len(x.shape)
    dims = [d % nd for d in dims]
    if len(set(dims)) != len(dims):
        return "a roll along one dim twice: not generated"
    if 0 in x.shape or x.dtype != out.dtype or tuple(out.shape) != tuple(x.shape):
        return "a roll of no elements, or into another dtype or shape"
    rolled = [(d, s % x.shape[d]) for d, s in zip(dims, shifts) if s % x.shape[d]]
    nodes: list[Node] = []
    ins, sources = list(inputs), list(range(len(inputs)))

    def piece(m: TensorMeta, k: int) -> Ref:
        if k == len(rolled):
            ins.append(m)
            sources.append(src.index)
            return Ref("in", len(ins) - 1)
        d, s = rolled[k]
        n, r = m.shape[d], d - nd
        parts = [piece(_narrow(m, r, n - s, n), k + 1), piece(_narrow(m, r, 0, n - s), k + 1)]
        made = out if not k else replace(out, shape=m.shape, stride=contiguous(m.shape), storage_offset=0)
        nodes.append(Node("aten::cat.default", {"tensors": parts, "dim": d}, [made]))
        return Ref("node", len(nodes) - 1, 0)

    if not rolled:  # whole turns: a copy
        nodes.append(Node("aten::clone.default", {"self": src, "memory_format": None}, [out]))
        return nodes, ins, sources, Ref("node", 0, 0)
    return nodes, ins, sources, piece(x, 0)


def slabs(nodes: list[Node], inputs: list[TensorMeta], outputs: list[Ref], out_metas: list[TensorMeta],
          aliases: dict[int, int], sources: list[int]) -> list[tuple] | str:
    """Per slab: (nodes, inputs, sources, outputs, out_metas, out_index, out_offsets), the builder's
    arguments for that slab of the outputs, or why the cats cannot be cut into slabs."""
    if aliases:
        return "a cat in a region that writes its inputs: not generated"
    try:
        return _Slabs(nodes, inputs, sources).cut(outputs, out_metas)
    except Decline as d:
        return str(d)


def _legacy_empty(m: TensorMeta) -> bool:
    """A 1-D piece of no elements, which torch.cat skips whatever the other pieces' shapes."""
    return len(m.shape) == 1 and m.shape[0] == 0


def _size(m: TensorMeta, r: int) -> int:
    """Size along the dim r from the right (1 where the tensor has no such dim: it broadcasts)."""
    return m.shape[len(m.shape) + r] if len(m.shape) + r >= 0 else 1


def _narrow(m: TensorMeta, r: int, lo: int, hi: int) -> TensorMeta:
    d = len(m.shape) + r
    shape = m.shape[:d] + (hi - lo,) + m.shape[d + 1:]
    moved = lo * m.stride[d]
    align = m.align if not moved else min(m.align, pointer_alignment(moved * m.itemsize))
    return replace(m, shape=shape, storage_offset=m.storage_offset + moved, align=align)


class _Slabs:
    def __init__(self, nodes: list[Node], inputs: list[TensorMeta], sources: list[int]):
        self.nodes, self.inputs, self.sources = nodes, inputs, sources
        cats = [n for n in nodes if is_cat(n.op)]
        for n in cats:
            if not n.metas[0].shape:
                raise Decline("a cat of 0-dim tensors")
            if 0 in n.metas[0].shape:
                raise Decline("a cat of no elements: nothing to generate")
            if not all(isinstance(ref, Ref) for ref in n.args["tensors"]):
                raise Decline("a cat of a tensor the region does not compute or read")
            if any(self._meta(ref).dtype != n.metas[0].dtype for ref in n.args["tensors"]):
                raise Decline("a cat that promotes its pieces' dtypes (an empty piece's too): not generated")
        # the slabs cut the dim of the first cat of two or more pieces; cats along other dims
        # (and cats of one piece) stay in the slabs, to be cut there
        cut = [n for n in cats if len(self._pieces(n)) > 1] or cats
        self.r = self._dim(cut[0])
        cats = [n for n in cut if self._dim(n) == self.r]
        sizes = {_size(n.metas[0], self.r) for n in cats}
        if len(sizes) != 1:
            raise Decline("cats of different sizes along their dim: one size is cut into slabs")
        self.n = sizes.pop()
        cuts = {0, self.n}
        for n in cats:
            start = 0
            for ref in self._pieces(n):
                start += self._value_size(ref)
                cuts.add(start)
            if start != self.n:
                raise Decline("a cat whose pieces do not add up to its size")
        self.cuts = sorted(cuts)
        if len(self.cuts) - 1 > MAX_SLABS:
            raise Decline(f"a cat cut into {len(self.cuts) - 1} slabs: at most {MAX_SLABS} are generated")
        for n in nodes:
            if family_of(n.op) not in ("pointwise", "view") and not is_cat(n.op) and packet_name(n.op) not in PER_CHANNEL:
                raise Decline(f"a cat beside {packet_name(n.op)}: cats are generated in pointwise work and inference "
                              "batch norm only")

    def _dim(self, n: Node) -> int:
        """A cat's dim, counted from the right."""
        nd = len(n.metas[0].shape)
        return n.args["dim"] % nd - nd

    def _pieces(self, n: Node) -> list[Ref]:
        """A cat's pieces, 1-D empty ones skipped (as torch.cat skips them)."""
        return [p for p in n.args["tensors"] if not _legacy_empty(self._meta(p))]

    def _meta(self, ref: Ref) -> TensorMeta:
        return self.inputs[ref.index] if ref.kind == "in" else self.nodes[ref.index].metas[ref.output]

    def _value_size(self, ref: Ref) -> int:
        return _size(self._meta(ref), self.r)

    def cut(self, outputs: list[Ref], out_metas: list[TensorMeta]) -> list[tuple]:
        for m in out_metas:
            if _size(m, self.r) not in (1, self.n):
                raise Decline(f"an output of shape {m.shape} does not span the cat's dim")
        out = []
        for k, (lo, hi) in enumerate(zip(self.cuts, self.cuts[1:])):
            self.new_nodes: list[Node] = []
            self.new_inputs, self.new_sources = list(self.inputs), list(self.sources)
            self.memo: dict[tuple, Ref] = {}
            refs, metas, index, offsets = [], [], [], []
            for j, (ref, m) in enumerate(zip(outputs, out_metas)):
                whole = _size(m, self.r) == 1  # does not vary along the dim: the first slab writes it
                if whole and k:
                    continue
                refs.append(self.ref(ref, 0, 1) if whole else self.ref(ref, lo, hi))
                nm = m if whole else _narrow(m, self.r, lo, hi)
                metas.append(nm)
                index.append(j)
                offsets.append(nm.storage_offset - m.storage_offset)
            out.append((self.new_nodes, self.new_inputs, self.new_sources, refs, metas, index, offsets))
        return out

    def ref(self, ref: Ref, lo: int, hi: int) -> Ref:
        """`ref`'s value over [lo, hi) of its extent along the dim, as a ref among the slab's nodes."""
        size = self._value_size(ref)
        if size == 1:
            lo, hi = 0, 1  # broadcast along the dim: the whole value
        if not 0 <= lo < hi <= size:
            raise Decline("a value read across a cat's piece boundary")
        key = (ref, lo, hi)
        if key in self.memo:
            return self.memo[key]
        if ref.kind == "in":
            if (lo, hi) == (0, size):
                made = ref
            else:
                self.new_inputs.append(_narrow(self.inputs[ref.index], self.r, lo, hi))
                self.new_sources.append(self.sources[ref.index])
                made = Ref("in", len(self.new_inputs) - 1)
        else:
            made = self._node(ref, lo, hi)
        self.memo[key] = made
        return made

    def _node(self, ref: Ref, lo: int, hi: int) -> Ref:
        n = self.nodes[ref.index]
        pieces = self._pieces(n) if is_cat(n.op) else []
        if len(pieces) == 1:  # a cat of one piece is that piece
            return self.ref(pieces[0], lo, hi)
        if pieces and self._dim(n) != self.r:  # cut in the slab: its pieces over [lo, hi)
            args = {**n.args, "tensors": [self.ref(p, lo, hi) for p in pieces]}
            metas = [_narrow(m, self.r, lo, hi) for m in n.metas] if (lo, hi) != (0, self._value_size(ref)) else n.metas
            self.new_nodes.append(Node(n.op, args, list(metas)))
            return Ref("node", len(self.new_nodes) - 1, ref.output)
        if pieces:
            start = 0
            for piece in pieces:
                size = self._value_size(piece)
                if start <= lo and hi <= start + size:
                    return self.ref(piece, lo - start, hi - start)
                start += size
            raise Decline("a value read across a cat's piece boundary")
        full = (lo, hi) == (0, self._value_size(ref))
        channel = NORM_OPS[packet_name(n.op)][0] if packet_name(n.op) in PER_CHANNEL else ()
        args = {}
        for name, v in n.args.items():
            if isinstance(v, Ref) and name in channel:  # a per-channel vector: over the slab's channels
                args[name] = self._channel(n, v, lo, hi) if not full else v
            elif isinstance(v, Ref):
                if full:  # the whole value: its operands whole too
                    args[name] = self.ref(v, 0, self._value_size(v))
                else:
                    args[name] = self.ref(v, lo, hi) if self._value_size(v) == 1 else self._arg(n, v, lo, hi)
            elif isinstance(v, list) and any(isinstance(x, Ref) for x in v):
                raise Decline(f"{packet_name(n.op)}: tensor-list arguments are not generated")
            else:
                args[name] = v
        metas = list(n.metas)
        if not full:
            if family_of(n.op) == "view":
                args = self._view_args(n, args, hi - lo)
            metas = [_narrow(m, self.r, lo, hi) if _size(m, self.r) == _size(n.metas[0], self.r) else m
                     for m in metas]
        self.new_nodes.append(Node(n.op, args, metas))
        return Ref("node", len(self.new_nodes) - 1, ref.output)

    def _channel(self, n: Node, v: Ref, lo: int, hi: int) -> Ref:
        """A per-channel vector (C,) of a node over a slab: [lo, hi) of it where the slabs cut
        the node's channels (dim 1 of its input, a DenseNet's cat of features into its batch
        norm), else the whole vector (it broadcasts over the dim cut)."""
        if len(self._meta(n.args["input"]).shape) + self.r != 1:
            return v
        if v.kind != "in":
            raise Decline(f"{packet_name(n.op)}: a computed per-channel vector cut into slabs is not generated")
        key = (v, lo, hi, "channel")
        if key not in self.memo:
            self.new_inputs.append(_narrow(self.inputs[v.index], -1, lo, hi))
            self.new_sources.append(self.sources[v.index])
            self.memo[key] = Ref("in", len(self.new_inputs) - 1)
        return self.memo[key]

    def _arg(self, n: Node, v: Ref, lo: int, hi: int) -> Ref:
        if self._value_size(v) != _size(n.metas[0], self.r):
            raise Decline(f"{packet_name(n.op)} changes the size along the cat's dim: not generated")
        return self.ref(v, lo, hi)

    def _view_args(self, n: Node, args: dict, width: int) -> dict:
        """A view's arguments over a slab: its input's trailing dims from the cat's on stay where
        they are, and the size argument names the slab's width."""
        src = n.args.get("self")
        m_in, m_out = self._meta(src), n.metas[0]
        r = self.r
        if len(m_in.shape) + r < 0 or m_in.shape[r:] != m_out.shape[r:]:
            raise Decline(f"{packet_name(n.op)} moves the cat's dim: not generated")
        name = packet_name(n.op)
        if name == "permute":
            nd = len(m_out.shape)
            if any(d % nd != p for p, d in enumerate(args["dims"]) if p >= nd + r):
                raise Decline("a permute of the cat's dim: not generated")
            return args
        for key in ("size", "shape"):
            if key in args:
                size = list(args[key])
                size[len(size) + r] = width
                return {**args, key: size}
        if name in ("unsqueeze", "squeeze", "alias", "_unsafe_view", "view_as", "expand_as"):
            return args
        raise Decline(f"{name} of a value cut into slabs: not generated")
