"""A run directory's cards/ folder: cards/<id>/card.json and its samples (safetensors, never
pickle), each written to a temporary file first and then moved into place."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .cards import Card, pack, unpack
from .errors import CardError


def card_dir(run_dir: str | Path, cid: str) -> Path:
    return Path(run_dir) / "cards" / cid


def save_card(card: Card, run_dir: str | Path) -> Path:
    d = card_dir(run_dir, card.id)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "card.json.tmp"
    tmp.write_text(json.dumps(card.to_json(), indent=1))
    tmp.replace(d / "card.json")
    return d


def save_sample(card: Card, run_dir: str | Path, index: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Path:
    """Store one sample set: inputs as seen before the call, outputs after it."""
    from safetensors.torch import save_file

    tensors = {f"in{i}": pack(t) for i, t in enumerate(inputs)}
    tensors.update({f"out{j}": pack(t) for j, t in enumerate(outputs)})
    path = card_dir(run_dir, card.id) / f"sample{index}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"card": card.id})
    tmp.replace(path)
    return path


def load_card(run_dir: str | Path, cid: str) -> Card:
    path = card_dir(run_dir, cid) / "card.json"
    try:
        return Card.from_json(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise CardError(f"no card {cid} in {run_dir}: run `kforge capture` first") from e
    except (ValueError, KeyError) as e:
        raise CardError(f"card {path} is corrupt ({e}); capture again") from e


def load_cards(run_dir: str | Path) -> list[Card]:
    root = Path(run_dir) / "cards"
    cards = [load_card(run_dir, p.name) for p in sorted(root.iterdir()) if (p / "card.json").exists()] if root.exists() else []
    return sorted(cards, key=lambda c: -(c.share or 0.0))


def load_sample(card: Card, run_dir: str | Path, index: int = 0, device="cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(inputs, reference outputs) of a stored sample, rebuilt with their strides and alignment."""
    from safetensors.torch import load_file

    path = card_dir(run_dir, card.id) / f"sample{index}.safetensors"
    if not path.exists():
        raise CardError(f"card {card.id} has no sample {index} in {run_dir}")
    data = load_file(str(path))
    ins = [unpack(data[f"in{i}"], m, device) for i, m in enumerate(card.inputs)]
    outs = [unpack(data[f"out{j}"], m, device) for j, m in enumerate(card.outputs)]
    return ins, outs
