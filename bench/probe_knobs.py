"""Generated kernels over a knob grid against eager (run on the GPU), at KernelBench level 1's
scaled shapes where the built-in proposer ties eager: which knobs, if any, beat eager, and in
which timing. Two timings, each interleaved with eager:

  flushed    kforge.timing.time_fns: L2 flushed before every rep, one event pair per call
  as called  kforge.timing.time_as_called: back-to-back calls, warm L2, as the search's
             dispatch decision times them

    python bench/probe_knobs.py [--out bench/results/probe_knobs_h200.json] [--only NAME] [--max 48]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_builtin import Runner, correct, eager_fn  # noqa: E402
from builtin_cards import A, fresh_inputs, make_card, meta  # noqa: E402
from kforge import timing  # noqa: E402
from kforge.cards import faithful_clone  # noqa: E402
from kforge.errors import KforgeError  # noqa: E402
from kforge.hardware import current  # noqa: E402
from kforge.proposers.builtin import generated, space  # noqa: E402
from provenance import provenance  # noqa: E402

KB = (64, 393216)  # level 1's elementwise problems at batch 64 (100 MB of fp32)
CASES = {
    "relu 64x393216 fp32": lambda: make_card(A.relu.default, meta(*KB)),
    "sigmoid 64x393216 fp32": lambda: make_card(A.sigmoid.default, meta(*KB)),
    "gelu 64x393216 fp32": lambda: make_card(A.gelu.default, meta(*KB)),
    "hardtanh 64x393216 fp32": lambda: make_card(A.hardtanh.default, meta(*KB)),
    "mean dim 1 2x4096x4095 fp32": lambda: make_card(A.mean.dim, meta(2, 4096, 4095), [1]),
    "sum dim 1 2x4096x4095 fp32": lambda: make_card(A.sum.dim_IntList, meta(2, 4096, 4095), [1], True),
    "cumsum dim 1 1024x32768 fp32": lambda: make_card(A.cumsum.default, meta(1024, 32768), 1),
    # rows of an odd length (KernelBench's L1 and L2 norms): peeled vectors against one element at a time
    "softmax 512x65535 fp32": lambda: make_card(A._softmax.default, meta(512, 65535), 1, False),
    # level 1's 2-D average pool (3x3 at stride 3): windows that do not overlap, read once
    "avg_pool2d 3x3 1x8x2048x2048 fp32": lambda: make_card(A.avg_pool2d.default, meta(1, 8, 2048, 2048), [3, 3]),
    # level 1's 1-D average pool (8 wide, stride 1, padding 4) as it reaches CUDA: one-row planes
    "avg_pool1d 8 4x128x65536 fp32": lambda: make_card(A.avg_pool2d.default, meta(4, 128, 1, 65536), [1, 8], [1, 1],
                                                       [0, 4]),
    # tensors of different widths (an LLM's causal mask compares int64 positions; its casts narrow fp32):
    # 16-byte accesses of the widest tensor (the default) against wider vectors in 16-byte pieces
    "le int64 -> bool 2048x2048": lambda: make_card(A.le.Tensor, meta(2048, 2048, dtype=torch.int64),
                                                    meta(2048, 2048, dtype=torch.int64)),
    "to_copy fp32 -> bf16 4096x4096": lambda: make_card(A._to_copy.default, meta(4096, 4096), dtype=torch.bfloat16),
    # level 1's 1-D max pool (8 wide, stride 1, padding 4, dilation 3), with its indices
    "max_pool1d 8 dil 3 2x192x65536 fp32": lambda: make_card(A.max_pool2d_with_indices.default, meta(2, 192, 1, 65536),
                                                             [1, 8], [1, 1], [0, 4], [1, 3]),
}


def grid(card, hw, most: int, rng: random.Random) -> list[dict]:
    """The default first, then up to `most` - 1 other settings drawn from the knob spaces: half of
    them at the default's vector width, the rest taking the other widths in turn."""
    first = generated.default(card, hw)
    every = [k for sp in generated.spaces(card, hw) for k in space.configs(sp) if k != first]
    rng.shuffle(every)
    same = [k for k in every if k.get("vec") == first.get("vec")]
    by_width: dict = {}
    for k in every:
        if k.get("vec") != first.get("vec"):
            by_width.setdefault(k.get("vec"), []).append(k)
    others = [k for turn in itertools.zip_longest(*by_width.values()) for k in turn if k is not None]
    take = same[:max((most - 1) // 2, most - 1 - len(others))]
    return [first] + (take + others)[:most - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "probe_knobs_h200.json"))
    ap.add_argument("--only", default="")
    ap.add_argument("--max", type=int, default=48, help="settings per card, the default included")
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    hw, rng, rows = current(), random.Random(0), []
    for name, make in CASES.items():
        if opts.only and not any(p in name for p in opts.only.split("|")):
            continue
        card = make()
        inputs = fresh_inputs(card, 0)
        runs, knobs = [eager_fn(card, [faithful_clone(t) for t in inputs])], [None]
        for k in grid(card, hw, opts.max, rng):
            try:
                cand = generated.build(card, k, hw)
                if correct(card, cand, inputs):
                    runs.append(Runner(card, cand, [faithful_clone(t) for t in inputs]))
                    knobs.append(k)
            except KforgeError as e:
                print(f"  {k}: {str(e).splitlines()[0][:120]}")
        flushed = timing.time_fns(runs, min_reps=30, min_ms=20.0)
        called = timing.time_as_called([(contextlib.nullcontext, f) for f in runs])
        row = {"name": name, "card": card.summary(), "floor_us": hw.floor_us(card.io_bytes()), "settings": []}
        for k, f, c in zip(knobs, flushed, called):
            row["settings"].append({"knobs": k, "flushed_us": f.median, "flushed_iqr_us": f.iqr,
                                    "as_called_us": c.median, "as_called_iqr_us": c.iqr})
        e = row["settings"][0]
        best_f = min(row["settings"][1:], key=lambda s: s["flushed_us"], default=None)
        best_c = min(row["settings"][1:], key=lambda s: s["as_called_us"], default=None)
        print(f"{name}: floor {row['floor_us']:.1f}; eager {e['flushed_us']:.1f} flushed / {e['as_called_us']:.1f} "
              f"as called; {len(knobs) - 1} settings")
        for label, b, key in (("flushed", best_f, "flushed_us"), ("as called", best_c, "as_called_us")):
            if b:
                print(f"  best {label}: {b[key]:.1f} us (eager {e[key]:.1f}) {b['knobs']}")
        if len(row["settings"]) > 1:
            print(f"  default: {row['settings'][1]['flushed_us']:.1f} flushed / {row['settings'][1]['as_called_us']:.1f} "
                  f"as called")
        rows.append(row)
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**provenance(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
