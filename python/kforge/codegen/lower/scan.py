"""Scans (`gen_scan`: a thread per line; `gen_scan_block`: a block per contiguous line)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...proposers.builtin.common import ceil_div
from ..ir import Expr, Program
from .emit import (CTYPE, Built, Emitter, _const, _header, _index_type, _merge_block, _pointers, _shfl, coalesce,
                   convert, offsets_code)

# ---- scan ------------------------------------------------------------------------------

@dataclass
class _ScanLines:
    """What both scan kernels share: the lines (kept dims coalesced, the offsets of line q
    in every tensor as code), each tensor's stride along the scan dim, the operand's lifted
    state at element i (its statements in `operand`), and the epilogue's stores at i."""
    params: list
    args: list
    idx: str  # the index type
    kn: int
    length: int
    kofs: list[str]
    operand: list[str]
    lifted: str
    epilogue: list[str]  # statements computing the outputs from st0 and storing them at i


def _scan_lines(prog: Program, idx_extra: int) -> _ScanLines:
    scan = prog.scan
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    tensors = [list(s) for s in prog.out_strides] + [list(prog.in_strides[i]) for i in loaded]
    kept = [d for d in range(len(prog.domain)) if d != scan.dim]
    ks, kst = coalesce(list(prog.domain), tensors, sorted(kept, key=lambda d: -prog.out_strides[0][d]))
    sd = [t[scan.dim] for t in tensors]
    idx = _index_type(prog, idx_extra)
    kofs = offsets_code("q", ks, kst, [f"k{t}" for t in range(len(tensors))], idx)

    def load(i, stored):
        return f"{ptr[i]}[k{tix[i]} + i * {sd[tix[i]]}]"

    em = Emitter("p", {}, load)
    x = em(scan.operand)
    (lift,) = scan.kind.lift_exprs(Expr.var("x", scan.operand.dtype))
    em.env["x"] = x
    lifted = em(lift)
    epi = Emitter("e", {"s0": "st0"}, load)
    res = [epi(e) for e in prog.results]
    stores = [f"out{j}[k{j} + i * {sd[j]}] = {convert(r, prog.results[j].dtype, m.dtype)};"
              for j, (m, r) in enumerate(zip(prog.outputs, res))]
    return _ScanLines(params, args, idx, math.prod(ks), prog.domain[scan.dim], kofs, em.lines, lifted,
                      epi.lines + stores)


def lower_scan(prog: Program, knobs: dict) -> Built:
    """One thread per line along the scan dim, walking it in order: every layout, no
    cooperation between threads (coalesced when the scan dim is not the innermost)."""
    scan = prog.scan
    kind, dt = scan.kind, scan.operand.dtype
    (st_type,) = kind.state(dt)
    nt, unroll = knobs["threads"], knobs["unroll"]
    sl = _scan_lines(prog, 2 * nt)
    (ident,) = kind.identity_exprs(dt)
    step = _merge_block(kind, dt, ["st0"], [sl.lifted], "u")
    before, after = (sl.epilogue, []) if scan.exclusive else ([], sl.epilogue)
    body = [f"typedef {sl.idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr kf_idx KN = {sl.kn}; constexpr kf_idx LEN = {sl.length};",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(sl.params)}) {{',
            "  const kf_idx q = (kf_idx)blockIdx.x * NT + threadIdx.x;",
            "  if (q >= KN) return;",
            *[f"  {line}" for line in sl.kofs],
            f"  {CTYPE[st_type]} st0 = {_const(ident)};",
            f"#pragma unroll {unroll}",
            "  for (kf_idx i0 = 0; i0 < LEN; ++i0) {",
            f"    const kf_idx i = {'LEN - 1 - i0' if scan.reverse else 'i0'};",
            *[f"    {line}" for line in sl.operand + before + step + after],
            "  }",
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(sl.kn, nt),), (nt,), sl.args, 0)], [])


def scan_is_inner(prog: Program) -> bool:
    """The scanned dim is the innermost in memory for the first output (lines are contiguous)."""
    return prog.out_strides[0][prog.scan.dim] == 1 and prog.domain[prog.scan.dim] > 1


STAGE_MAX = 40 * 1024  # the staged chunk's shared memory (static: at most 48 KB a block)


