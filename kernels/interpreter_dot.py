"""Row-invariant `tl.dot` under Triton's interpreter, for batch-invariant mode (and bitwise tests) on the CPU.

The interpreter computes a block's `tl.dot` with one `np.matmul`, so its rounding is whatever the CPU's BLAS does.
Batch-invariant mode promises that an output row depends only on that row's inputs (mode.py), and the CPU tests hold
the kernels to it bit for bit, also between calls in and out of the mode (its tiles are the fast path's at those
sizes). Some BLAS builds break that: numpy's OpenBLAS 0.3.31 on an AMD EPYC (its Haswell sgemm kernels) gives a row
other bits when the block's rows are rolled by one, while its Sandybridge kernels and the Intel machines of earlier
sessions do not. There the interpreter's invariance tests failed with the kernels unchanged (bench/RESULTS.md, "CI").

So, only under the interpreter and only where a probe finds the platform's matmul row-dependent, every dot runs as a
batch of single-row products (one np.matmul over [M, 1, K] x [1, K, N]): each row takes the same product whatever
its neighbours, on any BLAS.
"""

from __future__ import annotations

import functools

import numpy as np

from .emulate import INTERPRETED


@functools.cache
def matmul_rows_depend_on_neighbours() -> bool:
    """Whether np.matmul's row r of a float32 block changes when the other rows (or r's place among them) do."""
    rng = np.random.default_rng(0)
    for m, k, n in ((16, 64, 32), (32, 72, 48), (64, 128, 64)):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        if not np.array_equal(np.roll(np.roll(a, 1, axis=0) @ b, -1, axis=0), a @ b):
            return True
    return False


def _row_by_row(create_dot):
    """The interpreter builder's create_dot as a batch of one-row products: [..., M, K] x [..., K, N] becomes
    [..., M, 1, K] x [..., 1, K, N], which numpy runs row by row with one routine."""
    from triton.runtime.interpreter import TensorHandle

    def rows(h, axis):
        return TensorHandle(np.expand_dims(h.data, axis), h.dtype.scalar)

    @functools.wraps(create_dot)
    def row_invariant_dot(self, a, b, d, *args, **kwargs):
        out = create_dot(self, rows(a, -2), rows(b, -3), rows(d, -2), *args, **kwargs)
        return TensorHandle(np.squeeze(out.data, -2), out.dtype)

    row_invariant_dot.row_invariant = True
    return row_invariant_dot


def install() -> bool:
    """Make the interpreter's dots row-invariant where the platform needs it (idempotent). Returns whether the
    interpreter now runs them row by row."""
    if not INTERPRETED:
        return False
    from triton.runtime.interpreter import InterpreterBuilder

    if getattr(InterpreterBuilder.create_dot, "row_invariant", False):
        return True
    if not matmul_rows_depend_on_neighbours():
        return False
    InterpreterBuilder.create_dot = _row_by_row(InterpreterBuilder.create_dot)
    return True
