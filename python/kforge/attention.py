"""Attention as matmul -> softmax -> matmul where that is faster than the fused kernel eager picks.

SDPA's fused kernels (flash, cuDNN, memory-efficient) win wherever they apply well, but their
speed falls off a cliff outside the head dims they are tuned for: at head dim 512 (the single-head
attention of a diffusion VAE) flash and cuDNN refuse the shape and eager runs the
memory-efficient kernel, measured on an H200 at 3.6 ms for 16384 tokens against 1.2 ms for two
cuBLAS matmuls around a softmax. torch.compile leaves the fused call as it is, so it pays the
same.

This pass rewrites an inference graph's fused attention calls, one at a time, into

    scores = (q * scale) @ k^T      fp32 scores for half types (bmm with out_dtype, CUDA), so the
    p = softmax(scores, -1)         softmax reads what the fused kernels keep in registers
    out = p.to(q.dtype) @ v         in the stride order the fused call returned

where that was measured faster: per distinct call (shapes, strides, dtype, scale, device) both
are timed once per process on random inputs of those exact shapes (GPU time, L2 flushed), the
decomposition must win by MARGIN, its error against an fp32 reference must stay within
ACCURACY times the fused kernel's own, and its scores must fit in SCORES_SHARE of the GPU's
memory. A call is a candidate where dropout is 0, it is not causal, has no mask or bias, and
only its output (not its log-sum-exp) is used.

It runs at the two places kforge turns a traced graph into what runs: the aten graphs of
kforge.graph (so capture sees the softmax as a region card and kforge.optimize runs the same
graph) and kforge.compile's post-grad pass (AttentionRewrite), where the softmax is decomposed
as Inductor decomposes it and fused by Inductor. KFORGE_ATTENTION=keep turns it off;
KFORGE_ATTENTION=decompose rewrites every candidate without measuring (on any device; tests).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import env
from .inline import inline

log = logging.getLogger("kforge")

VERSION = 1  # bumped when the rewrite changes: part of the compile pass's uuid
MARGIN = 0.10  # the decomposition must take at most (1 - MARGIN) of the fused kernel's time
ACCURACY = 2.0  # and err no more than this many times the fused kernel does (fp32 reference)
SCORES_SHARE = 0.125  # its scores and probabilities: at most this share of the GPU's memory
CPU_SCORES_BYTES = 1 << 30  # the same bound off the GPU (KFORGE_ATTENTION=decompose)
FUSED = frozenset({"_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"})


@dataclass(frozen=True)
class Site:
    node: fx.Node
    q: torch.Tensor  # the traced values (FakeTensors) of the call's inputs and output
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scale: float

    def key(self) -> tuple:
        q, k, v = self.q, self.k, self.v
        return (self.node.target.name(), *(tuple(t.shape) + tuple(t.stride()) for t in (q, k, v)),
                tuple(self.out.stride()), str(q.dtype), str(q.device), self.scale)

    def scores_bytes(self) -> int:
        b, h, s, _ = self.q.shape
        wide = _scores_dtype(self.q)  # the scores, then the probabilities cast back where that differs
        per = wide.itemsize + (self.q.dtype.itemsize if wide != self.q.dtype else 0)
        return b * h * s * self.k.shape[2] * per

    def describe(self) -> str:
        return f"attention {list(self.q.shape)}x{list(self.k.shape)} {str(self.q.dtype).replace('torch.', '')}"


def _bound(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by their schema names, defaults filled in."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def site(node: fx.Node) -> Site | None:
    """`node` as a candidate for the rewrite (see the module doc), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or node.target.name().split("::")[-1].split(".")[0] not in FUSED:
        return None
    a = _bound(node)
    if float(a.get("dropout_p") or 0.0) != 0.0 or a.get("is_causal") or a.get("attn_bias") is not None \
            or a.get("attn_mask") is not None:
        return None
    if not any(_item(u) == 0 and u.users for u in node.users) \
            or any(_item(u) is None or (_item(u) != 0 and u.users) for u in node.users):
        return None
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a["query"], a["key"], a["value"])]
    out = node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) else None
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in [*vals, out]):
        return None
    q, k, v = vals
    if len({t.dtype for t in vals}) != 1 or not q.dtype.is_floating_point \
            or not q.shape[:2] == k.shape[:2] == v.shape[:2] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        return None
    scale = a.get("scale")
    return Site(node, q, k, v, out, float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[3]))


def _item(user: fx.Node) -> int | None:
    """Which output of a multi-output call `user` takes, or None where it is no getitem."""
    return user.args[1] if user.op == "call_function" and user.target is operator.getitem else None


def _scores_dtype(q: torch.Tensor) -> torch.dtype:
    half = q.dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if half and q.device.type == "cuda" and hasattr(torch.ops.aten.bmm, "dtype") else q.dtype


def decomposed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               out_stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v as two batched matmuls and a softmax, in `out_stride`'s order."""
    b, h, s, d = q.shape
    n, dv = k.shape[2], v.shape[3]
    q3 = (q * scale).reshape(b * h, s, d)
    kt = k.reshape(b * h, n, d).transpose(1, 2)
    wide = _scores_dtype(q)
    scores = torch.ops.aten.bmm.dtype(q3, kt, wide) if wide != q.dtype else torch.bmm(q3, kt)
    p = torch.ops.aten._softmax(scores, -1, False)
    out = torch.bmm(p.to(q.dtype), v.reshape(b * h, n, dv)).view(b, h, s, dv)
    return out if out_stride is None else _in_order(out, out_stride)


