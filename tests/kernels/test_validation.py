"""Bad inputs raise errors that name the problem (checked before any kernel launches)."""

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import random_weight


def test_format_names_and_support():
    assert kernels.supports("int4") and kernels.supports("int4-g128") and kernels.supports("nvfp4")
    assert not kernels.supports("nf4") and not kernels.supports("fp8-b64x64") and not kernels.supports(3)
    packed, _ = random_weight("int4", (8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="nf4"):
        kernels.dequant_linear(x, "nf4", packed)
    with pytest.raises(ValueError, match="contradicts"):
        kernels.dequant_linear(x, "int4-g128", packed, group_size=32)
    with pytest.raises(TypeError, match="unexpected keyword"):
        kernels.dequant_linear(x, "int4", packed, block=3)


def test_packed_weight_checks():
    packed, _ = random_weight("int4", (8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(KeyError, match="weight_scale"):
        kernels.dequant_linear(x, "int4", {"weight_packed": packed["weight_packed"]})
    with pytest.raises(TypeError, match="int32"):
        kernels.dequant_linear(x, "int4", {**packed, "weight_packed": packed["weight_packed"].float()})
    with pytest.raises(ValueError, match="needs"):  # group 64 does not match a [8, 2] scale
        kernels.dequant_linear(x, "int4", packed, group_size=64)
    with pytest.raises(ValueError, match="needs K=64"):
        kernels.dequant_linear(torch.randn(2, 32), "int4", packed)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        kernels.dequant_linear(x.double(), "int4", packed)
    with pytest.raises(ValueError, match="stacked"):
        kernels.grouped_dequant_linear(x, torch.tensor([0, 2]), "int4", packed)


def test_grouped_offsets_checks():
    packed, _ = random_weight("fp8", (3, 8, 64))
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"\[E\+1\] = \[4\]"):
        kernels.grouped_dequant_linear(x, torch.tensor([0, 4, 4], dtype=torch.int32), "fp8", packed)
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.grouped_dequant_linear(x, torch.tensor([0.0, 1, 2, 4]), "fp8", packed)
    with pytest.raises(ValueError, match="2-D"):
        kernels.dequant_linear(x, "fp8", packed)


def test_tile_config_checks():
    with pytest.raises(ValueError, match="power of two"):
        kernels.TileConfig(16, 48, 32)
    with pytest.raises(ValueError, match="split_k"):
        kernels.TileConfig(16, 32, 32, split_k=-1)


def test_gemv_config_checks_its_register_cap():
    """A register cap outside what ptxas takes is refused when the config is made, not at the first launch."""
    from orbit_lightning.kernels.configs import GemvConfig

    for bad in (0, 16, 256):
        with pytest.raises(ValueError, match="maxnreg"):
            GemvConfig(16, 16, 128, mma=True, maxnreg=bad)
    assert GemvConfig(16, 16, 128, mma=True, maxnreg=80).launch_options == {"maxnreg": 80}
    assert GemvConfig(16, 16, 128).launch_options == {}


@pytest.mark.parametrize("length,splits,step", [(4096, 4, 128), (12288, 88, 128), (1056, 9, 128), (1000, 3, 64),
                                                (128, 5, 128), (1, 7, 16)])
def test_split_evenly_covers_the_length_in_whole_steps_without_empty_splits(length, splits, step):
    per_split, n = kernels.configs.split_evenly(length, splits, step)
    assert per_split % step == 0 and n <= splits
    assert (n - 1) * per_split < length <= n * per_split  # the last split is not empty, and all are covered
