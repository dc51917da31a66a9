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


def check_cluster(cluster: str, devices: Sequence[int] | None = None) -> str:
    """The address to connect to for `cluster`, once the options and Ray itself are checked
    (`kforge.run` calls it before the capture, so a bad option costs no capture)."""
    if devices:
        raise ClusterError("--devices picks GPUs of this machine; with --cluster every matching GPU of the "
                           "cluster is used: leave out --devices")
    address = ray_address(cluster)
    from .ray_pool import _ray

    _ray()
    return address


def open_pool(cluster: str, run_dir: Path, cards: list[Card], factory: EvaluatorFactory,
              devices: Sequence[int] | None = None) -> EvaluatorPool:
    """One evaluator slot per GPU of the cluster that matches the cards (kforge.cluster.nodes);
    raises ClusterError when none does or the cluster cannot be reached."""
    from .ray_pool import RayPool

    return RayPool(check_cluster(cluster, devices), cluster, run_dir, cards, factory)


__all__ = ["ClusterError", "check_cluster", "open_pool", "ray_address"]
