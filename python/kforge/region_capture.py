"""Traced graphs -> region cards: one card per distinct region, with the evidence of an op card.

The model is traced once (kforge.graph), its regions found (kforge.regions), and each graph
run once more node by node on the real inputs of its first call, so that every region site
gets its real input metadata (pointer alignment and integer value ranges included), the ids
of the op cards its nodes are on their own, and, for the first site of each card, a sample:
its inputs and outputs. Structurally equal sites with the same metadata are one card with
many calls. A card's eager latency is its subgraph replayed (one eager aten call per node,
CUDA events and L2 flushed on the GPU); its share is of the per-op capture's runtime, so it
overlaps the shares of the op cards inside it (top_calls is 0: family shares leave it out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from . import graph as graph_mod
from .cards import REGION_NS, ArgSpec, Card, TensorMeta, pack, unpack
from .errors import CardError
from .families import family_of
from .regions import Site, find

_FIRST_LINE_LIMIT = 100
SITES = "regions.json"  # in the run directory: every region call site, for the packager


@dataclass
class RegionEntry:
    card: Card
    sample: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # CPU copies
    sites: list[dict] = field(default_factory=list)  # every call site: {"graph": i, "nodes": [node names]}


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p != graph_mod.ROOT]
    if len(parts) < len(paths) or not parts:
        return graph_mod.ROOT
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or graph_mod.ROOT


def _signature(card_inputs: list[TensorMeta], n_out: int) -> str:
    ins = ", ".join(f"Tensor in{i}" for i in range(len(card_inputs)))
    outs = ", ".join("Tensor" for _ in range(n_out))
    return f"region({ins}) -> ({outs})"


class _Recorder(fx.Interpreter):
    """Runs an aten graph as eager would, keeping what the region cards need: real values at
    site boundaries and the op card id of every member call."""

    def __init__(self, module: fx.GraphModule, keep: set[fx.Node], members: set[fx.Node], arch: str):
        super().__init__(module)
        self.keep, self.members, self.arch = keep, members, arch
        self.values: dict[fx.Node, Any] = {}
        self.op_cards: dict[fx.Node, str | None] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.keep:
            self.values[n] = out
        if n in self.members:
            self.op_cards[n] = self._op_card(n)
        return out

    def _op_card(self, n: fx.Node) -> str | None:
        from .capture import _arg_specs, _op_name

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        try:
            specs, _ = _arg_specs(n.target, tuple(args), kwargs)
        except CardError:
            return None
        return Card(op=_op_name(n.target), schema="", args=specs, outputs=[], arch=self.arch).id


def _real(values: dict[fx.Node, Any], value: tuple[fx.Node, int]) -> torch.Tensor:
    src, k = value
    v = values[src]
    return v[k] if isinstance(v, (tuple, list)) else v


def region_cards(trace: graph_mod.Trace, arch: str, device_name: str, *, max_sample_bytes: int) -> tuple[list[RegionEntry], list[str]]:
    """The region cards of a trace, deduplicated, in first-seen order, with notes."""
    from .capture import _bytes, _cpu_copy

    entries: dict[str, RegionEntry] = {}
    notes: list[str] = list(trace.notes)
    budget = [max_sample_bytes]
    for g in trace.graphs:
        sites = find(g.module)
        if not sites:
            continue
        if g.inputs is None:
            notes.append(f"graph {g.index} never ran: its {len(sites)} region(s) are not captured")
            continue
        keep = {v[0] for s in sites for v in (*s.inputs, *s.outputs)}
        members = {n for s in sites for n in s.nodes}
        rec = _Recorder(g.module, keep, members, arch)
        try:
            with torch.no_grad():
                rec.run(*g.inputs)
        except Exception as e:  # noqa: BLE001 (a graph that does not replay gives no region cards)
            notes.append(f"graph {g.index} did not replay node by node ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:_FIRST_LINE_LIMIT] if str(e) else ''}): its regions are not captured")
            continue
        for s in sites:
            _add_site(entries, s, g, rec, arch, device_name, budget, _cpu_copy, _bytes)
        g.inputs = None  # the real activations are no longer needed
    for e in entries.values():
        c = e.card
        c.samples = 1 if e.sample is not None else 0
        c.top_calls = 0
        c.notes.append(f"region of {len(c.region.ops)} ops ({', '.join(c.region.ops)}): its time is also in those "
                       f"ops' cards' shares")
        if e.sample is None:
            c.notes.append("no sample stored: the sample budget was spent (raise max_sample_bytes to keep one)")
    return list(entries.values()), notes


def _add_site(entries, s: Site, g: graph_mod.Graph, rec: _Recorder, arch: str, device_name: str, budget: list[int],
              cpu_copy, nbytes) -> None:
    ins = [_real(rec.values, v) for v in s.inputs]
    outs = [_real(rec.values, v) for v in s.outputs]
    nodes = [replace(node, op_card=rec.op_cards.get(fxn)) for node, fxn in zip(s.subgraph.nodes, s.nodes)]
    sub = replace(s.subgraph, nodes=nodes)  # (the op cards are not part of the id: Node.key leaves them out)
    args = [ArgSpec(f"in{i}", "tensor", tensor=TensorMeta.of(t)) for i, t in enumerate(ins)]
    card = Card(op=REGION_NS + "+".join(sub.ops), schema=_signature(ins, len(outs)), args=args,
                outputs=[TensorMeta.of(t) for t in outs], arch=arch, family="region", device_name=device_name,
                region=sub)
    entry = entries.get(card.id)
    if entry is None:
        entry = entries[card.id] = RegionEntry(card)
        size = nbytes(ins) + nbytes(outs)
        if size <= budget[0]:
            budget[0] -= size
            entry.sample = ([cpu_copy(t) for t in ins], [cpu_copy(t) for t in outs])
    card = entry.card
    card.calls += 1
    path = _common_path([graph_mod.module_path(n) for n in s.nodes if family_of(n.target) != "view"])
    if path not in card.module_paths:
        card.module_paths.append(path)
    entry.sites.append({"graph": g.index, "nodes": [n.name for n in s.nodes]})


def time_entries(entries: list[RegionEntry], device: torch.device, time_fn) -> None:
    """eager_us of each card: its subgraph replayed on its sample (fresh inputs without one)."""
    for e in entries:
        c = e.card
        try:
            if e.sample is not None:
                inputs = [unpack(pack(t), TensorMeta.of(t), device) for t in e.sample[0]]
            else:
                inputs = c.random_inputs(seed=0, device=device)
            c.eager_us = time_fn(lambda: c.call_eager(inputs, device), device)
        except Exception as err:  # noqa: BLE001 (reported on the card, like an op card that does not replay)
            c.notes.append(f"not timed: replay raised {type(err).__name__}: {err}")
            continue
        c.total_us = c.eager_us * c.calls
