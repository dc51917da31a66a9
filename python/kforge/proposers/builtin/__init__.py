"""The built-in proposer: CUDA templates per op family, specialized to each card's exact
shapes, strides and dtypes, and searched by revising their knobs.

Families (one module each): pointwise, softmax, layer_norm, rms_norm (both on rownorm),
group_norm, batch_norm (inference), pooling; and `generated` (kforge.codegen: every op of its
table, beside the templates). `BuiltinProposer().supports(card)` says which cards they take.
"""

from .family import Family
from .proposer import FAMILIES, BuiltinProposer, families_for, family_for

__all__ = ["BuiltinProposer", "FAMILIES", "Family", "families_for", "family_for"]
