"""A small kernel IR and code generator for memory-bound work (pointwise maps and one-level
reductions with prologue and epilogue), used by the built-in proposer.

    ir.py      the IR (Expr trees, Program) and what the region builder takes
    call.py    what a table entry is given (Val, Call) and the helpers both tables share
    ops.py     the one pointwise table: aten op -> expression, or why it is declined
    reductions.py  reduction kinds and the aten reductions, norms, scans and windows on them
    build.py   aten nodes (a card, or a region) -> Program
    lower/     Program -> CUDA C + launch geometry, for one knob setting
    interp.py  reference interpreter of the IR in torch on the CPU
"""
