"""softmax / log_softmax over the last dim of a contiguous tensor.

The algorithms, chosen by row length and row count:
  warp        a warp per row, the row in registers (short rows, many of them);
  block_regs  a block per row, the row in registers;
  block_smem  a block per row, the row cached in shared memory (three passes, one read);
  block_online  a block per row, online max/sum in one read, a second read to write;
  split       very long rows over many blocks: kernel 1 writes each chunk's (max, sum of
              exp) to a workspace, kernel 2 combines a row's chunks and writes its chunk;
  split_coop  split_regs in one cooperative launch: each block waits for its row's other
              chunks on a counter, so x is read once and there is one launch;
  split_cluster  split_regs' chunks of a row as one thread block cluster (sm_90+, at most
              16 blocks): each block leaves its chunk's (max, sum of exp) in shared memory,
              the cluster barriers in hardware and every block reads the row's partials
              over distributed shared memory; one plain launch, no workspace, x read once;
  split_regs  split with each chunk in registers: every thread issues all its loads back to
              back before any arithmetic (many bytes in flight), kernel 1 takes the chunk's
              exact max then its sum of exp, kernel 2 loads its chunk (an L2 hit) before it
              reads the row's partials, which each warp combines without a barrier.
Every algorithm computes in fp32 and, like torch, divides exp(x - max) by the sum.

softmax.int / log_softmax.int are the composite ops with dtype= (kforge.composite): eager
casts x, then runs the softmax; with a float32 dtype (the usual `dtype=torch.float32` on
half or bf16 scores) the cast is exact, so the same kernel reading x as it is computes the
same thing in one pass.
"""

from __future__ import annotations

from ...cards import Card, decode_value
from ...hardware import Hardware
from . import softmax_sources as sources
from .common import GROUP_WAIT, ceil_div, constants, ctype, group_wait_workspace, legal_vecs, render, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch, pick

OPS = frozenset({"aten::_softmax.default", "aten::_log_softmax.default", "aten::softmax.int", "aten::log_softmax.int"})
LOG_OPS = frozenset({"aten::_log_softmax.default", "aten::log_softmax.int"})
MAX_REGS = 64  # fp32 values a thread may hold for its rows
SPLIT_REGS = 32  # fp32 values a split_regs thread holds for its chunk (with 128 threads, the fewest)
SPLIT_THREADS = (128, 256, 512)
SPLITS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
COOP_THREADS = (512, 1024)
CLUSTERS = (8, 16)  # 8 is the portable cluster size; 16 needs Hopper's non-portable opt-in
CLUSTER_THREADS = (256, 512, 1024)
COOP_BLOCKS_PER_SM = 2
SMEM_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute


def _shape(card: Card) -> tuple[int, int] | str:
    if card.op not in OPS:
        return f"{card.op} is not softmax/log_softmax"
    x, out = card.args[0].tensor, card.outputs[0]
    why = unsupported_dtype([x, out])
    if why:
        return why
    ndim = max(len(x.shape), 1)
    dim = decode_value(card.args[1].value)
    if dim % ndim != ndim - 1:
        return "softmax over a dim other than the last is not templated"
    if not (x.is_contiguous() and out.is_contiguous()) or x.shape != out.shape:
        return "input and output must be contiguous with the same shape"
    if x.numel == 0:
        return "empty input"
    if card.op.endswith(".int") and out.dtype != "float32":
        # A cast to anything but fp32 rounds x before eager's softmax: not what this kernel reads.
        return f"softmax with dtype={out.dtype} is not templated (only dtype=torch.float32)"
    cols = x.shape[-1] if x.shape else 1
    return x.numel // cols, cols


def check(card: Card) -> str | None:
    r = _shape(card)
    return r if isinstance(r, str) else None


def _vecs(card: Card, cols: int) -> tuple:
    return tuple(sorted(legal_vecs(cols, [card.args[0].tensor, card.outputs[0]])))


