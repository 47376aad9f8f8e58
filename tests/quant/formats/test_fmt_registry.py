"""Registry: user strings -> configured formats, clear errors for unknown names."""

import pytest
import torch

from orbit_lightning.quant.formats import (
    FORMATS,
    Fp8BlockFormat,
    Int4Format,
    MXFP4Format,
    NF4Format,
    NVFP4Format,
    get_format,
    index_leading,
    register_format,
)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("int4", Int4Format(group_size=32)),
        ("int4-g64", Int4Format(group_size=64)),
        ("int4-g128", Int4Format(group_size=128)),
        ("fp8", Fp8BlockFormat(block=(128, 128))),
        ("mxfp4", MXFP4Format()),
        ("nvfp4", NVFP4Format()),
        ("nf4", NF4Format()),
    ],
)
def test_get_format_parses_user_strings(spec, expected):
    fmt = get_format(spec)
    assert fmt == expected
    assert fmt.name == spec  # the name maps back to the same configuration
    assert get_format(fmt) is fmt  # an already-built format passes through


def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError, match="unknown quant format 'int3'") as info:
        get_format("int3")
    for name in ("int4", "int4-g128", "fp8", "mxfp4", "nvfp4", "nf4"):
        assert name in str(info.value)


def test_bad_int4_group_size_is_rejected():
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Format(group_size=16)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_format("int4")(Int4Format)
    assert FORMATS["int4"] is Int4Format


def test_index_leading_indexes_every_key():
    packed = {"a": torch.arange(6).view(3, 2), "b": torch.arange(3)}
    out = index_leading(packed, torch.tensor([2, 0]))
    assert out["a"].tolist() == [[4, 5], [0, 1]]
    assert out["b"].tolist() == [2, 0]
