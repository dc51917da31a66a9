"""Normalizations on the GPU: the hand-written templates against the code generator's
gen_norm kernel on the same single-op cards (a knob sweep for each source alone), and the
norm regions models have (generated only: no template takes a region), each against eager
and torch.compile. The single-op table is the evidence for keeping or deleting a template:
a template stays where it is faster than the generated kernel.

    python bench/bench_norms.py [--out bench/results/norms_h200.json] [--budget 24] [--no-compile] [--only NAME]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT / "examples")]

import bench_builtin  # noqa: E402
import bench_regions  # noqa: E402
from builtin_cards import BF16, F16, bn, gn, ln, meta, rms, softmax  # noqa: E402
from norm_models import (AddLayerNormGelu, AddRMSNorm, BatchNormAddReluMean, BatchNormReluAdd,  # noqa: E402
                         ClassTokenOfPatches, GeluMul, GroupNormSilu, MaskSoftmax, SqueezeExcite)
from gemma_decoder import RMSNorm as GemmaRMSNorm  # noqa: E402
from kforge import timing  # noqa: E402
from kforge.capturing import capture  # noqa: E402
from kforge.card_files import load_sample  # noqa: E402
from kforge.cards import faithful_clone  # noqa: E402
from kforge.hardware import current  # noqa: E402
from kforge.proposers.builtin import batch_norm, generated, group_norm, layer_norm, rms_norm  # noqa: E402
from kforge.proposers.builtin import softmax as softmax_t  # noqa: E402

# name -> (card, the template family that takes it)
CARDS = {
    "softmax 1x8x2048x2048 fp32": (lambda: softmax(1, 8, 2048, 2048), softmax_t.TEMPLATE),
    "softmax 16384x128 fp32": (lambda: softmax(16384, 128), softmax_t.TEMPLATE),
    "softmax 4096x32000 bf16": (lambda: softmax(4096, 32000, dtype=BF16), softmax_t.TEMPLATE),
    "log_softmax 4096x32000 fp32": (lambda: softmax(4096, 32000, log=True), softmax_t.TEMPLATE),
    "layer_norm 16384x768 fp32": (lambda: ln(16384, 768), layer_norm.TEMPLATE),
    "layer_norm 8192x4096 bf16": (lambda: ln(8192, 4096, BF16), layer_norm.TEMPLATE),
    "rms_norm 8192x4096 bf16": (lambda: rms(8192, 4096, BF16), rms_norm.TEMPLATE),
    "rms_norm 8192x2304 bf16 (gemma)": (lambda: rms(8192, 2304, BF16), rms_norm.TEMPLATE),
    "group_norm 2x512x64x64 fp16": (lambda: gn(2, 512, 64, 64, 32, F16), group_norm.TEMPLATE),
    "group_norm 1x128x256x256 fp32 channels_last": (lambda: gn(1, 128, 256, 256, 32, channels_last=True),
                                                    group_norm.TEMPLATE),
    "batch_norm 32x256x56x56 bf16": (lambda: bn(meta(32, 256, 56, 56, dtype=BF16), stats_dtype=torch.float32),
                                     batch_norm.TEMPLATE),
}












def _cuda(*shape, dtype=torch.float32, channels_last=False):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    return x.to(memory_format=torch.channels_last) if channels_last else x


# name -> (module, inputs): the Gemma, Llama, SD-VAE and ResNet chains at their model shapes
REGIONS = {
    "gemma mask softmax bf16 1x8x2048x2048": (MaskSoftmax, lambda: (_cuda(1, 8, 2048, 2048, dtype=BF16),
                                                                      _cuda(1, 1, 2048, 2048, dtype=BF16))),
    "add rms_norm bf16 1x2048x2304": (lambda: AddRMSNorm(2304).to(BF16), lambda: (_cuda(1, 2048, 2304, dtype=BF16),
                                                                                  _cuda(1, 2048, 2304, dtype=BF16))),
    "add layer_norm gelu fp32 8x512x768": (lambda: AddLayerNormGelu(768), lambda: (_cuda(8, 512, 768), _cuda(8, 512, 768))),
    "sd-vae group_norm silu 1x512x64x64 fp32": (lambda: GroupNormSilu(512, 32), lambda: (_cuda(1, 512, 64, 64),)),
    "sd-vae group_norm silu bf16 1x512x128x128": (lambda: GroupNormSilu(512, 32).to(BF16),
                                                  lambda: (_cuda(1, 512, 128, 128, dtype=BF16),)),
    "sd-vae group_norm silu 1x256x256x256 channels_last": (
        lambda: GroupNormSilu(256, 32), lambda: (_cuda(1, 256, 256, 256, channels_last=True),)),
    # EfficientNet-B0's squeeze-and-excite, channels-last: batch norm -> SiLU written beside its mean
    "efficientnet se bn silu mean bf16 64x32x112x112 channels_last": (
        lambda: SqueezeExcite(32).eval().to(BF16), lambda: (_cuda(64, 32, 112, 112, dtype=BF16, channels_last=True),)),
    "efficientnet se bn silu mean bf16 64x144x56x56 channels_last": (
        lambda: SqueezeExcite(144).eval().to(BF16), lambda: (_cuda(64, 144, 56, 56, dtype=BF16, channels_last=True),)),
    "efficientnet se bn silu mean bf16 64x672x14x14 channels_last": (
        lambda: SqueezeExcite(672).eval().to(BF16), lambda: (_cuda(64, 672, 14, 14, dtype=BF16, channels_last=True),)),
    "resnet bn add relu mean bf16 32x2048x7x7 channels_last": (
        lambda: BatchNormAddReluMean(2048).eval().to(BF16),
        lambda: (_cuda(32, 2048, 7, 7, dtype=BF16, channels_last=True), _cuda(32, 2048, 7, 7, dtype=BF16, channels_last=True))),
    "resnet bn relu add bf16 32x256x56x56 channels_last": (
        lambda: BatchNormReluAdd(256).eval().to(BF16),
        lambda: (_cuda(32, 256, 56, 56, dtype=BF16, channels_last=True),
                 _cuda(32, 256, 56, 56, dtype=BF16, channels_last=True))),
    # ResNet's stem after its convolution: a pooling with a prologue (gen_window_tile)
    "resnet stem bn relu maxpool bf16 32x64x112x112": (
        lambda: torch.nn.Sequential(torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)).eval().to(BF16),
        lambda: (_cuda(32, 64, 112, 112, dtype=BF16),)),
    # the same as kforge.optimize runs it: convolution networks go channels-last (kforge.layout)
    "resnet stem bn relu maxpool bf16 32x64x112x112 channels_last": (
        lambda: torch.nn.Sequential(torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)).eval().to(BF16),
        lambda: (_cuda(32, 64, 112, 112, dtype=BF16, channels_last=True),)),
    # Gemma's RMS norm as examples/gemma_decoder.py writes it: fp32 inside, (1 + weight), cast back
    "gemma rms_norm bf16 1x2048x2048": (lambda: GemmaRMSNorm(2048).to(BF16), lambda: (_cuda(1, 2048, 2048, dtype=BF16),)),
    # Gemma's MLP gate: gelu(tanh) of one matmul's output times the other's
    "gemma gelu mul bf16 2048x16384": (GeluMul, lambda: (_cuda(2048, 16384, dtype=BF16), _cuda(2048, 16384, dtype=BF16))),
    # ViT-B/16's tokens: class token, NCHW patches read transposed (gen_tile), position embedding
    "vit class token patches bf16 32x768x14x14": (lambda: ClassTokenOfPatches(768, 196).to(BF16),
                                                  lambda: (_cuda(32, 768, 14, 14, dtype=BF16),)),
}


def card_rows(only, budget: int, with_compile: bool) -> list[dict]:
    hw = current()
    rows = []
    for name, (make, template) in CARDS.items():
        if only and not any(part in name for part in only):
            continue
        card = make()
        t = bench_builtin.run_case(f"{name} [template]", card, None, hw, budget, with_compile, (template,))
        g = bench_builtin.run_case(f"{name} [generated]", card, None, hw, budget, with_compile, (generated.TEMPLATE,))
        rows.append({"name": name, "card": card.summary(), "eager_us": t["eager_us"], "compile_us": t["compile_us"],
                     "template_us": t["kernel_us"], "generated_us": g["kernel_us"], "floor_us": t["floor_us"],
                     "template_knobs": t["knobs"], "generated_knobs": g["knobs"],
                     "generated_over_template": (g["kernel_us"] / t["kernel_us"]
                                                 if g["kernel_us"] and t["kernel_us"] else None),
                     "template": t, "generated": g})
    return rows


def region_rows(only, budget: int, with_compile: bool) -> list[dict]:
    hw = current()
    rows = []
    for name, (model, make_inputs) in REGIONS.items():
        if only and not any(part in name for part in only):
            continue
        run_dir = Path(tempfile.mkdtemp(prefix="kforge-norms-"))
        with torch.no_grad():
            r = capture(model().cuda(), make_inputs(), run_dir, regions=True)
        for card in [c for c in r.cards if c.region is not None]:
            ins = load_sample(card, run_dir, device="cuda")[0] if card.samples else card.random_inputs(0, "cuda")
            print(f"{name}: {'+'.join(card.region.ops)}: sweeping")
            best, _, n, tried = bench_builtin.sweep(card, hw, ins, budget, (generated.TEMPLATE,))
            fns = [lambda: card.call_eager(ins, "cuda")]
            if best is not None:
                fns.append(bench_builtin.Runner(card, best, [faithful_clone(t) for t in ins]))
            if with_compile:  # compiled afresh and warmed in the grad mode it is timed in: a grad-mode
                torch._dynamo.reset()  # guard miss each call, over the cases, hit dynamo's recompile limit and ran eager
                compiled = torch.compile(bench_regions.region_fn(card))
                with torch.no_grad():
                    compiled(*ins)
                fns.append(lambda: compiled(*ins))
            with torch.no_grad():
                ms = timing.time_fns(fns, device=torch.device("cuda"))
            kernel_us = ms[1].median if best is not None else None
            row = {"name": name, "ops": card.region.ops, "eager_us": ms[0].median, "kernel_us": kernel_us,
                   "compile_us": ms[-1].median if with_compile else None, "floor_us": hw.floor_us(card.io_bytes()),
                   "knobs": best.knobs if best else None, "candidates": n, "tried": tried}
            rows.append(row)
            print(f"  eager {row['eager_us']:.1f} us, kernel {kernel_us or float('nan'):.1f} us, "
                  f"compile {row['compile_us'] or float('nan'):.1f} us, floor {row['floor_us']:.1f} us")
    return rows


def print_tables(cards: list[dict], regions: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    f = lambda v, fmt=".1f": format(v, fmt) if v is not None else "-"  # noqa: E731
    t = Table(title="single-op norm cards: template vs generated (GPU time, median, us)")
    for col in ("case", "eager", "compile", "template", "generated", "gen/template", "floor"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in cards:
        t.add_row(r["name"], f(r["eager_us"]), f(r["compile_us"]), f(r["template_us"]), f(r["generated_us"]),
                  f(r["generated_over_template"], ".2f"), f(r["floor_us"]))
    Console().print(t)
    t = Table(title="norm regions: one generated kernel vs eager and torch.compile (GPU time, median, us)")
    for col in ("region", "ops", "eager", "compile", "kernel", "floor"):
        t.add_column(col, justify="left" if col in ("region", "ops") else "right")
    for r in regions:
        t.add_row(r["name"], "+".join(r["ops"])[:50], f(r["eager_us"]), f(r["compile_us"]), f(r["kernel_us"]),
                  f(r["floor_us"]))
    Console().print(t)


def main(argv=None) -> int:
    opts = bench_builtin.options(argv, __doc__, "norms_h200.json", 24)
    if opts is None:
        return 2
    only = [part for part in opts.only.split("|") if part]
    start = time.perf_counter()
    cards = card_rows(only, opts.budget, not opts.no_compile)
    regions = region_rows(only, opts.budget, not opts.no_compile)
    out = bench_builtin.save(opts.out, cards + regions, opts.budget, current(), start)
    print_tables(cards, regions)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