def _in_order(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`t` with its dims laid out in the order `stride` gives them (size-1 dims do not count)."""
    order = sorted(range(t.dim()), key=lambda i: (-stride[i], i))
    same = [i for i in sorted(range(t.dim()), key=lambda i: (-t.stride()[i], i)) if t.shape[i] > 1]
    if same == [i for i in order if t.shape[i] > 1]:
        return t
    inverse = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


@dataclass(frozen=True)
class Decision:
    rewrite: bool
    why: str  # one line


_decided: dict[tuple, Decision] = {}


def decide(s: Site) -> Decision:
    """Whether to rewrite this call (module doc), measured once per process per distinct call."""
    mode = env.attention_mode()
    if mode == "keep":
        return Decision(False, "KFORGE_ATTENTION=keep")
    cap = CPU_SCORES_BYTES
    if s.q.device.type == "cuda" and torch.cuda.is_available():
        cap = int(SCORES_SHARE * torch.cuda.get_device_properties(s.q.device).total_memory)
    if s.scores_bytes() > cap:
        return Decision(False, f"its scores would take {s.scores_bytes() / 2**30:.1f} GiB, over {cap / 2**30:.1f}")
    if mode == "decompose":
        return Decision(True, "KFORGE_ATTENTION=decompose")
    if s.q.device.type != "cuda" or not torch.cuda.is_available():
        return Decision(False, "measured only on CUDA")
    if torch.cuda.is_current_stream_capturing():
        return Decision(False, "not measured while a CUDA graph is being captured")
    key = s.key()
    if key not in _decided:
        try:
            _decided[key] = _measure(s)
        except Exception as e:  # noqa: BLE001 (the call stays fused; the reason is kept)
            _decided[key] = Decision(False, f"not measured ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]})")
        log.info("%s: %s", s.describe(), _decided[key].why)
    return _decided[key]


def _measure(s: Site) -> Decision:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import timing

    with unset_fake_temporarily(), torch.no_grad():
        device = torch.device("cuda", s.q.device.index if s.q.device.index is not None else torch.cuda.current_device())
        gen = torch.Generator(device=device).manual_seed(0)
        a = _bound(s.node)
        real: dict[fx.Node, torch.Tensor] = {}  # one tensor per input node (q, k and v may be one)
        for name, t in (("query", s.q), ("key", s.k), ("value", s.v)):
            if a[name] not in real:
                x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                real[a[name]] = x.normal_(generator=gen)
        q, k, v = (real[a[name]] for name in ("query", "key", "value"))
        args, kwargs = fx.node.map_arg((s.node.args, s.node.kwargs), real.__getitem__)

        def fused() -> torch.Tensor:
            return s.node.target(*args, **kwargs)[0]

        def mine() -> torch.Tensor:
            return decomposed(q, k, v, s.scale, tuple(s.out.stride()))

        ref = decomposed(q.float(), k.float(), v.float(), s.scale)
        err_fused = float((fused().float() - ref).abs().max())
        err_mine = float((mine().float() - ref).abs().max())
        floor = torch.finfo(q.dtype).eps * float(ref.abs().max())
        del ref
        t_fused, t_mine = (m.median for m in timing.time_fns([fused, mine], min_reps=10, min_ms=50.0))
    numbers = f"{t_mine:.0f} µs against {t_fused:.0f} µs fused, max error {err_mine:.1e} against {err_fused:.1e}"
    if err_mine > ACCURACY * err_fused + floor:
        return Decision(False, f"kept fused: matmul-softmax-matmul is less accurate ({numbers})")
    if t_mine > (1 - MARGIN) * t_fused:
        return Decision(False, f"kept fused: matmul-softmax-matmul is not faster ({numbers})")
    return Decision(True, f"runs as matmul-softmax-matmul: {numbers}")


def apply(graph: fx.Graph, notes: list[str] | None = None, table: dict | None = None) -> int:
    """Rewrite the graph's candidate attention calls that decide() takes; how many. `table`: a
    decomposition table the rewritten ops are traced through (Inductor's, in the compile pass);
    None keeps them as eager dispatch runs them. One note per rewritten call."""
    count = 0
    for node in list(graph.nodes):
        s = site(node)
        if s is None:
            continue
        d = decide(s)
        if not d.rewrite:
            continue

        def rewritten(q, k, v, *_: Any, s: Site = s, **__: Any) -> tuple[torch.Tensor]:
            return (decomposed(q, k, v, s.scale, tuple(s.out.stride())),)

        for u in [u for u in node.users if _item(u) != 0]:  # unused outputs (a traced log-sum-exp)
            node.graph.erase_node(u)
        where = _module(node)
        if inline(graph, node, {**(table or {}), node.target: rewritten}):
            count += 1
            if notes is not None:
                notes.append(f"{s.describe()} at {where} {d.why}")
    return count


def _module(node: fx.Node) -> str:
    from .graph import module_path

    return module_path(node)


class AttentionRewrite:
    """The rewrite as a step of kforge.compile's post-grad pass (kforge.inductor_rewrites.Rewrite)."""

    whole: set = set()

    def __init__(self) -> None:
        self.key = f"attention:{VERSION}:{env.attention_mode() or 'measured'}"

    def __call__(self, graph: fx.Graph) -> int:
        from torch._inductor.decomposition import select_decomp_table

        return apply(graph, None, table=select_decomp_table())
