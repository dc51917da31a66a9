"""Models nobody tuned kforge for, at inference sizes, as a model file for bench_model.py.

kforge's four example models are the ones its kernels were measured and tuned on. These are
not: each is built from its library's config with random weights (timm and transformers
classes; no download), in bf16, and UNSEEN picks one. On the GPU they run at batch sizes an
inference server would use; on the CPU, or with SMALL=1, at toy sizes so tests can import them.

    UNSEEN=vit python bench/bench_model.py bench/unseen_models.py --regions --compile --out vit.json

Needs timm (vit, swin, convnext, convnextv2, efficientnet, maxvit, densenet, nfnet) or transformers (llama, bert).
"""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1" or DEVICE == "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _timm(name: str, batch: int, size: int, small_size: int = 64, **small_kwargs):
    def model():
        import timm

        return timm.create_model(name, pretrained=False, **(small_kwargs if SMALL else {}))

    def inputs():
        b, s = (1, small_size) if SMALL else (batch, size)
        return (torch.randn(b, 3, s, s),)
    return model, inputs


def _llama_config():
    from transformers import LlamaConfig

    if SMALL:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)
    # Llama-3.2-1B's widths, two layers
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000)


def _bert_config():
    from transformers import BertConfig

    if SMALL:
        return BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                          vocab_size=256)
    return BertConfig(num_hidden_layers=4)  # BERT-base, four layers


def _llama():
    from transformers import LlamaModel

    cfg = _llama_config()
    cfg._attn_implementation, cfg.use_cache = "sdpa", False  # outputs: tensors only, no cache object
    return LlamaModel(cfg)


def _bert():
    from transformers import BertModel

    cfg = _bert_config()
    cfg._attn_implementation = "sdpa"
    return BertModel(cfg, add_pooling_layer=False)


def _tokens(config, batch: int, seq: int):
    def inputs():
        b, s = (1, 16) if SMALL else (batch, seq)
        return (torch.randint(0, config().vocab_size, (b, s)),)
    return inputs


MODELS = {"vit": _timm("vit_base_patch16_224", 32, 224, small_size=32, img_size=32),
          "swin": _timm("swin_tiny_patch4_window7_224", 32, 224, small_size=224),  # its windows need 224
          "convnext": _timm("convnext_tiny", 32, 224),
          # ConvNeXt with a global response norm in every block's MLP
          "convnextv2": _timm("convnextv2_tiny", 32, 224),
          "efficientnet": _timm("efficientnet_b0", 64, 224),
          # window and grid attention after layer norms, MBConv blocks, SDPA's masked _safe_softmax
          "maxvit": _timm("maxvit_tiny_tf_224", 32, 224, small_size=224),  # its windows need 224
          # every layer's input the cat of all feature maps before it, into a batch norm and ReLU
          "densenet": _timm("densenet121", 32, 224),
          # every convolution's weight standardized on every forward (ScaledStdConv2d): values of weights alone
          "nfnet": _timm("eca_nfnet_l0", 32, 224),
          "llama": (_llama, _tokens(_llama_config, 1, 2048)),
          "bert": (_bert, _tokens(_bert_config, 8, 512))}


def _pick() -> str:
    name = os.environ.get("UNSEEN", "")
    if name not in MODELS:
        raise ValueError(f"set UNSEEN to one of {', '.join(MODELS)} (got {name!r})")
    return name


def get_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[_pick()][0]().to(DEVICE, DTYPE).eval()


def get_inputs():
    torch.manual_seed(0)
    inputs = MODELS[_pick()][1]()
    return tuple(t.to(DEVICE, DTYPE) if t.is_floating_point() else t.to(DEVICE) for t in inputs)
