"""A region's subgraph as data: the aten calls a fused region card stands for.

A region card (cards.Card with `region` set) replaces several aten calls at once. Its
subgraph is plain JSON-able data, so it survives the run directory and the package, and
is what a code generator or a prompt is handed:

    Subgraph.nodes    one entry per aten call, in execution order:
                        op       qualified overload, "aten::_softmax.default"
                        args     positional arguments; kwargs keyword arguments
                        outputs  TensorMeta of every tensor the op returns (tuples flattened)
                        op_card  id of the op card this call is on its own (None: unknown)
    argument values   a region input     {"in": i}            (Card.inputs order)
                      a node's output    {"node": j, "out": k} (j earlier in `nodes`)
                      anything else      cards.encode_value's form (numbers, lists, dtypes)
    Subgraph.outputs  the refs the region returns, in Card.outputs order
    Subgraph.kind     "fused" (pointwise/reduction/normalization/pooling chain), "shared" (the
                      same with a reduction, writing out a value before it that is read after
                      the region too: a residual sum and its norm) or "epilogue" (one vendor
                      op, mm/addmm/conv, and the pointwise work after it)

`replay` runs the nodes through PyTorch, one eager aten call each: the region's reference
outputs and its eager latency come from it. `code` is the same as readable PyTorch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .cards import TensorMeta, decode_value
from .errors import CardError
from .families import _resolve, family_of, packet_name

KINDS = ("fused", "shared", "epilogue")


def is_ref(v: Any) -> bool:
    return isinstance(v, dict) and (set(v) == {"in"} or set(v) == {"node", "out"})


@dataclass(frozen=True)
class Node:
    op: str
    args: list
    kwargs: dict
    outputs: list[TensorMeta]
    op_card: str | None = None

    def overload(self) -> torch._ops.OpOverload:
        op = _resolve(self.op) if "::" in self.op else None
        if not isinstance(op, torch._ops.OpOverload):
            raise CardError(f"region op {self.op} does not exist in torch {torch.__version__}")
        return op

    def key(self) -> tuple:
        return (self.op, json.dumps([self.args, self.kwargs], sort_keys=True), tuple(m.key() for m in self.outputs))

    def to_json(self) -> dict:
        return {"op": self.op, "args": self.args, "kwargs": self.kwargs,
                "outputs": [m.to_json() for m in self.outputs], "op_card": self.op_card}

    @staticmethod
    def from_json(d: dict) -> "Node":
        return Node(d["op"], list(d["args"]), dict(d.get("kwargs", {})),
                    [TensorMeta.from_json(m) for m in d["outputs"]], d.get("op_card"))


@dataclass(frozen=True)
class Subgraph:
    nodes: list[Node]
    outputs: list[dict]
    kind: str = "fused"
    notes: list[str] = field(default_factory=list, compare=False)

    def key(self) -> tuple:
        """Structure and metadata: what makes two call sites the same region (one card)."""
        return (self.kind, tuple(n.key() for n in self.nodes), json.dumps(self.outputs, sort_keys=True))

    @property
    def ops(self) -> list[str]:
        """Short names of the ops that do work (views left out), in order."""
        return [packet_name(n.op) for n in self.nodes if family_of(n.op) != "view"]

    def roundings(self, ref: dict) -> int:
        """How many ops on the longest chain from the inputs to `ref` (an output ref) round
        their result to a half type (views left out): eager rounds each, so a fused kernel
        that rounds as eager does can still differ from it by about one ulp per rounding."""
        depth: dict[int, int] = {}

        def refs(v: Any) -> list[int]:
            if is_ref(v):
                return [v["node"]] if "node" in v else []
            if isinstance(v, (list, tuple)):
                return [j for x in v for j in refs(x)]
            return []

        for j, n in enumerate(self.nodes):
            before = max((depth[i] for i in refs(n.args) + refs(list(n.kwargs.values()))), default=0)
            rounds = family_of(n.op) != "view" and any(m.dtype in ("float16", "bfloat16") for m in n.outputs)
            depth[j] = before + int(rounds)
        return depth.get(ref["node"], 0) if is_ref(ref) and "node" in ref else 0

    def to_json(self) -> dict:
        return {"kind": self.kind, "nodes": [n.to_json() for n in self.nodes], "outputs": self.outputs}

    @staticmethod
    def from_json(d: dict) -> "Subgraph":
        sg = Subgraph([Node.from_json(n) for n in d["nodes"]], list(d["outputs"]), d.get("kind", "fused"))
        sg.check()
        return sg

    def check(self, n_inputs: int | None = None) -> None:
        """Raise CardError unless every ref names an input or an earlier node's output: a
        subgraph can come from an untrusted package."""
        if self.kind not in KINDS:
            raise CardError(f"region kind {self.kind!r} is not one of {KINDS}")

        def walk(v: Any, j: int) -> None:
            if is_ref(v):
                if "in" in v:
                    ok = type(v["in"]) is int and v["in"] >= 0 and (n_inputs is None or v["in"] < n_inputs)
                else:
                    src, k = v["node"], v["out"]
                    ok = type(src) is int and type(k) is int and 0 <= src < j and 0 <= k < len(self.nodes[src].outputs)
                if not ok:
                    raise CardError(f"region node {j} refers to {v}, which is not an input or an earlier output")
            elif isinstance(v, list):
                for x in v:
                    walk(x, j)
            elif isinstance(v, dict):
                decode_value(v)

        for j, n in enumerate(self.nodes):
            if not isinstance(n.op, str) or not isinstance(n.args, list) or not isinstance(n.kwargs, dict):
                raise CardError(f"region node {j} is malformed")
            walk(n.args, j)
            walk(list(n.kwargs.values()), j)
        if not self.outputs or not all(is_ref(r) and "node" in r for r in self.outputs):
            raise CardError("a region returns one or more node outputs")
        walk(self.outputs, len(self.nodes))

    # ---- running it ----------------------------------------------------------------------
    def replay(self, inputs: list[torch.Tensor], device: str | torch.device | None = None) -> list[torch.Tensor]:
        """The region's outputs, one eager aten call per node (what eager runs for it)."""
        dev = str(device) if device is not None else None
        values: list[list[torch.Tensor]] = []

        def resolve(v: Any) -> Any:
            if is_ref(v):
                return inputs[v["in"]] if "in" in v else values[v["node"]][v["out"]]
            if isinstance(v, list):
                return [resolve(x) for x in v]
            return decode_value(v, dev)

        for n in self.nodes:
            out = n.overload()(*resolve(n.args), **{k: resolve(x) for k, x in n.kwargs.items()})
            values.append(list(out) if isinstance(out, (tuple, list)) else [out])
        return [values[r["node"]][r["out"]] for r in self.outputs]

    def code(self, input_metas: list[TensorMeta], name: str = "region") -> str:
        """The region as a PyTorch function: one aten call per line, inputs annotated with
        their shapes, strides and dtypes (what an LLM proposer reads)."""
        def text(v: Any) -> str:
            if is_ref(v):
                if "in" in v:
                    return f"in{v['in']}"
                single = len(self.nodes[v["node"]].outputs) == 1
                return f"v{v['node']}" if single else f"v{v['node']}[{v['out']}]"
            if isinstance(v, list):
                return "[" + ", ".join(text(x) for x in v) + "]"
            x = decode_value(v)
            return f"torch.{str(x).removeprefix('torch.')}" if isinstance(x, (torch.dtype, torch.memory_format,
                                                                               torch.layout)) else repr(x)

        params = ", ".join(f"in{i}" for i in range(len(input_metas)))
        lines = ["import torch", "", "aten = torch.ops.aten", "", "", f"def {name}({params}):"]
        for i, m in enumerate(input_metas):
            lines.append(f"    # in{i}: {m.dtype}{list(m.shape)} stride {list(m.stride)}")
        for j, n in enumerate(self.nodes):
            args = [text(a) for a in n.args] + [f"{k}={text(v)}" for k, v in n.kwargs.items()]
            target = n.op.removeprefix("aten::")
            lines.append(f"    v{j} = aten.{target}({', '.join(args)})")
        outs = [text(r) for r in self.outputs]
        lines.append(f"    return {outs[0]}" if len(outs) == 1 else f"    return ({', '.join(outs)},)")
        return "\n".join(lines) + "\n"

    def retarget(self, device: str) -> "Subgraph":
        from dataclasses import replace

        return replace(self, nodes=[replace(n, outputs=[replace(m, device=device) for m in n.outputs])
                                    for n in self.nodes])
