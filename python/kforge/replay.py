"""kforge.optimize(..., cuda_graphs=True): each traced graph replayed from a CUDA graph.

A graph's forward launched op by op pays the host's time for every call; replayed from a CUDA
graph it pays one launch. `Replayed` wraps the callable dynamo calls for one graph: on its first
call it captures the callable in a CUDA graph (graphed() below: two warm-up calls on
a side stream first, and a forward that synchronizes with the host, or that a graph cannot hold
otherwise, is found and undone there), then each call replays it.

What a replay assumes, and how each call checks it:
  - the inputs' shapes, strides and dtypes are the captured ones: dynamo's guards on the graph
    (dynamic=False; a new shape traces a new graph, which captures its own);
  - the model's parameters and buffers (the inputs found among them at capture) are where
    they were: one compare of their addresses per call; a moved one (a parameter replaced,
    `.data` reassigned, the model moved) runs the graph op by op, counted in `misses`;
  - the values kept from weights that the graph reads (kforge.fold's folded values, layout's
    channels-last weights) are current: where the version of a tensor they are made from moved
    (load_state_dict, an optimizer step), each holder the capture called recomputes its value
    in place, after the inputs are copied in;
  - every other input is copied into the graph's own copy of it before the replay.
Outputs are copies of the graph's, so they stay valid after the next call (the graph writes its
own each replay).

Only graphs that are safe to replay are captured: an inference graph (under no_grad or
inference_mode) that writes none of its inputs, every input a CUDA tensor on one device and
every output a tensor. Any other graph, and one whose capture fails, runs op by op with a note.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from . import fold, timing


class Replayed:
    def __init__(self, fn: Callable, pure: bool, static_ptrs: Callable[[], set[int]], notes: list[str], index: int):
        self.fn, self.pure, self.notes, self.index = fn, pure, notes, index
        self._static_ptrs = static_ptrs  # addresses of the model's parameters and buffers now
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        self.replays = self.misses = 0

    def __call__(self, *inputs: Any) -> Any:
        if self.graph is None:
            if self.failed or not self._capture(inputs):
                return self.fn(*inputs)
        if tuple([inputs[i].data_ptr() for i in self.static]) != self.static_at:
            self.misses += 1
            return self.fn(*inputs)
        for i, buf in self.copies:
            buf.copy_(inputs[i])
        if [w._version for w in self._watched] != self._versions:  # a weight written (or an input copied) since
            if not all([k.refresh() for k in self.kept]):
                self.misses += 1
                return self.fn(*inputs)
            self._versions = [w._version for w in self._watched]
        self.graph.replay()
        self.replays += 1
        return self.kind(o.clone() for o in self.outputs)

    def _refuse(self, why: str) -> bool:
        self.failed = True
        self.notes.append(f"graph {self.index} runs op by op, not from a CUDA graph: {why}")
        return False

    def _capture(self, inputs: tuple) -> bool:
        if not self.pure:
            return self._refuse("it writes its inputs, or is not an inference graph (run under torch.no_grad "
                                "or torch.inference_mode)")
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return self._refuse("its inputs require grad")
        if not inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self._refuse("not every input is a CUDA tensor")
        if len({t.device for t in inputs}) != 1:
            return self._refuse("its inputs are on several devices")
        owned = self._static_ptrs()
        self.static = [i for i, t in enumerate(inputs) if t.data_ptr() in owned]
        self.static_at = tuple(inputs[i].data_ptr() for i in self.static)
        args, static = list(inputs), set(self.static)
        self.copies = []
        for i, t in enumerate(inputs):
            if i not in static:
                args[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
                self.copies.append((i, args[i]))
        held: list = []

        def run() -> None:
            held[:] = [self.fn(*args)]

        try:
            with torch.cuda.device(inputs[0].device), fold.recording() as kept:
                graph = graphed(run)
        except GraphUnsupported as e:
            return self._refuse(str(e))
        except Exception as e:  # noqa: BLE001 (said once; the graph runs op by op from now on)
            return self._refuse(f"capture failed ({_first_line(e)})")
        if not isinstance(held[0], (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in held[0]):
            return self._refuse("not every output is a tensor")
        outputs, self.kind = list(held[0]), type(held[0])
        self.graph, self.outputs, self._args = graph, outputs, args  # the graph reads args' memory
        self.kept = list(dict.fromkeys(kept))  # and these holders' values of weights
        self._watched = [w for k in self.kept for w in k.weights()]  # what those values are made from
        self._versions = [w._version for w in self._watched]
        return True


def graphed(fn) -> "torch.cuda.CUDAGraph":
    """`fn` captured in a CUDA graph, after two warm-up calls on a side stream (as
    torch.cuda.graph wants). The caller keeps whatever `fn` reads alive while the graph is.

    A forward a graph cannot hold raises, and leaves the process as it found it. One that
    reads a value back on the host (.item(), .cpu(), nonzero) is found in the second warm-up
    call, run with torch's sync debug mode at "error", before any capture starts. Any other
    failed capture is undone: torch leaves the capture stream current, the CUDA generator
    in capture mode (every later random op on the device raises) and the allocator routing
    to the graph's pool, and this puts all three back."""
    dev = torch.cuda.current_device()  # check_model makes the model's device current
    stream = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(stream)
    try:
        with torch.cuda.stream(side):
            fn()
            mode = torch.cuda.get_sync_debug_mode()
            try:
                _sync_debug_mode("error")
                fn()
            except RuntimeError as e:
                if "synchroniz" not in str(e):
                    raise  # another failure (out of memory, a CUDA error): not this check's to name
                raise GraphUnsupported(f"the forward synchronizes with the host, which a CUDA graph cannot hold "
                                       f"({_first_line(e)})") from e
            finally:
                _sync_debug_mode(mode)
    finally:
        stream.wait_stream(side)  # later work on the stream waits for the warm-up, however it ended
    gen = torch.cuda.default_generators[dev]
    rng = gen.clone_state()
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except BaseException:
        torch.cuda.set_stream(stream)
        with contextlib.suppress(Exception):
            gen.graphsafe_set_state(rng)  # a fresh state, not in capture mode, at the offset before capture
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(dev, pool)
            torch._C._cuda_releasePool(dev, pool)
        raise
    return graph


def _sync_debug_mode(mode) -> None:
    """torch.cuda.set_sync_debug_mode without its "prototype feature" warning (a warning
    filter set to "error", as under pytest, would raise it after the mode is set)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode(mode)


class GraphUnsupported(RuntimeError):
    """The forward does something a CUDA graph cannot hold; found before any capture."""


def _first_line(e: BaseException) -> str:
    """The first line of the exception that started it all (torch.cuda.graph raises its own
    "capture failed" on top of the forward's error)."""
    for _ in range(8):
        inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def time_graphs(forward, package, *, calls: int, rounds: int, device=None,
                **install_options: Any) -> list[timing.Measurement]:
    """`forward` replayed from a CUDA graph eager and one captured with `package` installed,
    timed interleaved as time_as_called does: [eager, package]. The package stays installed
    while its graph exists (the graph launches its kernels, which live as long as the
    install). Raises what capture raises for a forward a graph cannot hold."""
    eager = graphed(forward)
    with package.apply(**install_options):
        packaged = graphed(forward)
        try:
            return timing.time_as_called([(contextlib.nullcontext, eager.replay),
                                          (contextlib.nullcontext, packaged.replay)],
                                         calls=calls, rounds=rounds, device=device)
        finally:
            del packaged  # before the uninstall unloads the kernels it launches
