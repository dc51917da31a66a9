"""A small kernel IR and code generator for memory-bound work (pointwise maps and one-level
reductions with prologue and epilogue), used by the built-in proposer.

    ir.py      the IR (Expr trees, Program) and what the region builder takes
    ops.py     the one table: aten op -> expression; reduction kinds and aten reductions
    build.py   aten nodes (a card, or a region) -> Program
    lower.py   Program -> CUDA C + launch geometry, for one knob setting
    interp.py  reference interpreter of the IR in torch on the CPU
"""
