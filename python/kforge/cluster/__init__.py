"""Evaluating on a cluster: `kforge run --cluster ray` and `kforge.run(..., cluster="ray")`.

kforge does not schedule machines itself: a Ray cluster does (`pip install 'kforge[ray]'`).
The driver (the process that runs `kforge run`) keeps the search, the proposers, the LLM
budget and the run's log; each GPU of the cluster gets one Ray actor that evaluates the
candidates sent to it with the same evaluator a local GPU uses (kforge.cluster.ray_pool).
docs/cluster.md says how to start a cluster and what travels between nodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..cards import Card
from ..errors import KforgeError
from ..pool import EvaluatorFactory, EvaluatorPool


class ClusterError(KforgeError):
    """The cluster cannot be reached, has no usable GPU, or is not installed."""


def ray_address(cluster: str) -> str:
    """The address `ray.init` connects to for a --cluster value: "ray" means $RAY_ADDRESS (or
    the cluster started on this machine with `ray start --head`), "ray://HOST:PORT" a Ray
    Client endpoint."""
    if cluster == "ray":
        return os.environ.get("RAY_ADDRESS") or "auto"
    if cluster.startswith("ray://"):
        return cluster
    raise ClusterError(f"unknown cluster {cluster!r}: use 'ray' (the cluster at $RAY_ADDRESS) or 'ray://HOST:PORT'")


def open_pool(cluster: str, run_dir: Path, cards: list[Card], factory: EvaluatorFactory,
              devices: Sequence[int] | None = None) -> EvaluatorPool:
    """One evaluator slot per GPU of the cluster that matches the cards (kforge.cluster.nodes);
    raises ClusterError when none does or the cluster cannot be reached."""
    if devices:
        raise ClusterError("--devices picks GPUs of this machine; with --cluster every matching GPU of the "
                           "cluster is used: leave out --devices")
    from .ray_pool import RayPool

    return RayPool(ray_address(cluster), cluster, run_dir, cards, factory)


__all__ = ["ClusterError", "open_pool", "ray_address"]
