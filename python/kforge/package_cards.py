"""A loaded package's cards: each manifest entry checked against the members it names and
parsed into a PackagedCard, which says whether its kernel runs and, when not, why."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .candidate import Candidate, LaunchPlan
from .cards import CARD_FORMAT, Card, card_id, decode_value
from .castfile import CHECKSUMS, MANIFEST, SIGNATURE, sha256
from .dispatch import Counters
from .errors import CardError, PackageError, PlanError
from .manifest import arch_sm, cubin_sm

def _present(e: dict, key: str, where: str) -> Any:
    if e.get(key) is None:
        raise PackageError(f"malformed manifest: {where}.{key} must be present for a dispatched card; rebuild the "
                           "package with `kforge package`")
    return e[key]


def _check_card(card: Card) -> None:
    """Raise CardError unless every field install() and report() read has the type they expect:
    a manifest is untrusted, and a bad field must fail the load, not a later install."""
    def ints(xs: Any, lo: int | None = None) -> bool:
        return isinstance(xs, tuple) and all(type(x) is int and (lo is None or x >= lo) for x in xs)

    if not isinstance(card.op, str) or not all(isinstance(a.name, str) for a in card.args):
        raise CardError("op and argument names must be strings")
    for a in card.args:
        if a.kind == "value":
            decode_value(a.value)
        elif not ((a.kind == "tensor" and a.tensor is not None) or (a.kind == "tensors" and isinstance(a.tensors, list))):
            raise CardError(f"argument {a.name!r} of kind {a.kind!r} carries no tensor metadata")
    for m in card.inputs + card.outputs:
        if not (ints(m.shape, 0) and ints(m.stride) and len(m.shape) == len(m.stride) and isinstance(m.device, str)
                and m.align in (1, 2, 4, 8, 16)):
            raise CardError(f"tensor metadata {m} is malformed")
        m.torch_dtype  # raises CardError for a dtype this torch does not have
    if not all(type(k) is int and type(v) is int for k, v in card.aliases.items()):
        raise CardError(f"aliases {card.aliases} must map output indices to input indices")


@dataclass(eq=False)
class PackagedCard:
    """One card of a package as it stands on this machine (decisions may differ from the manifest's)."""

    card: Card
    decision: str  # eager dispatch (pkg.apply): "dispatched" | "fallback"
    reason: str
    kind: str | None
    entry: dict  # the manifest entry: guard, evidence, hashes
    candidate: Candidate | None = None  # the kernel, where either decision dispatches it
    cubin: bytes | None = None
    counters: Counters = field(default_factory=Counters)
    compile_decision: str | None = None  # compiled graphs (kforge.compile): "dispatched" | "fallback" | None
    compile_reason: str = ""

    @property
    def id(self) -> str:
        return self.card.id

    @property
    def dispatched(self) -> bool:
        return self.decision == "dispatched"

    @property
    def compiled(self) -> bool:
        """Whether kforge.compile puts this card's kernel into compiled graphs."""
        return self.compile_decision == "dispatched"

    def fall_back(self, why: str) -> None:
        """Neither eager dispatch nor compiled graphs run the kernel here, because of `why`."""
        if self.dispatched:
            self.decision, self.reason = "fallback", why
        if self.compiled:
            self.compile_decision, self.compile_reason = "fallback", why


_OLD_FORMAT = ("the package predates torch.compile baselines (package format 1): its kernels stay out of "
               "compiled graphs; rebuild it with `kforge package` to decide them")


def _parse_compile(e: dict) -> tuple[str | None, str]:
    """(decision, reason) for compiled graphs (types checked by kforge.manifest); a format 1 entry has none."""
    c = e.get("compile")
    return (None, _OLD_FORMAT) if c is None else (c.get("decision"), c.get("reason") or "")


def _parse_card(e: dict, i: int, arch: str, members: dict[str, bytes]) -> PackagedCard:
    """One entry, already type-checked by kforge.manifest, as a typed card."""
    where = f"cards[{i}]"
    cid, guard, decision, reason = e["id"], e.get("guard") or {}, e["decision"], e["reason"]
    try:
        card = Card.from_json({"format": CARD_FORMAT, "id": cid, "op": e["op"], "schema": e["schema"],
                               "args": guard["args"], "outputs": e["outputs"], "aliases": e["aliases"],
                               "arch": guard["arch"], "family": e.get("family", "other"), "calls": e.get("calls", 0),
                               "share": e.get("share"), "module_paths": e.get("module_paths", []),
                               "region": e.get("region")})
        _check_card(card)
        if card.region is not None:
            card.region.check(len(card.inputs))
        hashes_to_id = card_id(card.op, card.args, card.arch, card.region) == cid
    except (KeyError, TypeError, ValueError, AttributeError, CardError) as err:
        raise PackageError(f"malformed manifest: {where} is not a valid card ({err!r}); rebuild the package") from err
    if not hashes_to_id:
        raise PackageError(f"malformed manifest: {where}'s guard does not hash to its id {cid}; the manifest was edited")
    compile_decision, compile_reason = _parse_compile(e)
    decisions = dict(compile_decision=compile_decision, compile_reason=compile_reason)
    if "dispatched" not in (decision, compile_decision):
        return PackagedCard(card, decision, reason, e.get("kind"), e, **decisions)
    kind, files, hashes = (_present(e, k, where) for k in ("kind", "files", "hashes"))
    want = {"source": f"kernels/{cid}.cu", "cubin": f"kernels/{cid}.{arch}.cubin"}
    if files != want or card.arch != arch:
        raise PackageError(f"malformed manifest: {where} must name files {want} and arch {arch}")
    for what, name in want.items():
        if name not in members or sha256(members[name]) != hashes[what]:
            raise PackageError(f"{where}: {name} is missing or does not match its hash in the manifest; rebuild the package")
    cubin = members[want["cubin"]]
    if cubin_sm(cubin) != arch_sm(arch):
        raise PackageError(f"{where}: {want['cubin']} is not a cubin for {arch} (PTX or another arch); rebuild the package")
    try:
        plan = LaunchPlan.from_json(_present(e, "plan", where))
        plan.validate(len(card.inputs), len(card.outputs))
        source = members[want["source"]].decode()
    except (PlanError, UnicodeDecodeError) as err:
        raise PackageError(f"malformed manifest: {where}'s kernel is unusable: {err}") from err
    return PackagedCard(card, decision, reason, kind, e, Candidate(source, plan, kind), cubin, **decisions)


def parse_cards(path: Path, manifest: dict, members: dict[str, bytes]) -> list[PackagedCard]:
    arch = manifest["gpu"]["arch"]
    cards = [_parse_card(e, i, arch, members) for i, e in enumerate(manifest["cards"])]
    referenced = {MANIFEST, CHECKSUMS, SIGNATURE} | {n for c in cards if c.candidate is not None
                                                     for n in c.entry["files"].values()}
    stray = sorted(set(members) - referenced)
    if stray:
        raise PackageError(f"{path} is not a safe .cast package: entries {stray} are not referenced by the manifest; "
                           "refusing to load it. Use packages written by `kforge package` from a source you trust.")
    return cards
