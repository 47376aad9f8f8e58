"""One-pass dequantization kernel against the formats' own reference dequantize (bit-exact in fp32)."""

import pytest
import torch

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize(("fmt", "shape"), [("int4", (40, 96)), ("int4-g128", (2, 8, 256)), ("fp8", (150, 200)),
                                            ("mxfp4", (3, 33, 64)), ("nvfp4", (3, 20, 48)),
                                            ("int4-tiled", (2, 48, 512)), ("int4-g64-tiled", (32, 512))])
def test_dequantize_matches_reference(fmt, shape):
    f = get_format(fmt)
    packed = f.random_packed(shape, generator=torch.Generator().manual_seed(0))
    ref = f.dequantize(packed, torch.float32)
    # Both compute value * scale once in fp32, so they agree exactly. (bf16 outputs are checked on the GPU:
    # the interpreter truncates fp32 -> bf16 casts instead of rounding them.)
    assert torch.equal(kernels.dequantize(fmt, packed, torch.float32), ref)
    if len(shape) == 3:
        ids = torch.tensor([shape[0] - 1, 0])
        assert torch.equal(kernels.dequantize(fmt, packed, torch.float32, expert_ids=ids), ref[ids])


def test_dequantize_checks():
    packed = get_format("int4").random_packed((8, 64))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        kernels.dequantize("int4", packed, torch.float64)
    with pytest.raises(ValueError, match="stacked"):
        kernels.dequantize("int4", packed, expert_ids=torch.tensor([0]))
