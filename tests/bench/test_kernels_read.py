"""bench/kernels.py's decode ceiling divides by the time of one streaming read of an int4 weight's bytes: that read
must touch every packed word and every scale exactly once (Triton's interpreter on the CPU; xor of all the int32s,
which a skipped or doubled element changes)."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from orbit_lightning.quant.formats import get_format

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[2] / "bench" / "kernels.py")
bench_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_kernels)


def _xor(values) -> int:
    return functools.reduce(lambda a, b: a ^ b, values, 0)


@pytest.mark.parametrize("shape", [(300, 1536), (64, 256), (7, 4096)])  # a partial last program of words and scales
def test_the_read_kernel_reads_each_word_and_scale_once(shape):
    packed = get_format("int4").random_packed(shape, generator=torch.Generator().manual_seed(0))
    words = packed["weight_packed"].reshape(-1)
    scales = packed["weight_scale"].reshape(-1).view(torch.int32)
    programs = bench_kernels.read_programs(packed)
    out = torch.zeros(programs, dtype=torch.int32)
    bench_kernels.read_packed(packed, out)
    assert _xor(out.tolist()) == _xor(words.tolist() + scales.tolist())
    # One program's worth more of either would change the count: words and scales each round up to whole programs.
    block = bench_kernels.READ_BLOCK
    assert programs == -(-words.numel() // block) + -(-scales.numel() // block)
