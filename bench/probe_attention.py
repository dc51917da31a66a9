"""Which way of computing attention is fastest for a given shape (run on the GPU): SDPA as
eager picks its backend, each backend forced, and the plain decomposition (one matmul for the
scores with the scale folded in, a softmax, one matmul for the output), all in one
interleaved run (GPU time, median, L2 flushed before every rep): with bf16 scores, and as
kforge.attention rewrites it (fp32 scores, softmax in fp32, probabilities cast to bf16). Also
each piece of the bf16 decomposition alone, and each result's largest error against an fp32 reference.

SDPA's flash kernel takes head dims up to 256; beyond that eager runs the memory-efficient
kernel, whose speed at head dim 512 (the SD VAE's single-head attention) is the question.

    python bench/probe_attention.py [--out bench/results/probe_attention_h200.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "bench")]

from kforge import attention, timing  # noqa: E402
from provenance import provenance  # noqa: E402

SHAPES = [(1, 1, 16384, 512), (1, 1, 4096, 512), (1, 8, 4096, 128), (2, 8, 4096, 256), (1, 1, 16384, 256)]


def decomposed_bf16(q, k, v):
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    scores = torch.baddbmm(torch.empty(b * h, s, s, dtype=q.dtype, device=q.device), q3, k3.transpose(1, 2),
                           beta=0.0, alpha=1.0 / math.sqrt(d))
    return torch.bmm(torch.softmax(scores, -1), v3).view(b, h, s, d)


def probe(shape: tuple[int, int, int, int]) -> dict:
    """Every way timed on one shape, interleaved; the rows of the result file."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    runs = {"sdpa (eager's pick)": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        def fn(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v)
        try:
            fn()
            torch.cuda.synchronize()
            runs[f"sdpa {name}"] = fn
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape
            print(f"{shape} {name}: {str(e).splitlines()[0][:120]}")
    runs["decomposed, bf16 scores"] = lambda: decomposed_bf16(q, k, v)
    runs["kforge.attention (fp32 scores)"] = lambda: attention.decomposed(q, k, v, d ** -0.5)
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    sc = torch.empty(b * h, s, s, dtype=q.dtype, device="cuda")
    runs["piece: scores baddbmm"] = lambda: torch.baddbmm(sc, q3, k3.transpose(1, 2), beta=0.0, alpha=0.1)
    runs["piece: softmax"] = lambda: torch.softmax(sc, -1)
    runs["piece: P @ V"] = lambda: torch.bmm(sc, v3)
    errs = {}
    for name, fn in runs.items():
        if not name.startswith("piece"):
            errs[name] = float((fn().float() - ref).abs().max())
    ms = timing.time_fns(list(runs.values()), min_reps=20, min_ms=100.0)
    rows = {name: {"median_us": m.median, "iqr_us": m.iqr, "max_abs_err": errs.get(name)}
            for name, m in zip(runs, ms)}
    for name, r in rows.items():
        err = "" if r["max_abs_err"] is None else f"  max err {r['max_abs_err']:.2e}"
        print(f"{str(shape):20s} {name:24s} {r['median_us']:9.1f} us (iqr {r['iqr_us']:.1f}){err}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "probe_attention_h200.json"))
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for shape in SHAPES:
        rows = probe(shape)
        torch.cuda.empty_cache()
        results.append({"shape": list(shape), "dtype": "bfloat16", "rows": rows})
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
