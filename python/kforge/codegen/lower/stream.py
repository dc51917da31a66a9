"""Pointwise over flat contiguous tensors through Hopper's bulk copy engine (`gen_stream`, sm_90+).

A persistent grid; each block walks chunks of `chunk` elements. One thread copies every streamed
input's chunk into one of `stages` shared-memory stages with `cp.async.bulk` (completing on the
stage's mbarrier); the block's threads compute the chunk in shared memory, `vec` elements a
thread at a time; the thread then copies the outputs back with bulk stores and refills the stage
it stored one chunk before (once that store has read it). A block keeps `stages` chunks of loads
in flight, far more bytes than a thread's one or two vectors, which is what a copy needs to come
near the memory's bandwidth. The elements past the last whole chunk (fewer than `chunk`) are
computed by the last block straight from global memory.

The copy-engine calls are small inline functions; the CPU emulator of the tests (which defines
KF_EMULATED_BULK) supplies its own, so the chunk walk, the stages and the tail run there too."""

from __future__ import annotations

from ..ir import Program
from .emit import CTYPE, Built, Emitter, _header, _index_type, _pointers, convert, fast_nodes, vector_fits
from .pointwise import pointwise_layout

BULK = r"""
#ifndef KF_EMULATED_BULK
__device__ __forceinline__ unsigned kf_sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void kf_mbar_init(unsigned long long* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(kf_sa(b)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void kf_mbar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(kf_sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void kf_mbar_wait(unsigned long long* b, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(kf_sa(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void kf_bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(kf_sa(dst)), "l"(src), "r"(bytes), "r"(kf_sa(b)) : "memory");
}
__device__ __forceinline__ void kf_bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(kf_sa(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void kf_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// every store but the last committed one has read its shared memory
__device__ __forceinline__ void kf_bulk_read_but_last() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
__device__ __forceinline__ void kf_bulk_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// the threads' shared-memory writes, before the copy engine reads them
__device__ __forceinline__ void kf_async_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif
"""

SMEM_MAX = 200 * 1024  # a block's stages at most (an SM has 228 KB)
STAGES = (2, 3, 4)


