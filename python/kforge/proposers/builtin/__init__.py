"""The built-in proposer: CUDA templates (one per group of aten ops), specialized to each card's exact
shapes, strides and dtypes, and searched by revising their knobs.

Templates (one module each): softmax, layer_norm, rms_norm (both on rownorm), group_norm,
batch_norm (inference), pooling; and `generated` (kforge.codegen: every op of its table, the
only source for pointwise ops and copies, beside the templates elsewhere). `BuiltinProposer().supports(card)` says which cards they take.
"""

from .proposer import TEMPLATES, BuiltinProposer, template_for, templates_for
from .template import Template

__all__ = ["BuiltinProposer", "TEMPLATES", "Template", "template_for", "templates_for"]