def _regs(cols: int, lanes: int, v: int) -> int:
    return ceil_div(cols, lanes * v) * v


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    rows, cols = _shape(card)
    vecs = _vecs(card, cols)
    out: list[KnobSpace] = []
    worst = max(_regs(cols, 32, v) for v in vecs)
    if worst <= MAX_REGS:
        out.append({"algo": ("warp",), "warps": (1, 2, 4, 8), "rows": tuple(r for r in (1, 2, 4) if r * worst <= MAX_REGS),
                    "vec": vecs})
    useful = tuple(t for t in (64, 128, 256, 512, 1024) if t <= max(64, cols))
    regs_threads = tuple(t for t in useful if all(_regs(cols, t, v) <= MAX_REGS for v in vecs))
    if regs_threads:
        out.append({"algo": ("block_regs",), "threads": regs_threads, "vec": vecs})
    if cols * card.args[0].tensor.itemsize <= SMEM_LIMIT:
        out.append({"algo": ("block_smem",), "threads": useful, "vec": vecs})
    out.append({"algo": ("block_online",), "threads": useful, "vec": vecs})
    splits = tuple(s for s in (4, 8, 16, 32, 64, 128, 256, 512) if cols // s >= 512)
    if cols >= 8192 and rows <= 65535 and splits:
        out.append({"algo": ("split",), "split": splits, "threads": (128, 256, 512), "vec": vecs})
    # Every split whose chunk fits SPLIT_REGS values per thread at the fewest threads (more
    # threads only hold fewer) and keeps >= 512 elements per chunk.
    reg_splits = tuple(s for s in SPLITS if cols // s >= 512 and ceil_div(cols, s * SPLIT_THREADS[0]) <= SPLIT_REGS)
    if cols >= 8192 and rows <= 65535 and reg_splits:
        # pdl: kernel 2 launched while kernel 1 finishes (programmatic dependent launch, sm_90+).
        pdl = {"pdl": (False, True)} if hw.cc >= 90 else {}
        out.append({"algo": ("split_regs",), "split": reg_splits, "threads": SPLIT_THREADS, "vec": vecs, **pdl})
    # split_coop: every block of the grid resident at once, at most COOP_BLOCKS_PER_SM per SM
    # (a launch that cannot be resident is refused, never run), the chunk in registers at
    # the fewest threads.
    coop_splits = tuple(s for s in SPLITS if rows * s <= COOP_BLOCKS_PER_SM * hw.sm_count and cols // s >= 512
                        and ceil_div(cols, s * COOP_THREADS[0]) <= SPLIT_REGS)
    if cols >= 8192 and coop_splits:
        out.append({"algo": ("split_coop",), "split": coop_splits, "threads": COOP_THREADS, "vec": vecs})
    # split_cluster: a row's chunks are one cluster, each chunk in registers (one space per
    # cluster size: the legal thread counts differ).
    if hw.cc >= 90 and cols >= 8192 and rows <= 65535:
        for s in CLUSTERS:
            threads = tuple(t for t in CLUSTER_THREADS if ceil_div(cols, s * t) <= SPLIT_REGS)
            if cols // s >= 512 and threads:
                out.append({"algo": ("split_cluster",), "split": (s,), "threads": threads, "vec": vecs})
    return out


def _split_geometry(cols: int, split: int, nt: int, v: int) -> tuple[int, int, int]:
    """(CH, IT, S): chunks of CH elements (whole vectors, about cols/split), IT vector loads
    per thread to cover one, and S = the number of chunks a row really has (<= split)."""
    ch = ceil_div(ceil_div(cols, split), v) * v
    return ch, ceil_div(ch, nt * v), ceil_div(cols, ch)


def default(card: Card, hw: Hardware) -> Knobs:
    rows, cols = _shape(card)
    by_algo = {s["algo"][0]: s for s in spaces(card, hw)}
    vec = _vecs(card, cols)[-1]
    if "split_regs" in by_algo and rows < 2 * hw.sm_count:
        # >= 4 blocks per SM in each kernel, then ~16 values (IT = 4 fp32 16-byte loads) per
        # thread: the whole tensor is in flight at once, loads issued before any arithmetic.
        s = by_algo["split_regs"]
        split = next((v for v in s["split"] if rows * v >= 4 * hw.sm_count), s["split"][-1])
        return {"algo": "split_regs", "split": split, "threads": pick(s["threads"], ceil_div(cols, split) / 16),
                "vec": vec, **({"pdl": False} if "pdl" in s else {})}
    if "split" in by_algo and rows < 2 * hw.sm_count:
        s = by_algo["split"]
        return {"algo": "split", "split": pick(s["split"], 4 * hw.sm_count / rows), "threads": 256, "vec": vec}
    if "warp" in by_algo and cols <= 1024:
        return {"algo": "warp", "warps": 4, "rows": 1, "vec": vec}
    if "block_regs" in by_algo:
        return {"algo": "block_regs", "threads": pick(by_algo["block_regs"]["threads"], cols // 16), "vec": vec}
    algo = "block_smem" if "block_smem" in by_algo else "block_online"
    return {"algo": algo, "threads": pick(by_algo[algo]["threads"], 512), "vec": vec}


def build(card: Card, knobs: Knobs, hw: Hardware):
    rows, cols = _shape(card)
    x, out = card.args[0].tensor, card.outputs[0]
    algo, v = knobs["algo"], knobs["vec"]
    log = card.op in LOG_OPS
    types = constants(Tin=ctype(x.dtype), Tout=ctype(out.dtype))
    io = [{"in": 0}, {"out": 0}]
    if algo in ("warp", "block_regs"):
        warp = algo == "warp"
        nt = 32 * knobs["warps"] if warp else knobs["threads"]
        per_block = knobs["warps"] * knobs["rows"] if warp else 1
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, LANES=32 if warp else nt,
                           ROWS=knobs["rows"] if warp else 1)
        red = ("kf_warp_max", "kf_warp_sum") if warp else (f"kf_block_max<{nt}>", f"kf_block_sum<{nt}>")
        body = "\n".join([types, consts, render(sources.REGS, MAX=red[0], SUM=red[1])])
        kernels = [launch("kf_softmax", [ceil_div(rows, per_block)], [nt], io)]
        ws = []
    elif algo in ("block_online", "block_smem"):
        nt = knobs["threads"]
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log)
        smem = algo == "block_smem"
        body = "\n".join([types, consts, sources.ONLINE, sources.BLOCK_SMEM if smem else sources.BLOCK_ONLINE])
        kernels = [launch("kf_softmax", [rows], [nt], io, smem=cols * x.itemsize if smem else 0)]
        ws = []
    elif algo == "split_regs":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        pdl = knobs.get("pdl", False)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it, PDL=pdl)
        body = "\n".join([types, consts, sources.CHUNKS, sources.COMBINE, sources.SPLIT_REGS])
        kernels = [launch("kf_softmax_partial", [s, rows], [nt], [{"in": 0}, {"ws": 0}]),
                   launch("kf_softmax_finish", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}], pdl=pdl)]
        ws = [rows * s * 2 * 4]
    elif algo == "split_cluster":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it)
        body = "\n".join([types, consts, sources.CHUNKS, sources.SPLIT_CLUSTER])
        kernels = [launch("kf_softmax_cluster", [s, rows], [nt], io, cluster=s)]
        ws = []
    elif algo == "split_coop":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        wait, wait_ws = group_wait_workspace(rows, s)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it, **wait)
        body = "\n".join([types, consts, sources.CHUNKS, GROUP_WAIT, sources.COMBINE, sources.SPLIT_COOP])
        kernels = [launch("kf_softmax_coop", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}], cooperative=True)]
        ws = [wait_ws]
    else:
        nt, s = knobs["threads"], knobs["split"]
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s)
        body = "\n".join([types, consts, sources.ONLINE, sources.SPLIT])
        kernels = [launch("kf_softmax_partial", [s, rows], [nt], [{"in": 0}, {"ws": 0}]),
                   launch("kf_softmax_finish", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}])]
        ws = [rows * s * 2 * 4]
    return candidate("softmax", card, knobs, {x.dtype, out.dtype}, body, kernels, ws)


TEMPLATE = Template("softmax", OPS, check, spaces, default, build)
