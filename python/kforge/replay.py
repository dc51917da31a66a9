"""kforge.optimize(..., cuda_graphs=True): each traced graph replayed from a CUDA graph.

A graph's forward launched op by op pays the host's time for every call; replayed from a CUDA
graph it pays one launch. `Replayed` wraps the callable dynamo calls for one graph: on its first
call it captures the callable in a CUDA graph (kforge.modelcheck.graphed: two warm-up calls on
a side stream first, and a forward that synchronizes with the host, or that a graph cannot hold
otherwise, is found and undone there), then each call replays it.

What a replay assumes, and how each call checks it:
  - the inputs' shapes, strides and dtypes are the captured ones: dynamo's guards on the graph
    (dynamic=False; a new shape traces a new graph, which captures its own);
  - the model's parameters and buffers (the inputs found among them at capture) are where
    they were: one compare of their addresses per call; a moved one (a parameter replaced,
    `.data` reassigned, the model moved) runs the graph op by op, counted in `misses`;
  - every other input is copied into the graph's own copy of it before the replay.
Outputs are copies of the graph's, so they stay valid after the next call (the graph writes its
own each replay).

Only graphs that are safe to replay are captured: an inference graph (under no_grad or
inference_mode) that writes none of its inputs, every input a CUDA tensor on one device and
every output a tensor. Any other graph, and one whose capture fails, runs op by op with a note.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


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
        self.graph.replay()
        self.replays += 1
        return self.kind(o.clone() for o in self.outputs)

    def _refuse(self, why: str) -> bool:
        self.failed = True
        self.notes.append(f"graph {self.index} runs op by op, not from a CUDA graph: {why}")
        return False

    def _capture(self, inputs: tuple) -> bool:
        from .modelcheck import GraphUnsupported, _first_line, graphed

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
            with torch.cuda.device(inputs[0].device):
                graph = graphed(run)
        except GraphUnsupported as e:
            return self._refuse(str(e))
        except Exception as e:  # noqa: BLE001 (said once; the graph runs op by op from now on)
            return self._refuse(f"capture failed ({_first_line(e)})")
        if not isinstance(held[0], (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in held[0]):
            return self._refuse("not every output is a tensor")
        outputs, self.kind = list(held[0]), type(held[0])
        self.graph, self.outputs, self._args = graph, outputs, args  # the graph reads args' memory
        return True
