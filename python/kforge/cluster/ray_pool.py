"""The Ray backend: one actor per GPU of the cluster, driven by the run's search threads.

What travels, and what does not:
- to an actor, once: the evaluator factory and the node-facts function (by reference: kforge
  must be installed on every node) and a key naming the run;
- per candidate: the card's JSON and the candidate's JSON (source + launch plan); back: the
  verdict's JSON. The driver writes it to the run's log: actors never touch the log;
- per card and node: the card's samples, put in Ray's object store once by the driver and
  fetched by the first actor of a node that needs them into a node-local run directory,
  where the node's other actors (and a restarted one) find them;
- never: the LLM settings or key, the proposer, the budget. Proposers run in the driver.

An actor evaluates with the same evaluator a local GPU has (kforge.runner.default_evaluator:
a worker process that owns the GPU), so a kernel that crashes or hangs kills that process,
not the actor. If the actor itself dies (its node is lost, it is killed), the candidate it
held is recorded as a runtime error and Ray restarts the actor; the search goes on.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..candidate import Candidate
from ..card_files import card_dir
from ..cards import Card
from ..errors import CardError
from ..hardware import Hardware
from ..pool import EvaluatorFactory, EvaluatorPool
from ..verdict import EvalResult, Evaluator, Verdict
from . import ClusterError, nodes

START_S = 300.0  # an actor starts a Python with torch and kforge on its node, maybe after a wheel install
REVIVE_S = 300.0  # how long a dead actor gets to come back before its slot gives up
CLOSE_S = 30.0


def _ray():
    try:
        import ray
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise ClusterError("--cluster ray needs Ray: pip install 'kforge[ray]'") from None
    return ray


def connect(address: str) -> bool:
    """Connect this process to the cluster at `address` unless it already is; True when this
    call connected (the caller then disconnects)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    try:
        # Actors' output stays in the cluster's logs: on the driver's console it would break
        # the progress view.
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {e}; start one with `ray start --head` "
                           "(and `ray start --address HEAD:6379` on the other nodes), or set RAY_ADDRESS") from None
    return True


