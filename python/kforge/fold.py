"""Values a traced graph computes from none of its inputs, computed once.

A decoder layer builds its causal mask (full, then triu) and its rotary positions (arange)
from constants on every forward: kernels and dispatcher calls whose result never changes,
since the graph's guards fix every shape and constant argument. `fold(graph)` replaces each
such value that something else reads by one call of a `Folded` holder, which computes it on
its first call (the subgraph that makes it, on the device the graph names) and returns the
same tensor from then on.

What is folded: nodes that read no graph input, only constants and other folded nodes, whose
op draws no random numbers, writes none of its arguments and is not an allocation whose
contents are undefined (empty); each folded value is a single tensor of at most
MAX_BYTES, not a graph output (the caller could write it) and not written by its readers.
The holder keeps the tensor alive as long as the graph: a mask of 2048 x 2048 fp32 is 16 MB.

Values computed from the model's weights alone (`weights`: the graph inputs dynamo marks static,
its parameters and buffers) are folded too, where they do work: NFNet's and BiT's weight
standardization before every convolution, a weight norm, Swin's relative position bias picked
from its table. Their holder takes the weights as arguments and computes the value again when one
of them is another tensor, has been written since (`_version`: load_state_dict, an optimizer
step) or holds other memory (`param.data = ...`, which keeps the version); where a weight's
version says nothing (an inference-mode tensor, one autograd records), it is computed on every
call.
These values take at most WEIGHT_BYTES a graph in all, and a value that is only a view of a
weight (a linear's transpose) is left as it is.

A kept value of weights is recomputed into its own memory, never a new tensor: a CUDA graph
(kforge.replay) reads it at its address. Before each replay, `refresh()` of every holder the
graph called at capture (`recording()`) recomputes the values whose weights were written since.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Iterable

import torch
import torch.fx as fx

from .families import family_of

MAX_BYTES = 64 << 20
WEIGHT_BYTES = 256 << 20  # weight-derived values kept, per graph
_UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "empty_permuted"})


class Folded:
    """A constant value of a graph: its subgraph, run on the first call, the result kept; for a
    value of weights (its arguments), run again when a weight is another tensor or was written."""

    reads_only = True

    def __init__(self, make: fx.GraphModule, name: str):
        self.make, self.value = make, None
        self._memo: tuple | None = None  # weight_key of each weight
        self.__name__ = f"kforge_folded_{name}"

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        if _recording is not None:
            _recording.append(self)
        memo = self._memo
        if self.value is not None and (not weights or (memo is not None and all(map(unchanged, memo, weights)))):
            return self.value
        value = self.make(*weights)
        if self._memo is not None and _same_layout(self.value, value):
            self.value.copy_(value)  # where a CUDA graph reads it
        else:
            self.value = value
        self._memo = tuple(map(weight_key, weights)) if weights and all(map(memoizable, weights)) else None
        return self.value

    def weights(self) -> list[torch.Tensor]:
        """The weights the kept value was made from (none where it is not memoized)."""
        return [t for k in self._memo or () if (t := k[0]()) is not None]

    def refresh(self) -> bool:
        """Before a CUDA graph replay that reads the kept value: recompute it in place if a weight
        was written since. False where a weight is gone or holds other memory (the graph then runs
        op by op). A value never memoized is a constant, or recomputed by the graph itself."""
        if self._memo is None:
            return True
        weights = live(self._memo)
        if weights is None:
            return False  # another weight's memory: the replay's own address check runs the graph op by op
        self(*weights)  # a hit, or the value made again into its own memory
        return True


_recording: list | None = None  # holders called while a CUDA graph's forward is recorded


class recording:
    """`with recording() as held:` lists every kept-value holder (Folded, layout.ConvertedOnce)
    the block calls, for a CUDA graph to refresh before each replay."""

    def __enter__(self) -> list:
        global _recording
        self._outer, _recording = _recording, []
        return _recording

    def __exit__(self, *exc: Any) -> None:
        global _recording
        _recording = self._outer


def _same_layout(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (a is not None and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)


def weight_key(t: torch.Tensor) -> tuple:
    """What says a weight is still the one a kept value was made from: the tensor (a weak ref),
    its version (written in place since?) and its memory (`param.data = ...` keeps the version)."""
    return weakref.ref(t), t._version, t.data_ptr()


def live(keys: Iterable[tuple]) -> list[torch.Tensor] | None:
    """The weights `keys` (weight_key) were taken of, where each is alive in the same memory; else None."""
    ts = [(k[0](), k) for k in keys]
    return None if any(t is None or t.data_ptr() != k[2] for t, k in ts) else [t for t, _ in ts]


def unchanged(key: tuple, t: torch.Tensor) -> bool:
    """Whether `t` is the weight `key` (weight_key) was taken of, unchanged."""
    return key[0]() is t and key[1] == t._version and key[2] == t.data_ptr()


def memoizable(t: torch.Tensor) -> bool:
    """A real tensor whose version counter says when it changes, read outside autograd."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (not isinstance(t, FakeTensor) and t.device.type != "meta" and not t.is_inference()
            and not (t.requires_grad and torch.is_grad_enabled()))


