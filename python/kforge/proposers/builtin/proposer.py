"""BuiltinProposer: the default proposer. No network; every candidate is a template or a
generated kernel specialized to the card, and a revision is a neighbourhood move in the
knobs. Where a hand-written template and the generator both take a card, their algorithms
share one knob space (the template's default first: it stays where it wins)."""

from __future__ import annotations

from ...cards import Card
from ...errors import ProposerError
from ..base import Proposal, ProposalContext, Proposer, Tried
from . import batch_norm, generated, group_norm, layer_norm, pooling, rms_norm, softmax, space
from .template import Knobs, KnobSpace, Template

TEMPLATES: tuple[Template, ...] = tuple(m.TEMPLATE for m in (softmax, layer_norm, rms_norm, group_norm, batch_norm,
                                                               pooling, generated))
TIER_WEIGHTS = {1: 4.0, 2: 2.0, 3: 1.0}  # small moves are tried more often than algorithm switches


def template_for(card: Card, templates: tuple[Template, ...] = TEMPLATES) -> Template | None:
    """The first template that takes the card's op (a template before the generator)."""
    return next((f for f in templates if f.takes(card.op)), None)


def templates_for(card: Card, templates: tuple[Template, ...] = TEMPLATES) -> list[Template]:
    """Every template that takes the card's op and does not decline the card."""
    return [f for f in templates if f.takes(card.op) and not f.check(card)]


class BuiltinProposer(Proposer):
    name = "builtin"

    def __init__(self, templates: tuple[Template, ...] = TEMPLATES):
        self.templates = templates
        self._defaults: dict[tuple, list[Proposal]] = {}  # (card id, hardware) -> each template's default, built once

    def _templates(self, card: Card, hw) -> tuple[list[Template], list[KnobSpace]]:
        ok, why = self.supports(card)
        if not ok:
            raise ProposerError(f"the builtin proposer has no template for this card: {why}")
        found = templates_for(card, self.templates)
        return found, [s for f in found for s in f.spaces(card, hw)]

    def supports(self, card: Card) -> tuple[bool, str]:
        takers = [f for f in self.templates if f.takes(card.op)]
        if not takers:
            return False, f"no builtin template for {card.op}"
        whys = [(f.name, f.check(card)) for f in takers]
        if any(why is None for _, why in whys):
            return True, ""
        return False, "; ".join(f"{name}: {why}" for name, why in whys)

    def _owner(self, card: Card, hw, knobs: Knobs) -> Template:
        for f in templates_for(card, self.templates):
            if any(s["algo"][0] == knobs.get("algo") for s in f.spaces(card, hw)):
                return f
        raise ProposerError(f"no builtin template has algorithm {knobs.get('algo')!r} for {card.summary()}")

    def propose(self, ctx: ProposalContext) -> Proposal:
        found, spaces = self._templates(ctx.card, ctx.hardware)
        # Every template's default before any neighbourhood move (the first template's first): a
        # short search measures each algorithm family's best guess. On the H200, KernelBench's
        # mean over dim 1 of 2x4096x4095 ran 56 us in the mean template's default against eager's
        # 55, and the generator's default, never reached in 4 candidates, is sum's 45 us kernel.
        key = (ctx.card.id, ctx.hardware)
        if key not in self._defaults:
            self._defaults[key] = [self._build(ctx, f.default(ctx.card, ctx.hardware)) for f in found]
        defaults = self._defaults[key]
        for proposal in defaults:
            if proposal.candidate.digest() not in ctx.tried_digests:
                return proposal
        origin = defaults[0].candidate.knobs if ctx.parent is None else ctx.parent.candidate.knobs
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
            proposal = self._build(ctx, k)
            if proposal.candidate.digest() not in ctx.tried_digests:
                return proposal
        raise ProposerError(f"{found[0].name}: every knob setting near {origin} has been tried for {ctx.card.summary()}")

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal | None:
        """A step toward safety (narrower vectors, fewer threads, ...) from the failed knobs."""
        _, spaces = self._templates(ctx.card, ctx.hardware)
        for k in space.safer(spaces, failed.candidate.knobs):
            proposal = self._build(ctx, k)
            if proposal.candidate.digest() not in ctx.tried_digests:
                return proposal
        return None

    def _build(self, ctx: ProposalContext, knobs: Knobs) -> Proposal:
        cand = self._owner(ctx.card, ctx.hardware, knobs).build(ctx.card, knobs, ctx.hardware)
        cand.plan.validate(len(ctx.card.inputs), len(ctx.card.outputs))
        return Proposal(cand)
