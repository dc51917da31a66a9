"""Traced graphs -> region cards: one card per distinct region, with the evidence of an op card.

The model is traced once (kforge.graph), its regions found (kforge.regions), and each graph
run node by node on the real inputs of its first call: once for every region site's real
input metadata (pointer alignment and integer value ranges included) and the ids of the op
cards its nodes are on their own, then once more for CPU copies of the inputs and outputs
of each new card's first site, within the sample budget (no activation is held longer than
eager holds it). Structurally equal sites with the same metadata are one card with
many calls. A card's eager latency is its subgraph replayed (one eager aten call per node,
CUDA events and L2 flushed on the GPU); its share is of the per-op capture's runtime, so it
overlaps the shares of the op cards inside it (top_calls is 0: family shares leave it out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from . import graph as graph_mod
from .cards import REGION_NS, ArgSpec, Card, TensorMeta, pack, qualified_name, unpack
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
    """Runs an aten graph as eager would, keeping `keep(value)` of the values region sites read
    and return (their metadata on a first run, CPU copies of the sampled sites' on a second,
    so that no activation outlives its use) and the op card id of every member call."""

    def __init__(self, module: fx.GraphModule, values: set[tuple[fx.Node, int]], members: set[fx.Node], arch: str,
                 keep: Any):
        super().__init__(module)
        self.indices: dict[fx.Node, list[int]] = {}
        for src, k in values:
            self.indices.setdefault(src, []).append(k)
        self.members, self.arch, self.keep = members, arch, keep
        self.kept: dict[tuple[fx.Node, int], Any] = {}
        self.op_cards: dict[fx.Node, str | None] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for k in self.indices.get(n, ()):
            self.kept[(n, k)] = self.keep(out[k] if isinstance(out, (tuple, list)) else out)
        if n in self.members:
            self.op_cards[n] = self._op_card(n)
        return out

    def _op_card(self, n: fx.Node) -> str | None:
        from .callspec import arg_specs

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        try:
            specs, _ = arg_specs(n.target, tuple(args), kwargs)
        except Exception:  # noqa: BLE001 (any call: an id kforge cannot make is unknown, never a failed replay)
            return None
        return Card(op=qualified_name(n.target), schema="", args=specs, outputs=[], arch=self.arch).id


def _replay(g: graph_mod.Graph, values: set, members: set, arch: str, keep: Any, notes: list[str]) -> _Recorder | None:
    rec = _Recorder(g.module, values, members, arch, keep)
    try:
        with torch.no_grad():
            rec.run(*g.inputs)
    except Exception as e:  # noqa: BLE001 (a graph that does not replay gives no region cards)
        first = str(e).splitlines()[0][:_FIRST_LINE_LIMIT] if str(e) else ""
        notes.append(f"graph {g.index} did not replay node by node ({type(e).__name__}: {first}): "
                     "its regions are not captured")
        return None
    return rec


def alone_op_cards(run_dir: Path) -> set[str]:
    """The op cards the capture in `run_dir` found its traced graphs calling outside every region
    (cardtable.search_order); none where no regions were captured, or before the field."""
    try:
        alone = json.loads((Path(run_dir) / SITES).read_text()).get("alone", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {a for a in alone if isinstance(a, str)} if isinstance(alone, list) else set()


def region_cards(trace: graph_mod.Trace, arch: str, device_name: str, *,
                 max_sample_bytes: int) -> tuple[list[RegionEntry], list[str], set[str]]:
    """The region cards of a trace, deduplicated, in first-seen order, with notes, and the op
    card ids of the calls the trace's graphs make outside every region: what kforge.optimize
    runs as single-op cards (an op eager calls and the graphs do not, an internal bias add, is
    not among them)."""
    from .callspec import cpu_copy

    entries: dict[str, RegionEntry] = {}
    notes: list[str] = list(trace.notes)
    alone: set[str] = set()
    budget = max_sample_bytes
    for g in trace.graphs:
        sites = find(g.module)
        if not sites:
            continue
        if g.inputs is None:
            notes.append(f"graph {g.index} never ran: its {len(sites)} region(s) are not captured")
            continue
        values = {v for s in sites for v in (*s.inputs, *s.outputs)}
        calls = {n for n in g.module.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
        rec = _replay(g, values, calls, arch, TensorMeta.of, notes)
        if rec is None:
            continue
        inside = {n for s in sites for n in s.nodes}
        alone |= {rec.op_cards[n] for n in calls - inside if rec.op_cards.get(n)}
        sampled: list[tuple[RegionEntry, Site]] = []
        for s in sites:
            entry, first = _add_site(entries, s, g, rec, arch, device_name)
            size = sum(m.span() * m.itemsize for m in entry.card.inputs + entry.card.outputs)
            if first and size <= budget:
                budget -= size
                sampled.append((entry, s))
        if sampled:
            wanted = {v for _, s in sampled for v in (*s.inputs, *s.outputs)}
            copies = _replay(g, wanted, set(), arch, cpu_copy, notes)
            for entry, s in sampled if copies is not None else ():
                entry.sample = ([copies.kept[v] for v in s.inputs], [copies.kept[v] for v in s.outputs])
        g.inputs = None  # the real activations are no longer needed
    for e in entries.values():
        c = e.card
        c.samples = 1 if e.sample is not None else 0
        c.top_calls = 0
        c.notes.append(f"region of {len(c.region.ops)} ops ({', '.join(c.region.ops)}): its time is also in those "
                       f"ops' cards' shares")
        if e.sample is None:
            c.notes.append("no sample stored: the sample budget was spent (raise max_sample_bytes to keep one)")
    return list(entries.values()), notes, alone


def _add_site(entries: dict[str, RegionEntry], s: Site, g: graph_mod.Graph, rec: _Recorder, arch: str,
              device_name: str) -> tuple[RegionEntry, bool]:
    """Count one call site into its card (made if new); (entry, whether the card is new)."""
    ins = [rec.kept[v] for v in s.inputs]
    outs = [rec.kept[v] for v in s.outputs]
    nodes = [replace(node, op_card=rec.op_cards.get(fxn)) for node, fxn in zip(s.subgraph.nodes, s.nodes)]
    sub = replace(s.subgraph, nodes=nodes)  # (the op cards are not part of the id: Node.key leaves them out)
    args = [ArgSpec(f"in{i}", "tensor", tensor=m) for i, m in enumerate(ins)]
    card = Card(op=REGION_NS + "+".join(sub.ops), schema=_signature(ins, len(outs)), args=args, outputs=outs,
                arch=arch, family="region", device_name=device_name, region=sub)
    entry = entries.get(card.id)
    first = entry is None
    if first:
        entry = entries[card.id] = RegionEntry(card)
    card = entry.card
    card.calls += 1
    path = _common_path([graph_mod.module_path(n) for n in s.nodes if family_of(n.target) != "view"])
    if path not in card.module_paths:
        card.module_paths.append(path)
    entry.sites.append({"graph": g.index, "nodes": [n.name for n in s.nodes]})
    return entry, first


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
