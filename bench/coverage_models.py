"""Which cards of models nobody tuned kforge for the built-in proposer takes, on the CPU.

Each model is built from its config with random weights (transformers and timm classes; no
download), captured with regions on the CPU, and every card retargeted to an H200 is asked
of the built-in proposer (templates and code generator). The report lists, per model, the
share of the captured time its cards cover and the cards and regions it declines with the
reason, largest share first (CPU shares: vendor ops weigh more than on a GPU).

    python bench/coverage_models.py llama convnext --out coverage.json
    python bench/coverage_models.py --check        # and build what it takes

With --check, each template's default kernel for every card taken is built and compiled by
NVRTC for sm_90, and from a checkout the generated ones run on the CPU (tests/cuda_on_cpu.py:
every thread of every block, fp32 models) against the card's eager call. A failure at any step
is listed with the card and knobs; a kernel the CPU cannot run (a cooperative one) is counted apart.

Needs transformers and timm (`pip install transformers timm`); no GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from kforge import compiler
from kforge.capturing import capture
from kforge.cardtable import skip_reason
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, templates_for

TESTS = Path(__file__).resolve().parent.parent / "tests"


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1000)
    return LlamaForCausalLM(cfg), (torch.randint(0, 1000, (2, 128)),)


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                     vocab_size=1000)
    return BertModel(cfg), (torch.randint(0, 1000, (2, 128)),)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), (torch.randint(0, 1000, (2, 128)),)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    return Qwen2ForCausalLM(cfg), (torch.randint(0, 1000, (2, 128)),)


def t5():
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(d_model=256, d_ff=512, num_layers=2, num_heads=4, vocab_size=1000)
    return T5EncoderModel(cfg), (torch.randint(0, 1000, (2, 64)),)


def _timm(name: str, size: int):
    def make():
        import timm

        return timm.create_model(name, pretrained=False), (torch.randn(1, 3, size, size),)
    return make


MODELS = {"llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5,
          "vit": _timm("vit_tiny_patch16_224", 224), "swin": _timm("swin_tiny_patch4_window7_224", 224),
          "convnext": _timm("convnext_atto", 128), "convnextv2": _timm("convnextv2_atto", 128),
          "efficientnet": _timm("efficientnet_b0", 128),
          "mobilenetv3": _timm("mobilenetv3_small_100", 128), "poolformer": _timm("poolformer_s12", 128),
          "regnet": _timm("regnetx_002", 128), "mixer": _timm("mixer_s16_224", 224), "levit": _timm("levit_128s", 224),
          "ghostnet": _timm("ghostnet_100", 224), "mobilevit": _timm("mobilevit_xxs", 256),
          "edgenext": _timm("edgenext_xx_small", 256), "densenet": _timm("densenet121", 128),
          "hrnet": _timm("hrnet_w18_small", 128),  # nearest upsampling added to the finer maps
          "efficientformerv2": _timm("efficientformerv2_s0", 224),  # attention out viewed to the map, split and merged
          "nfnet": _timm("eca_nfnet_l0", 128)}  # weight standardization; ECA's gate viewed after the block's values


def _what(card) -> str:
    return "region " + "+".join(card.region.ops) if card.region is not None else card.op.split("(")[0]


def _cpu_runner():
    """tests/cuda_on_cpu.py's runner where this is a checkout with g++, else None."""
    if not (TESTS / "cuda_on_cpu.py").is_file() or shutil.which("g++") is None:
        return None
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import cuda_on_cpu

    return cuda_on_cpu.run


def check(card, run_on_cpu, counts: collections.Counter) -> list[dict]:
    """Build each template's default kernel for `card` (taken, retargeted to sm_90), compile it
    with NVRTC, and run the generated ones on the CPU against eager; the failures."""
    failures = []
    for template in templates_for(card):
        knobs, stage = None, "build"
        try:
            knobs = template.default(card, H200)
            cand = template.build(card, knobs, H200)
            cand.plan.validate(len(card.inputs), len(card.outputs))
            stage = "nvrtc"
            compiler.compile(cand.source, arch="sm_90")
            counts["compiled"] += 1
            if template.name != "generated":
                continue
            if run_on_cpu is None:
                counts["not run on the CPU (no g++, or not a checkout)"] += 1
                continue
            if any(k.cooperative for k in cand.plan.kernels):
                counts["not run on the CPU (cooperative)"] += 1
                continue
            stage = "cpu run"
            inputs = card.random_inputs(0, "cpu")
            clones = [t.clone() for t in inputs]
            want = card.region.replay(clones) if card.region is not None else card.call_eager(clones, "cpu")
            got = run_on_cpu(card, cand, inputs)
            stage = "wrong"
            assert len(got) == len(want), f"{len(got)} outputs, eager has {len(want)}"
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, equal_nan=True)
            counts["ran on the CPU, equal to eager"] += 1
        except Exception as e:  # noqa: BLE001 (every failure is the report's)
            counts[f"failed: {stage}"] += 1
            failures.append({"what": _what(card), "template": template.name, "knobs": knobs, "stage": stage,
                             "message": f"{type(e).__name__}: {e}"[:600]})
    return failures


def coverage(name: str, checking: bool = False) -> dict:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        r = capture(model.eval(), inputs, Path(tmp), regions=True, max_sample_bytes=0)
    declined: dict[str, float] = collections.defaultdict(float)
    covered = total = 0.0
    counts: collections.Counter = collections.Counter()
    failures: list[dict] = []
    run_on_cpu = _cpu_runner() if checking else None
    for card in r.cards:
        if card.family in ("vendor", "view"):
            continue
        card = card.retarget("cuda", "sm_90")
        why = skip_reason(card)  # as the search skips it (a call that resizes what it writes)
        ok, why = (False, why) if why else BuiltinProposer().supports(card)
        share = card.share or 0.0
        if card.region is None:
            total += share
            covered += share if ok else 0.0
        if not ok:
            declined[f"{_what(card)}: {why}"] += share
        elif checking:
            failures += check(card, run_on_cpu, counts)
    row = {"model": name, "cards": len(r.cards), "op_share_covered": covered, "op_share": total,
           "declined": [{"what": k, "share": v} for k, v in sorted(declined.items(), key=lambda kv: -kv[1])]}
    if checking:
        row.update(checked=dict(counts), failures=failures)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true",
                    help="build and compile each taken card's default kernels; run the generated ones on the CPU")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}: pick from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    rows = []
    for name in args.models:
        row = coverage(name, args.check)
        rows.append(row)
        print(f"{name}: {row['cards']} cards; op cards covered {row['op_share_covered']:.2f} of {row['op_share']:.2f} "
              "of the captured time")
        for d in row["declined"][:12]:
            print(f"  {d['share']:.3f}  {d['what'][:150]}")
        if args.check:
            print("  checked: " + ", ".join(f"{k} {v}" for k, v in sorted(row["checked"].items())))
            for f in row["failures"]:
                print(f"  FAILED ({f['stage']}) {f['template']} {f['knobs']} {f['what'][:100]}: {f['message'][:200]}")
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "models": rows}, indent=1) + "\n")
    return 1 if any(row.get("failures") for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
