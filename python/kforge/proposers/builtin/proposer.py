"""BuiltinProposer: the default proposer. No network; every candidate is a template
specialized to the card, and a revision is a neighbourhood move in the template's knobs."""

from __future__ import annotations

from ...cards import Card
from ...errors import ProposerError
from ..base import Proposal, ProposalContext, Proposer, Tried
from . import batch_norm, group_norm, layer_norm, pointwise, pooling, rms_norm, softmax, space
from .family import Family, Knobs

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (pointwise, softmax, layer_norm, rms_norm, group_norm,
                                                      batch_norm, pooling))
TIER_WEIGHTS = {1: 4.0, 2: 2.0, 3: 1.0}  # small moves are tried more often than algorithm switches


def family_for(card: Card, families: tuple[Family, ...] = FAMILIES) -> Family | None:
    return next((f for f in families if card.op in f.ops), None)


class BuiltinProposer(Proposer):
    name = "builtin"

    def __init__(self, families: tuple[Family, ...] = FAMILIES):
        self.families = families

    def _family(self, card: Card) -> Family:
        ok, why = self.supports(card)
        if not ok:
            raise ProposerError(f"the builtin proposer has no template for this card: {why}")
        return family_for(card, self.families)

    def supports(self, card: Card) -> tuple[bool, str]:
        fam = family_for(card, self.families)
        if fam is None:
            return False, f"no builtin template for {card.op}"
        why = fam.check(card)
        return (False, f"{fam.name}: {why}") if why else (True, "")

    def propose(self, ctx: ProposalContext) -> Proposal:
        fam = self._family(ctx.card)
        spaces = fam.spaces(ctx.card, ctx.hardware)
        if ctx.parent is None:
            origin = fam.default(ctx.card, ctx.hardware)
            first = self._build(fam, ctx, origin)
            if first.candidate.digest() not in ctx.tried_digests:
                return first
        else:
            origin = ctx.parent.candidate.knobs
        failed = [t.candidate.knobs for t in ctx.sibling_failures]
        pool = [k for s in spaces for k in space.configs(s)
                if k != origin and not any(space.repeats_failure(origin, k, f) for f in failed)]
        tiers: dict[int, list[Knobs]] = {}
        for k in pool:
            tiers.setdefault(space.move_size(spaces, origin, k), []).append(k)
        while tiers:
            near = [t for t in TIER_WEIGHTS if tiers.get(t)]
            tier = ctx.rng.choices(near, [TIER_WEIGHTS[t] for t in near])[0] if near else min(tiers)
            k = tiers[tier].pop(ctx.rng.randrange(len(tiers[tier])))
            if not tiers[tier]:
                del tiers[tier]
            proposal = self._build(fam, ctx, k)
            if proposal.candidate.digest() not in ctx.tried_digests:
                return proposal
        raise ProposerError(f"{fam.name}: every knob setting near {origin} has been tried for {ctx.card.summary()}")

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal | None:
        """A step toward safety (narrower vectors, fewer threads, ...) from the failed knobs."""
        fam = self._family(ctx.card)
        spaces = fam.spaces(ctx.card, ctx.hardware)
        for k in space.safer(spaces, failed.candidate.knobs):
            proposal = self._build(fam, ctx, k)
            if proposal.candidate.digest() not in ctx.tried_digests:
                return proposal
        return None

    @staticmethod
    def _build(fam: Family, ctx: ProposalContext, knobs: Knobs) -> Proposal:
        cand = fam.build(ctx.card, knobs, ctx.hardware)
        cand.plan.validate(len(ctx.card.inputs), len(ctx.card.outputs))
        return Proposal(cand)
