"""Error / size metrics and the comparison table."""

import torch

from orbit_lightning.quant.formats import (
    FORMATS,
    bytes_per_param,
    get_format,
    print_error_table,
    quantization_error,
)


def test_quantization_error_is_zero_on_representable_weight():
    # a dequantized mxfp4 weight is exactly representable in mxfp4
    fmt = get_format("mxfp4")
    w = fmt.dequantize(fmt.quantize(torch.randn(4, 64)), torch.float32)
    assert quantization_error(w, "mxfp4") == {"rel_fro": 0.0, "max_abs": 0.0}


def test_quantization_error_matches_direct_computation():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    fmt = get_format("int4")
    diff = fmt.dequantize(fmt.quantize(w), torch.float64) - w.double()
    err = quantization_error(w, fmt)
    assert err["rel_fro"] == (diff.norm() / w.double().norm()).item()
    assert err["max_abs"] == diff.abs().max().item()


def test_bytes_per_param_by_hand():
    shape = (4096, 4096)
    # int4: 4-bit codes, a bf16 scale per 32, and the two int64 of weight_shape
    assert bytes_per_param("int4", shape) == 0.5 + 2 / 32 + 16 / shape[0] / shape[1]
    assert bytes_per_param("int4-g128", (2, 256, 256)) == 0.5 + 2 / 128 + 16 / 256 / 256
    assert bytes_per_param("mxfp4", shape) == 0.5 + 1 / 32
    assert bytes_per_param("nvfp4", shape) == 0.5 + 1 / 16 + 4 / shape[0] / shape[1]
    assert bytes_per_param("nf4", shape) == 0.5 + 4 / 64
    assert bytes_per_param("fp8", shape) == 1 + 4 / 128 / 128


def test_table_lists_every_format(capsys):
    table = print_error_table(shape=(64, 256))
    assert capsys.readouterr().out.strip() == table
    lines = table.splitlines()
    assert [line.split()[0] for line in lines[2:]] == [n for n in sorted(FORMATS) if not n.endswith("-tiled")]