def _foldable_op(n: fx.Node) -> bool:
    op = n.target
    if n.op == "call_function" and (op is operator.getitem or getattr(op, "kforge_pure", False)):
        return True  # one output of a folded node; a function of its arguments alone (layout.channels_last)
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in op.tags or op._schema.name.split("::")[-1] in _UNDEFINED:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _static_tensor(v: Any) -> bool:
    """A tensor of concrete shape and strides, or a tuple of them (a batch norm's three outputs)."""
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_static_tensor(t) for t in v)
    return isinstance(v, torch.Tensor) and all(isinstance(x, int) for x in (*v.shape, *v.stride()))


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` may write `node`'s value (an argument its schema marks written)."""
    op = user.target
    if not isinstance(op, torch._ops.OpOverload):  # an opaque call may, unless it says it only reads
        return user.op == "call_function" and not getattr(op, "reads_only", False)
    schema = op._schema.arguments
    for k, a in enumerate(user.args):
        if a is node and k < len(schema) and schema[k].alias_info is not None and schema[k].alias_info.is_write:
            return True
    return any(v is node and next((s.alias_info is not None and s.alias_info.is_write for s in schema if s.name == key),
                                  False) for key, v in user.kwargs.items())


def fold(graph: fx.Graph, weights: Iterable[int] = ()) -> int:
    """Replace the graph's input-free values, and its values of the placeholders numbered in
    `weights` alone, by Folded calls; returns how many."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    static = {places[i] for i in weights if 0 <= i < len(places)}
    const: set[fx.Node] = set()
    for n in graph.nodes:
        if not _foldable_op(n) or not _static_tensor(n.meta.get("val")):
            continue
        deps: list[fx.Node] = []
        fx.node.map_arg((n.args, n.kwargs), deps.append)
        if all(d in const or d in static for d in deps):
            const.add(n)
    done, kept = 0, 0
    for n in [n for n in graph.nodes if n in const]:
        readers = [u for u in n.users if u not in const]
        if not readers:
            continue
        val = n.meta["val"]
        if not isinstance(val, torch.Tensor):
            continue  # (several outputs: their getitems are folded, each its own value)
        size = val.numel() * val.element_size()
        if any(u.op == "output" or _writes(u, n) for u in readers) or size > MAX_BYTES:
            continue
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        above = _ancestors(n)
        ancestors = [m for m in graph.nodes if (m in const or m in static) and (m is n or m in above)]
        sources = [m for m in ancestors if m in static]
        if sources and (all(m.target is operator.getitem or family_of(m.target) == "view" for m in ancestors if m in const)
                        or kept + size > WEIGHT_BYTES):
            continue  # a view of weights, left as it is; or past the budget
        for m in ancestors:  # in graph order
            env[m] = sub.placeholder(m.name) if m in static else sub.node_copy(m, lambda a: env[a])
        sub.output(env[n])
        with graph.inserting_before(_first(graph, readers)):
            new = graph.call_function(Folded(fx.GraphModule(torch.nn.Module(), sub), n.name), tuple(sources))
        new.meta["val"] = val
        for u in readers:
            u.replace_input_with(n, new)
        done += 1
        kept += size if sources else 0
    for n in reversed(list(graph.nodes)):
        if n in const and not n.users:
            graph.erase_node(n)
    return done


def _ancestors(n: fx.Node) -> set[fx.Node]:
    """Every node n depends on (one walk, where asking node by node walked once per node)."""
    todo, seen = [n], set()
    while todo:
        for d in todo.pop().all_input_nodes:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def _first(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node | None:
    """The earliest of `nodes` in graph order."""
    want = set(nodes)
    return next((x for x in graph.nodes if x in want), None)
