"""Model -> aten-level FX graphs for inference, in the form eager dispatch runs, without changing the model.

How: torch.compile with a backend of kforge's own (no Inductor). Dynamo splits the forward
into graphs at its graph breaks; each graph is lowered to aten by aot_autograd with no
decompositions of kforge's choosing, so only the CompositeImplicitAutograd ops decompose,
exactly as they do in eager: native_group_norm stays native_group_norm, softmax becomes
_softmax, linear becomes t + addmm, and upsampling stays the op eager calls (torch decomposes it
in Python into index tensors and gathers: kforge.eager_composites). The graphs are functional (relu_ is recorded as relu).
Inference graphs with 2-D convolutions on CUDA are laid out channels-last
as torch.compile lays them out (kforge.layout), and a fused attention call runs as
matmul-softmax-matmul where that is measured faster (kforge.attention); before that, an
attention mask built from no input is dropped, or made SDPA's is_causal, where that is what
it is (kforge.masks), and repeated keys and values of such a call become grouped ones
(kforge.gqa), as eager calls SDPA. Every node carries its value's metadata in node.meta["val"] (a fake tensor: shape, stride,
dtype), its scalar arguments in node.args, and its module in node.meta["nn_module_stack"].

What runs: the callable the graph compiler returns for each graph, called by dynamo's code with
the graph's flat inputs. Where that inference graph needs nothing of aot_autograd's runtime
wrapper (no input it mutates, no output that aliases an input or another output, no effect
tokens, deduplicated or subclass inputs, no autocast), the callable runs alone: the wrapper's
per-call Python is host time a launch-bound forward pays on every call. A graph compiler that
changes nothing returns None, and dynamo's own graph runs (torch-level calls, as eager makes them).

Each graph is handled on its own; a graph break is reported as one line. aot_autograd is
private to torch (stable from 2.0 to 2.14): where it is missing the trace gives no graphs,
with a warning, and the per-op capture still covers the model.
"""

from __future__ import annotations

import collections
import re
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import attention, conv_bias, eager_composites, gqa, layout, masks

ROOT = "(root)"  # module path of nodes run by the model's own forward (as capture names it)

# (graph module, its index, why dynamo ended it or None) -> the callable that runs it, or None:
# the graph is not changed, and dynamo's graph of it runs
GraphCompiler = Callable[[torch.fx.GraphModule, int, "str | None"], "Callable[..., Any] | None"]
# (the callable dynamo will call with the graph's flat inputs, whether it is an inference graph
# that writes none of its inputs) -> what dynamo calls instead
Finisher = Callable[[Callable[..., Any], bool], Callable[..., Any]]


@dataclass
class Graph:
    index: int  # in the order dynamo compiled them
    module: torch.fx.GraphModule  # aten-level, inference
    break_note: str | None = None  # the graph break that ended this graph, one line
    inputs: list[torch.Tensor] | None = None  # the real inputs of its first call in the traced run


@dataclass
class Trace:
    graphs: list[Graph] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line per graph break or failure


class GraphCaptureWarning(UserWarning):
    """Graph capture is not possible with this torch: regions are not captured."""


