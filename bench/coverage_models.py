"""Which cards of models nobody tuned kforge for the built-in proposer takes, on the CPU.

Each model is built from its config with random weights (transformers and timm classes; no
download), captured with regions on the CPU, and every card retargeted to an H200 is asked
of the built-in proposer (templates and code generator). The report lists, per model, the
share of the captured time its cards cover and the cards and regions it declines with the
reason, largest share first (CPU shares: vendor ops weigh more than on a GPU).

    python bench/coverage_models.py llama convnext --out coverage.json

Needs transformers and timm (`pip install transformers timm`); no GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

from kforge.capturing import capture
from kforge.proposers.builtin import BuiltinProposer


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
          "convnext": _timm("convnext_atto", 128), "efficientnet": _timm("efficientnet_b0", 128),
          "mobilenetv3": _timm("mobilenetv3_small_100", 128), "poolformer": _timm("poolformer_s12", 128),
          "regnet": _timm("regnetx_002", 128)}


def coverage(name: str) -> dict:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        r = capture(model.eval(), inputs, Path(tmp), regions=True, max_sample_bytes=0)
    declined: dict[str, float] = collections.defaultdict(float)
    covered = total = 0.0
    for card in r.cards:
        if card.family in ("vendor", "view"):
            continue
        ok, why = BuiltinProposer().supports(card.retarget("cuda", "sm_90"))
        share = card.share or 0.0
        if card.region is None:
            total += share
            covered += share if ok else 0.0
        if not ok:
            what = "region " + "+".join(card.region.ops) if card.region is not None else card.op
            declined[f"{what}: {why}"] += share
    return {"model": name, "cards": len(r.cards), "op_share_covered": covered, "op_share": total,
            "declined": [{"what": k, "share": v} for k, v in sorted(declined.items(), key=lambda kv: -kv[1])]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}: pick from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    rows = []
    for name in args.models:
        row = coverage(name)
        rows.append(row)
        print(f"{name}: {row['cards']} cards; op cards covered {row['op_share_covered']:.2f} of {row['op_share']:.2f} "
              "of the captured time")
        for d in row["declined"][:12]:
            print(f"  {d['share']:.3f}  {d['what'][:150]}")
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "models": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