def _streamed(prog: Program) -> tuple[list[int], list[int], list[int]] | None:
    """(streamed inputs, inputs read once as a value, written outputs) where the form applies:
    one flat contiguous layout (no parts), every tensor either contiguous with 16-byte aligned
    chunks or (an input) one broadcast value."""
    if prog.parts:
        return None
    sizes, strides = pointwise_layout(prog)
    if len(sizes) != 1:
        return None
    no = len(prog.outputs)
    for j, m in enumerate(prog.outputs):
        if m.numel and (strides[j][0] != 1 or not vector_fits(16 // m.itemsize, m, strides[j], 0, prog.out_offset(j))):
            return None
    streamed, hoisted = [], []
    for k, i in enumerate(sorted(prog.in_strides)):
        st, m = strides[no + k], prog.inputs[i]
        if not st[0]:
            hoisted.append(i)
        elif st[0] == 1 and vector_fits(16 // m.itemsize, m, st, 0, prog.offset(i)):
            streamed.append(i)
        else:
            return None
    return streamed, hoisted, [j for j, m in enumerate(prog.outputs) if m.numel]


def stream_chunks(prog: Program, sm_count: int) -> tuple[int, ...]:
    """Legal chunk sizes (elements): at least one chunk an SM, every stage's bytes a multiple of
    16 and the stages of the widest setting within SMEM_MAX. Empty where the form does not apply."""
    got = _streamed(prog)
    if got is None:
        return ()
    numel = pointwise_layout(prog)[0][0]
    streamed, _, outs = got
    per = sum(prog.inputs[i].itemsize for i in streamed) + sum(prog.outputs[j].itemsize for j in outs)
    return tuple(c for c in (1024, 2048, 4096, 8192) if numel // c >= sm_count and max(STAGES) * c * per <= SMEM_MAX)


def lower_stream(prog: Program, knobs: dict, sm_count: int, max_threads_per_sm: int = 2048) -> Built:
    nt, chunk, stages = knobs["threads"], knobs["chunk"], knobs["stages"]
    streamed, hoisted, outs = _streamed(prog)
    numel = pointwise_layout(prog)[0][0]
    widest = max([prog.inputs[i].itemsize for i in streamed] + [prog.outputs[j].itemsize for j in outs])
    v = 16 // widest
    params, args, ptr = _pointers(prog)
    idx = _index_type(prog, 2 * chunk)
    # a stage: each streamed input's chunk, then each output's, in that order
    place, at = {}, 0
    for key, size in [(("in", i), prog.inputs[i].itemsize) for i in streamed] + [(("out", j), prog.outputs[j].itemsize)
                                                                                   for j in outs]:
        place[key], at = at, at + chunk * size
    stage = at
    smem = stages * stage
    n_chunks = numel // chunk
    per_sm = max(1, min(max_threads_per_sm // nt, (228 * 1024) // (smem + 1024)))
    resident = sm_count * per_sm
    grid = -(-n_chunks // -(-n_chunks // resident))  # every block the same number of chunks, give or take one

    def load(i, stored):
        return f"h{i}" if i in hoisted else f"x{i}[j]"
    em = Emitter("v", {}, load, fast_nodes(prog, prog.results))
    res = [em(e) for e in prog.results]
    compute = [*[f"      {line}" for line in em.lines],
               *[f"      r{j}[j] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in outs]]
    decl = [*[f"    {CTYPE[prog.inputs[i].dtype]} x{i}[V];" for i in streamed],
            *[f"    {CTYPE[prog.outputs[j].dtype]} r{j}[V];" for j in outs]]
    sm = {key: f"reinterpret_cast<{'const ' if key[0] == 'in' else ''}{CTYPE[(prog.inputs if key[0] == 'in' else prog.outputs)[key[1]].dtype]}*>"
               f"(kf_smem + s_ * {stage} + {off})" for key, off in place.items()}
    src = "\n".join([
        BULK,
        f"typedef {idx} kf_idx;",
        f"constexpr int NT = {nt}; constexpr int V = {v}; constexpr int S = {stages}; constexpr int E = {chunk};",
        f"constexpr kf_idx NCH = {n_chunks}; constexpr kf_idx NUMEL = {numel};",
        f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
        "  extern __shared__ __align__(128) unsigned char kf_smem[];",
        "  __shared__ __align__(8) unsigned long long kf_mbar[S];",
        *[f"  const {CTYPE[prog.inputs[i].dtype]} h{i} = {ptr[i]}[0];" for i in hoisted],
        *[f"  out{j} += {prog.out_offset(j)};" for j in outs if prog.out_offset(j)],
        # thread 0: chunk c's loads into stage s, all completing on the stage's barrier
        "  auto issue = [&](int s_, kf_idx c) {",
        f"    kf_mbar_expect(&kf_mbar[s_], {stage - sum(prog.outputs[j].itemsize for j in outs) * chunk}u);",
        *[f"    kf_bulk_load(kf_smem + s_ * {stage} + {place[('in', i)]}, {ptr[i]} + c * E, "
          f"{chunk * prog.inputs[i].itemsize}u, &kf_mbar[s_]);" for i in streamed],
        "  };",
        "  if (threadIdx.x == 0) {",
        "    for (int s_ = 0; s_ < S; ++s_) kf_mbar_init(&kf_mbar[s_]);",
        "    for (int s_ = 0; s_ < S; ++s_)",
        "      if (blockIdx.x + (kf_idx)s_ * gridDim.x < NCH) issue(s_, blockIdx.x + (kf_idx)s_ * gridDim.x);",
        "  }",
        "  __syncthreads();",
        "  int n_ = 0;",
        "  for (kf_idx c = blockIdx.x; c < NCH; c += gridDim.x, ++n_) {",
        "    const int s_ = n_ % S;",
        "    kf_mbar_wait(&kf_mbar[s_], (n_ / S) & 1);",
        *[f"    {CTYPE[prog.inputs[i].dtype]} const* xs{i} = {sm[('in', i)]};" for i in streamed],
        *[f"    {CTYPE[prog.outputs[j].dtype]}* ys{j} = {sm[('out', j)]};" for j in outs],
        "    for (int q = threadIdx.x; q < E / V; q += NT) {",
        *[f"  {line}" for line in decl],
        *[f"      *reinterpret_cast<kf_vec<{CTYPE[prog.inputs[i].dtype]}, V>*>(x{i}) = "
          f"*reinterpret_cast<const kf_vec<{CTYPE[prog.inputs[i].dtype]}, V>*>(xs{i} + q * V);" for i in streamed],
        "#pragma unroll",
        "      for (int j = 0; j < V; ++j) {",
        *[f"  {line}" for line in compute],
        "      }",
        *[f"      *reinterpret_cast<kf_vec<{CTYPE[prog.outputs[j].dtype]}, V>*>(ys{j} + q * V) = "
          f"*reinterpret_cast<const kf_vec<{CTYPE[prog.outputs[j].dtype]}, V>*>(r{j});" for j in outs],
        "    }",
        "    kf_async_fence();",
        "    __syncthreads();",
        "    if (threadIdx.x == 0) {",
        *[f"      kf_bulk_store(out{j} + c * E, ys{j}, {chunk * prog.outputs[j].itemsize}u);" for j in outs],
        "      kf_bulk_commit();",
        # the stage stored one chunk ago takes the chunk S - 1 steps ahead of this one
        "      const kf_idx next = c + (kf_idx)(S - 1) * gridDim.x;",
        "      if (n_ > 0 && next < NCH) {",
        "        kf_bulk_read_but_last();",
        "        issue((n_ + S - 1) % S, next);",
        "      }",
        "    }",
        "  }",
        "  if (threadIdx.x == 0) kf_bulk_done();",
        # the elements past the last whole chunk: the last block, from global memory
        "  if (blockIdx.x != gridDim.x - 1) return;",
        "  for (kf_idx e = NCH * E + threadIdx.x; e < NUMEL; e += NT) {",
        *decl,
        *[f"    x{i}[0] = {ptr[i]}[e];" for i in streamed],
        "    for (int j = 0; j < 1; ++j) {",
        *compute,
        "    }",
        *[f"    out{j}[e] = r{j}[0];" for j in outs],
        "  }",
        "}",
    ])
    args = [{"out": prog.card_output(a["out"])} if "out" in a else a for a in args]
    return Built(_header(src), [("kf_gen", (grid,), (nt,), args, smem)], [])