def scan_stages(prog: Program, knobs: dict) -> bool:
    """Whether gen_scan_block's `stage` knob takes effect: its padded chunk of states fits STAGE_MAX."""
    (st_type,) = prog.scan.kind.state(prog.scan.operand.dtype)
    n = knobs["threads"] * knobs["items"]
    return knobs.get("stage") == "smem" and (n + n // 32) * (8 if st_type in ("float64", "int64") else 4) <= STAGE_MAX


def lower_scan_block(prog: Program, knobs: dict) -> Built:
    """One block per line along the scan dim (for lines contiguous in memory): in chunks of
    threads x items elements, each thread scans its `items` consecutive elements, a warp
    scans its threads' totals with shuffles, warp 0 scans the warps' totals in shared memory,
    and a carry takes the line on to the next chunk. The merge is associative, so the tree
    gives eager's answer; floating sums fold at most `items` elements in sequence per level.
    With `stage` "smem" (where the chunk fits STAGE_MAX), the chunk's lifted operands go through
    shared memory: loaded by consecutive threads at consecutive elements, read back by each
    thread as its consecutive `items`, and its states written back for the epilogue to run
    at consecutive elements again (a thread's own consecutive elements make each warp access
    memory `items` elements apart). Indices into the stage skip a word every 32, so neither
    order meets a bank conflict."""
    scan = prog.scan
    kind, dt = scan.kind, scan.operand.dtype
    (st_type,) = kind.state(dt)
    T = CTYPE[st_type]
    nt, it = knobs["threads"], knobs["items"]
    staged = scan_stages(prog, knobs)
    sl = _scan_lines(prog, 2 * nt * it)
    (ident,) = kind.identity_exprs(dt)
    zero = _const(ident)

    def merged(into: str, other: str, tag: str) -> list[str]:
        return _merge_block(kind, dt, [into], [other], tag)

    element = f"const kf_idx i = {'LEN - 1 - j' if scan.reverse else 'j'};"

    def warp_scan(v: str, tag: str) -> list[str]:  # v = the inclusive scan of v over the warp's lanes
        return ["#pragma unroll", "for (int o = 1; o < 32; o <<= 1) {",
                f"  {T} t{tag} = {_shfl(v, st_type, 'o', 32, 'up')};",
                *[f"  {line}" for line in merged(f"t{tag}", v, tag)],
                f"  if (lane >= o) {v} = t{tag};", "}"]

    # the state each output reads: the elements before this one (exclusive) or up to it
    before = (["if (u > 0) {", *[f"  {line}" for line in merged("st0", "v[u - 1]", "x")], "}"] if scan.exclusive
              else merged("st0", "v[u]", "x"))

    def lifted_at(j: str, into: str) -> list[str]:  # the lifted operand at element j (identity past the line)
        return [f"const kf_idx j = {j};", f"{T} {into} = {zero};", "if (j < LEN) {", f"  {element}",
                *[f"  {line}" for line in sl.operand], f"  {into} = {sl.lifted};", "}"]

    own = "(int)threadIdx.x * IT + u"  # this thread's u-th consecutive element of the chunk
    spread = "u * NT + (int)threadIdx.x"  # the chunk's element at consecutive threads, u-th round
    if staged:  # every element of the chunk staged in order, then each thread's own read back
        load = ["    __syncthreads();  // the last chunk's epilogue has read the stage",
                "#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                *[f"      {line}" for line in lifted_at(f"c0 + {spread}", "xs")],
                f"      const int k = {spread};", "      kf_st[k + (k >> 5)] = xs;", "    }",
                "    __syncthreads();",
                f"    {T} v[IT];", f"    {T} tot = {zero};",
                "#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                f"      const int k = {own};", f"      const {T} xu = kf_st[k + (k >> 5)];",
                *[f"      {line}" for line in merged("tot", "xu", "a")], "      v[u] = tot;", "    }"]
    else:
        load = [f"    {T} v[IT];", f"    {T} tot = {zero};",
                "#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                *[f"      {line}" for line in lifted_at(f"c0 + {own}", "xu")],
                *[f"      {line}" for line in merged("tot", "xu", "a")], "      v[u] = tot;", "    }"]
    epilogue_own = ["#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                    f"      const kf_idx j = c0 + {own};", "      if (j < LEN) {", f"        {element}",
                    f"        {T} st0 = pre;", *[f"        {line}" for line in before],
                    *[f"        {line}" for line in sl.epilogue], "      }", "    }"]
    # staged: each thread's states into the stage, then the epilogue at consecutive elements
    epilogue_staged = ["#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                       f"      {T} st0 = pre;", *[f"      {line}" for line in before],
                       f"      const int k = {own};", "      kf_st[k + (k >> 5)] = st0;", "    }",
                       "    __syncthreads();",
                       "#pragma unroll", "    for (int u = 0; u < IT; ++u) {",
                       f"      const int k = {spread};", "      const kf_idx j = c0 + k;",
                       "      if (j < LEN) {", f"        {element}", f"        const {T} st0 = kf_st[k + (k >> 5)];",
                       *[f"        {line}" for line in sl.epilogue], "      }", "    }"]
    body = [f"typedef {sl.idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int IT = {it}; constexpr int NW = NT / 32; "
            f"constexpr kf_idx LEN = {sl.length};",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(sl.params)}) {{',
            "  const kf_idx q = blockIdx.x;",
            *[f"  {line}" for line in sl.kofs],
            "  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;",
            f"  __shared__ {T} sw[NW];",
            *([f"  __shared__ {T} kf_st[NT * IT + NT * IT / 32];"] if staged else []),
            f"  {T} carry = {zero};",
            "  for (kf_idx c0 = 0; c0 < LEN; c0 += (kf_idx)NT * IT) {",
            *load,
            f"    {T} winc = tot;",
            *[f"    {line}" for line in warp_scan("winc", "w")],
            f"    {T} wexc = {_shfl('winc', st_type, 1, 32, 'up')};",
            f"    if (lane == 0) wexc = {zero};",
            "    __syncthreads();  // the last chunk's reads of sw are done",
            "    if (lane == 31) sw[warp] = winc;",
            "    __syncthreads();",
            "    if (warp == 0) {",
            f"      {T} s = lane < NW ? sw[lane] : {zero};",
            *[f"      {line}" for line in warp_scan("s", "b")],
            "      if (lane < NW) sw[lane] = s;",
            "    }",
            "    __syncthreads();",
            f"    {T} pre = carry;",
            f"    const {T} wp = warp > 0 ? sw[warp - 1] : {zero};",
            *[f"    {line}" for line in merged("pre", "wp", "p")],
            *[f"    {line}" for line in merged("pre", "wexc", "q")],
            *(epilogue_staged if staged else epilogue_own),
            f"    const {T} bt = sw[NW - 1];",
            *[f"    {line}" for line in merged("carry", "bt", "c")],
            "  }",
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (sl.kn,), (nt,), sl.args, 0)], [])
