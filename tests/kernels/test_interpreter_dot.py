"""kernels/interpreter_dot.py: the interpreter's dots give each row the same bits wherever it sits, on any BLAS. The
platform may or may not need it (numpy's OpenBLAS on an AMD EPYC does), so the wrapper is tested against a dot made
row-dependent on purpose, and the installed one through a real kernel."""

import numpy as np
import pytest
import torch
import triton.language as tl
from orbit_lightning.kernels import interpreter_dot
from orbit_lightning.kernels.emulate import INTERPRETED
from triton.runtime.interpreter import TensorHandle

from orbit_lightning import kernels


def _handle(x: np.ndarray) -> TensorHandle:
    return TensorHandle(x, tl.float32)


def _neighbourly_dot(self, a, b, d, *args):
    """A dot whose every row also depends on the block's first row (as a BLAS kernel's blocking may, by a rounding)."""
    first_row = a.data[..., :1, :].sum(axis=(-2, -1), keepdims=True)
    return TensorHandle(a.data @ b.data + d.data + np.float32(1e-3) * first_row, d.dtype.scalar)


def test_row_by_row_makes_a_neighbour_dependent_dot_row_invariant():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 16), dtype=np.float32)
    b = rng.standard_normal((16, 4), dtype=np.float32)
    d = rng.standard_normal((8, 4), dtype=np.float32)
    rolled = np.roll(a, 3, axis=0)

    def dot(fn, x, acc):
        return fn(None, _handle(x), _handle(b), _handle(acc)).data

    raw = _neighbourly_dot
    assert not np.array_equal(np.roll(dot(raw, rolled, np.roll(d, 3, axis=0)), -3, axis=0), dot(raw, a, d))
    wrapped = interpreter_dot._row_by_row(raw)
    want = dot(wrapped, a, d)
    assert np.array_equal(np.roll(dot(wrapped, rolled, np.roll(d, 3, axis=0)), -3, axis=0), want)
    assert np.array_equal(want[2], dot(raw, a[2:3], d[2:3])[0])  # each row: the one-row product
    np.testing.assert_allclose(want, a @ b + d, rtol=1e-5, atol=1e-2)  # (+ the deliberate 1e-3 * row sum)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's dot (CPU tests)")
def test_installed_where_the_platform_needs_it_and_rows_are_then_invariant():
    from triton.runtime.interpreter import InterpreterBuilder

    assert getattr(InterpreterBuilder.create_dot, "row_invariant", False) == (
        interpreter_dot.matmul_rows_depend_on_neighbours())
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(40, 96, generator=g), torch.randn(29, 96, generator=g)
    with kernels.batch_invariant():
        full = kernels.linear(x, w)
        assert torch.equal(kernels.linear(x[7:26], w), full[7:26])
