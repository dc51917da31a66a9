"""What a node of the cluster is, and whether its GPUs may evaluate a run's cards.

A kernel timed on another GPU, under another driver or against another torch's eager is no
evidence for the GPU the package is for, so a node that differs from the run's reference in
GPU model or arch, CUDA driver, torch release or kforge version is refused (left out of the
run, with the reason in the log).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable

from ..cards import Card


def node_facts() -> dict[str, Any]:
    """This process's view of its node: host, versions, driver and the GPUs it can see (a Ray
    actor holding one GPU sees that one). `hardware` is the first GPU's kforge.hardware
    profile, None without a GPU."""
    import platform
    import socket

    import torch

    from .. import __version__, cuda, hardware

    status = cuda.cuda_status()
    gpus = [{"name": d["name"], "arch": f"sm_{d['cc']}"} for d in status["devices"]]
    return {"host": socket.gethostname(), "kforge": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "driver": status["driver"], "nvrtc": status["nvrtc_version"],
            "gpus": gpus, "hardware": hardware.current(0).to_json() if gpus else None}


def release(version: str) -> str:
    """torch's release without the build tag: 2.11.0+cu130 and 2.11.0 compute the same eager."""
    return version.split("+")[0]


@dataclass
class Reference:
    """What every node must match. Fields left None are taken from the first node that
    matches the rest (so all nodes agree with one another)."""

    arch: str | None
    torch: str
    kforge: str
    gpu: str | None = None
    driver: Any = None

    @staticmethod
    def for_cards(cards: list[Card]) -> "Reference":
        """The cards' GPU arch (captured on a GPU), and this process's torch and kforge: the
        driver's eager is the one the cards were captured and are resumed with."""
        import torch

        from .. import __version__

        archs = {c.arch for c in cards if c.device_type == "cuda"}
        return Reference(arch=min(archs) if len(archs) == 1 else None, torch=release(torch.__version__),
                         kforge=__version__)

    def settle_arch(self, facts: Iterable[dict]) -> None:
        """Without cards that name an arch (a CPU capture, `kforge doctor`), the arch most of the
        GPUs have: which nodes are refused must not depend on the order Ray lists them in."""
        if self.arch is None:
            archs = collections.Counter(g["arch"] for f in facts for g in (f.get("gpus") or []) if g.get("arch"))
            if archs:
                self.arch = max(archs, key=lambda a: (archs[a], a))

    def refusal(self, facts: dict) -> str | None:
        """Why a node with `facts` may not evaluate for this reference, or None (then its
        GPU model and driver become the reference's where it had none)."""
        gpu = (facts.get("gpus") or [None])[0]
        if gpu is None:
            return "it shows no usable CUDA GPU to kforge (run `kforge doctor` on that node)"
        wrong = []
        if self.arch is not None and gpu["arch"] != self.arch:
            wrong.append(f"GPU arch {gpu['arch']} (the cards are for {self.arch})")
        if self.gpu is not None and gpu["name"] != self.gpu:
            wrong.append(f"GPU {gpu['name']} (the run times on {self.gpu})")
        if self.driver is not None and facts.get("driver") != self.driver:
            wrong.append(f"CUDA driver {facts.get('driver')} (the run's is {self.driver})")
        if release(facts.get("torch", "?")) != self.torch:
            wrong.append(f"torch {facts.get('torch')} (the run's is {self.torch})")
        if facts.get("kforge") != self.kforge:
            wrong.append(f"kforge {facts.get('kforge')} (the run's is {self.kforge})")
        if wrong:
            return "it has " + ", ".join(wrong) + ": install the same versions there, or take it out of the cluster"
        self.arch = self.arch or gpu["arch"]
        self.gpu = self.gpu or gpu["name"]
        self.driver = self.driver if self.driver is not None else facts.get("driver")
        return None


def cluster_report(address: str) -> dict:
    """`kforge doctor --cluster`: every alive node with its GPUs and, from a probe task run
    there (it takes no GPU, so a busy cluster answers too), its versions and whether a run
    from this machine would use it."""
    from .ray_pool import connect, probe_nodes

    import ray

    connect(address)
    reference = Reference.for_cards([])
    probed = probe_nodes()
    reference.settle_arch(facts for node, facts in probed if "error" not in facts and node["Resources"].get("GPU"))
    nodes = []
    for node, facts in probed:
        shown = {k: v for k, v in facts.items() if k not in ("gpus", "hardware")}
        row = {"node_id": node["NodeID"], "ip": node["NodeManagerAddress"],
               "gpus": int(node["Resources"].get("GPU", 0)), "gpus_seen": facts.get("gpus", []), **shown}
        if "error" not in facts and row["gpus"]:
            row["refused"] = reference.refusal(facts)
        nodes.append(row)
    return {"address": address, "ray": ray.__version__, "nodes": nodes}