def tracing_code() -> "types.CodeType | None":
    """The code object whose frame dynamo is tracing now, read inside a backend (a private dynamo
    API: None on a torch without it)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # noqa: BLE001 (no translator, or this torch moved it)
        return None


def _skip_code() -> Callable[[types.CodeType], None] | None:
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    return skip_code


def can_run_natively() -> bool:
    """Whether this torch has the private dynamo API run_natively uses."""
    return _skip_code() is not None


def run_natively(code: types.CodeType) -> None:
    """Have dynamo run `code`'s frames as plain Python from now on: no cache lookup, no guard
    check (the functions it calls are still traced). Call it outside dynamo's tracing: dynamo sets
    the strategy of the frame it converts when the conversion returns. Nothing happens on a
    torch without the private API (see can_run_natively)."""
    skip = _skip_code()
    if skip is not None:
        skip(code)


def forget(code: types.CodeType) -> None:
    """Drop dynamo's compiled entries and frame state for `code` (torch._dynamo.reset_code, a
    private API: nothing happens on a torch without it)."""
    try:
        from torch._dynamo import reset_code
    except ImportError:
        return
    reset_code(code)


def _aot(fw_compiler: Callable, inference_compiler: Callable) -> Callable | None:
    try:
        from torch._dynamo.backends.common import aot_autograd
    except ImportError:
        return None
    return aot_autograd(fw_compiler=fw_compiler, inference_compiler=inference_compiler, decompositions={})


def _inference_meta(agm: torch.fx.GraphModule, example_inputs: list) -> tuple[bool, bool]:
    """(pure, direct) for an inference graph, read inside its compiler before anything changes it:
    pure, it writes none of its inputs; direct, aot_autograd's runtime wrapper does nothing for it
    (the graph takes dynamo's flat inputs and returns dynamo's outputs)."""
    from torch._guards import TracingContext
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    if meta is None or meta.tokens:
        return False, False
    pure = not any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
    placeholders = sum(n.op == "placeholder" for n in agm.graph.nodes)  # fewer: inputs were deduplicated
    direct = (pure and not meta.num_intermediate_bases and not torch._C._is_any_autocast_enabled()
              and all(o.output_type.name == "non_alias" for o in meta.output_info)
              and placeholders == len(example_inputs)
              and not any(isinstance(x, (list, tuple, dict)) or is_traceable_wrapper_subclass(x) for x in example_inputs))
    return pure, direct


WEIGHTS = "kforge_weights"  # agm.meta: the placeholders (by number) that hold the model's parameters and buffers


def _weights() -> tuple[int, ...]:
    """The inputs of the graph aot_autograd is compiling that dynamo marked static (parameters and
    buffers); none where this torch does not say (private API)."""
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    return tuple(getattr(meta, "static_input_indices", None) or ())


def _break_note(gm: torch.fx.GraphModule, index: int) -> str | None:
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = getattr(reason, "user_stack", None) or []
    where = f" at {stack[-1].filename}:{stack[-1].lineno}" if stack else ""
    why = (str(getattr(reason, "reason", "")).strip().splitlines() or ["unknown reason"])[0]
    return f"graph break after graph {index}{where}: {why}"


def sdpa_as_eager(gm: torch.fx.GraphModule, notes: list[str] | None = None) -> None:
    """Dynamo's graph with its SDPA calls as eager makes them, before aot_autograd lowers it
    (where SDPA picks its kernel): constant masks dropped or made is_causal (kforge.masks), then
    the grouped keys and values of calls left with no mask (kforge.gqa)."""
    masks.apply(gm, notes)
    gqa.apply(gm, notes)


def aten_backend(compile_graph: GraphCompiler, notes: list[str], finish: Finisher | None = None) -> Callable:
    """A torch.compile backend that lowers each dynamo graph to aten (see the module doc) and
    runs what `compile_graph` returns for it, through `finish` if given. A graph that cannot be
    lowered runs as dynamo traced it (eager), with a note."""
    count = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        index = count[0]
        count[0] += 1
        note = _break_note(gm, index)
        if note:
            notes.append(note)

        runs: dict[str, Any] = {"pure": False}  # "fn": what runs instead of aot_autograd's wrapped graph

        def fw_compiler(agm: torch.fx.GraphModule, _inputs: list) -> Callable:
            fn = compile_graph(agm, index, note)
            runs["fn"] = gm.forward if fn is None else None
            return agm if fn is None else fn

        def inference_compiler(agm: torch.fx.GraphModule, _inputs: list) -> Callable:
            runs["pure"], direct = _inference_meta(agm, example_inputs)
            agm.meta[WEIGHTS] = _weights()
            changed = attention.apply(agm.graph, notes)  # matmul-softmax-matmul where faster than the fused call
            layout.apply(agm, notes)  # channels-last convolutions, as torch.compile lays them out
            changed = conv_bias.split(agm.graph) or changed  # cuDNN's bias adds, for the regions after them to take in
            if changed:
                agm.graph.lint()
                agm.recompile()
            fn = compile_graph(agm, index, note)
            runs["fn"] = gm.forward if fn is None else fn if direct else None
            return agm if fn is None else fn

        def done(fn: Callable) -> Callable:
            return finish(fn, runs["pure"]) if finish is not None else fn

        lower = _aot(fw_compiler, inference_compiler)
        if lower is None:
            message = (f"torch {torch.__version__} has no torch._dynamo.backends.common.aot_autograd: "
                       "graphs are not lowered to aten, regions are not captured")
            warnings.warn(message, GraphCaptureWarning, stacklevel=2)
            notes.append(message)
            return done(gm.forward)
        try:
            sdpa_as_eager(gm, notes)
            with eager_composites.as_eager():  # upsampling as eager calls it, not torch's decomposition
                lowered = lower(gm, example_inputs)
        except Exception as e:  # noqa: BLE001 (the graph then runs eagerly; the note says why)
            notes.append(f"graph {index} could not be lowered to aten ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}); it runs eagerly")
            runs["pure"] = False
            return done(gm.forward)
        return done(runs.get("fn") or lowered)

    return backend


def trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> Trace:
    """Run `model(*args, **kwargs)` once under torch.compile with a recording backend: every
    graph with the real inputs of its first call. The caller sets eval/no_grad. A model that
    dynamo cannot run gives no graphs and a note (its per-op capture is unaffected)."""
    result = Trace()

    def record(agm: torch.fx.GraphModule, index: int, note: str | None) -> Callable:
        graph = Graph(index, agm, note)
        result.graphs.append(graph)

        def run(*inputs):
            if graph.inputs is None:
                graph.inputs = list(inputs)
            return agm(*inputs)

        return run

    lower = aten_backend(record, result.notes)
    traced: collections.Counter = collections.Counter()  # code -> graphs traced of it

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        traced[tracing_code()] += 1
        return lower(gm, example_inputs)

    try:
        torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (reported; the per-op capture does not depend on it)
        result.notes.append(f"graph capture failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        result.graphs = []
    finally:
        # Dynamo keeps compiled entries per code object, for every compiled model in the process. A
        # frame the trace retraced for new shapes (an expert, called with a new token count each
        # time, reaches the recompile limit in this one forward) would keep checking the trace's
        # entries on its every call, under the model's own torch.compile or kforge.optimize too:
        # such codes are forgotten. A code traced once (the compiled module's wrapper, shared by
        # every compiled module) keeps its entries, and the user's beside them.
        for code, graphs in traced.items():
            if code is not None and graphs > 1:
                forget(code)
    if not result.graphs and not result.notes:
        result.notes.append("graph capture produced no graph (dynamo ran the model eagerly: recompile limit "
                            "reached for this model's code?)")
    result.graphs.sort(key=lambda g: g.index)
    return result


_SUBSCRIPT = re.compile(r"\[(\d+)\]|\._modules\['([^']+)'\]|\['([^']+)'\]")


def module_path(node: torch.fx.Node) -> str:
    """The innermost module a node ran in, as named_modules() names it ("layers.0.norm")."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ROOT
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^(L\['[^']*'\]|self\b)", "", path)  # dynamo's name for the model itself
    path = _SUBSCRIPT.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return path.lstrip(".") or ROOT