class EvaluatorActor:
    """Runs on a node and owns one of its GPUs (Ray sets CUDA_VISIBLE_DEVICES, so it is device
    0 here). Made a Ray actor by RayPool."""

    def __init__(self, factory: EvaluatorFactory, facts: Callable[[], dict], run_key: str):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        # Keyed by node as well: nodes simulated on one machine share its disk.
        self.run_dir = Path(tempfile.gettempdir()) / "kforge-ray" / self.node_id[:16] / run_key
        self.factory, self.facts = factory, facts
        self.evaluator: Evaluator | None = None
        self.fetched: list[str] = []  # cards whose samples this actor brought to the node

    def describe(self) -> dict:
        import ray

        return {**self.facts(), "node_id": self.node_id, "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def stats(self) -> dict:
        return {"pid": os.getpid(), "node_id": self.node_id, "fetched": list(self.fetched)}

    def evaluate(self, card_json: dict, candidate_json: dict, samples: list) -> tuple[str, Any]:
        """("result", EvalResult JSON), or ("card_error", message) when the card, not the
        kernel, is at fault. `samples` holds RayPool.samples(card), in a list so that Ray
        leaves its object unfetched until a node needs it."""
        card = Card.from_json(card_json)
        self._materialize(card, *samples[0])
        if self.evaluator is None:
            self.evaluator = self.factory(self.run_dir, 0)
        try:
            return "result", self.evaluator.evaluate(card, Candidate.from_json(candidate_json)).to_json()
        except CardError as e:
            return "card_error", str(e)

    def _materialize(self, card: Card, digest: str, ref) -> None:
        """The card's sample files in the node-local run directory, fetched from the object
        store by the first actor of the node that needs them (a file lock orders the rest;
        the digest tells a stale copy from a previous capture into the same run directory)."""
        import ray

        d = card_dir(self.run_dir, card.id)
        marker = d / "shipped"
        if marker.exists() and marker.read_text() == digest:
            return
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if marker.exists() and marker.read_text() == digest:
                return
            for name, data in ray.get(ref).items():
                tmp = d / f"{name}.tmp"
                tmp.write_bytes(data)
                tmp.replace(d / name)
            marker.write_text(digest)
            self.fetched.append(card.id)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _actor_died() -> type[BaseException]:
    """What ray.get raises for a call whose actor died (or its node was lost) meanwhile."""
    from ray.exceptions import RayActorError

    return RayActorError


class _SlotEvaluator(Evaluator):
    """The driver's side of one actor: candidates go out, verdicts come back."""

    def __init__(self, pool: "RayPool", slot: int):
        self.pool, self.slot = pool, slot
        self.actor = pool.actors[slot]

    def evaluate(self, card: Card, candidate: Candidate) -> EvalResult:
        ray = _ray()
        ref = self.actor.evaluate.remote(card.to_json(), candidate.to_json(), [self.pool.samples(card)])
        try:
            kind, payload = ray.get(ref)
        except _actor_died() as e:
            self._revive()
            return EvalResult(Verdict.RUNTIME_ERROR, f"the Ray actor on {self.pool.slots[self.slot]} died while "
                              f"evaluating this candidate ({type(e).__name__}); Ray restarted it",
                              {"phase": "evaluating", "ray_error": type(e).__name__})
        if kind == "card_error":
            raise CardError(payload)
        return EvalResult.from_json(payload)

    def _revive(self) -> None:
        """Wait until Ray has restarted the actor, so the next candidate is not lost too."""
        ray = _ray()
        deadline = time.monotonic() + REVIVE_S
        while True:
            try:
                ray.get(self.actor.stats.remote(), timeout=max(deadline - time.monotonic(), 1.0))
                return
            except _actor_died():
                if time.monotonic() > deadline:
                    raise ClusterError(f"the Ray actor on {self.pool.slots[self.slot]} did not come back within "
                                       f"{REVIVE_S:.0f} s; its node may be gone") from None
                time.sleep(0.2)

    def close(self) -> None:
        """The actor stays up until the pool closes: the next card of this slot reuses it."""


class RayPool(EvaluatorPool):
    """One actor per GPU on every alive node whose GPUs match the cards (kforge.cluster.nodes);
    the notes say which GPUs were left out and why."""

    def __init__(self, address: str, cluster: str, run_dir: Path, cards: list[Card], factory: EvaluatorFactory):
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.run_dir = Path(run_dir)
        self.connected = connect(address)
        self._samples: dict[str, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self.actors: list = []
        try:
            gpu_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1]
            if not gpu_nodes:
                raise ClusterError(f"the Ray cluster at {address} has no node with a GPU: start the GPU nodes with "
                                   "`ray start --address HEAD:6379` (Ray finds their GPUs)")
            run_key = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
            Actor = ray.remote(EvaluatorActor)
            started = []
            for n in gpu_nodes:
                for k in range(int(n["Resources"]["GPU"])):
                    # The GPU is what an actor holds (num_cpus=0: Ray would otherwise keep one CPU
                    # per actor and start one actor per CPU). max_restarts=-1: a dead actor comes
                    # back; max_task_retries=0: the candidate it held is not run again behind the
                    # search's back (it is a recorded fault).
                    a = Actor.options(num_gpus=1, num_cpus=0, max_restarts=-1, max_task_retries=0,
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                                      ).remote(factory, nodes.node_facts, run_key)
                    started.append((f"GPU {k} of node {n['NodeManagerAddress']} ({n['NodeID'][:8]})", a))
            described, failed = {}, {}
            pending = {a.describe.remote(): label for label, a in started}
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=START_S)
            for ref in ready:
                try:
                    described[pending[ref]] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - that GPU is refused with the reason, the others go on
                    last = (str(e).strip().splitlines() or [type(e).__name__])[-1]  # a remote traceback's error
                    failed[pending[ref]] = f"its actor failed to start ({last})"
            reference = nodes.Reference.for_cards(cards)
            reference.settle_arch(described.values())
            refused: dict[str, str] = {}
            self.slots = []
            for label, a in started:
                why = (reference.refusal(described[label]) if label in described else failed.get(label) or
                       f"its actor did not start within {START_S:.0f} s (is the GPU held by another job?)")
                if why:
                    refused[label] = why
                    ray.kill(a)
                else:
                    self.slots.append(label)
                    self.actors.append(a)
            if not self.actors:
                raise ClusterError("no GPU of the Ray cluster can evaluate these cards: " +
                                   "; ".join(f"{label}: {why}" for label, why in refused.items()))
            first = described[self.slots[0]]
            self.hardware = Hardware(**first["hardware"])
            self.validated = True
            self.config = {"cluster": cluster, "devices": list(self.slots)}
            self.notes = [f"{label} refused: {why}" for label, why in refused.items()]
        except BaseException:
            self.close()
            raise

    def evaluator(self, slot: int) -> Evaluator:
        return _SlotEvaluator(self, slot)

    def samples(self, card: Card) -> tuple[str, Any]:
        """(digest, object ref) of the card's sample files, put in the object store once."""
        with self._lock:  # search threads may reach a card at once
            if card.id not in self._samples:
                d = card_dir(self.run_dir, card.id)
                files = {p.name: p.read_bytes() for p in sorted(d.glob("sample*.safetensors"))}
                h = hashlib.sha256()
                for name, data in files.items():
                    h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
                self._samples[card.id] = (h.hexdigest(), _ray().put(files))
            return self._samples[card.id]

    def close(self) -> None:
        if not self.actors and not self.connected:
            return
        ray = _ray()
        if self.actors:
            ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=CLOSE_S)
            for a in self.actors:
                ray.kill(a)
            self.actors = []
        self._samples.clear()
        if self.connected:
            ray.shutdown()
            self.connected = False


def probe_nodes() -> list[tuple[dict, dict]]:
    """(node, facts) for every alive node, from a task pinned there that takes no GPU and no
    CPU; facts is {"error": ...} for a node that did not answer."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(lambda facts: facts())
    alive = [n for n in ray.nodes() if n["Alive"]]
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(nodes.node_facts) for n in alive]
    out = []
    for n, ref in zip(alive, refs):
        try:
            out.append((n, ray.get(ref, timeout=START_S)))
        except Exception as e:  # noqa: BLE001 - a node's failure is that node's row, not the report's
            out.append((n, {"error": f"{type(e).__name__}: {e}"}))
    return out
