"""int4's tiled storage layout (quant/formats/tiled.py): the block and nibble order against a definition written out
element by element, the same values as the row-major layout, the shapes that fall back to it, and the checkpoint
boundary."""

import re

import pytest
import torch

from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.formats import get_format, int4_storage_name
from orbit_lightning.quant.formats.tiled import tile_tensor, untile_tensor
from orbit_lightning.quant.fusion import fuse_rows
from orbit_lightning.quant.linear import QuantLinear


def _by_hand(t: torch.Tensor, per_block: int) -> torch.Tensor:
    """The layout's definition, one element at a time: row r, column c of [N, C] goes to block (r // 16, c // per)
    (blocks of a row tile one after another, the row tiles in order), row r % 16 of the block, column c % per."""
    n, c = t.shape
    out = torch.empty(n * c, dtype=t.dtype)
    for r in range(n):
        for col in range(c):
            block = (r // 16) * (c // per_block) + col // per_block
            out[block * 16 * per_block + (r % 16) * per_block + col % per_block] = t[r, col]
    return out.view(n, c)


def _pair_order_by_hand(words: torch.Tensor) -> torch.Tensor:
    """Each word's 8 values (value j in nibble j) moved so that values 2i and 2i + 1 sit in nibbles i and i + 4."""
    out = []
    for word in words.flatten().tolist():
        values = [(word >> (4 * j)) & 0xF for j in range(8)]
        moved = sum(v << (4 * (j // 2 + 4 * (j % 2))) for j, v in enumerate(values))
        out.append(moved - (1 << 32) if moved >= 1 << 31 else moved)  # as int32
    return torch.tensor(out, dtype=torch.int32).view(words.shape)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_tiled_layout_is_the_block_order(group):
    row_major = get_format(f"int4-g{group}" if group != 32 else "int4")
    tiled = get_format(row_major.name + "-tiled")
    w = torch.randn(48, 1024, generator=torch.Generator().manual_seed(group)) * 0.02
    rm, tl = row_major.quantize(w), tiled.quantize(w)
    # 16 words a block row: one K tile of 128 values; in each word values 2i, 2i + 1 in nibbles i, i + 4
    assert torch.equal(tl["weight_packed"], _by_hand(_pair_order_by_hand(rm["weight_packed"]), 16))
    assert torch.equal(tl["weight_scale"], _by_hand(rm["weight_scale"], 8))  # 8 groups: a 16-byte row
    assert torch.equal(tl["weight_shape"], rm["weight_shape"])
    assert torch.equal(tiled.dequantize(tl, torch.float32), row_major.dequantize(rm, torch.float32))
    for key in ("weight_packed", "weight_scale"):
        assert torch.equal(untile_tensor(key, tl[key]), rm[key])
        assert torch.equal(tiled.to_storage(key, rm[key]), tl[key])  # what a row-major checkpoint's tensor becomes
    stacked = tiled.random_packed((3, 32, 1024), generator=torch.Generator().manual_seed(1))  # experts tile alone
    assert torch.equal(tiled.dequantize({k: v[1] for k, v in stacked.items()}),
                       tiled.dequantize(stacked)[1])  # fmt: skip


def test_shapes_the_layout_cannot_hold_stay_row_major():
    tiled = get_format("int4-tiled")
    assert tiled.for_shape((40, 256)).name == "int4" and tiled.for_shape((48, 160)).name == "int4"
    assert tiled.for_shape((48, 256)) is tiled
    with pytest.raises(ValueError, match=r"cannot be tiled \(N = 40 .*store it as int4$"):
        tiled.quantize(torch.randn(40, 256))
    assert QuantLinear(256, 40, "int4-tiled").fmt.name == "int4"  # a layer picks what its shape allows
    assert QuantLinear(1024, 48, "int4-g128-tiled").fmt.name == "int4-g128-tiled"
    assert QuantLinear(512, 48, "int4-g128-tiled").fmt.name == "int4-g128"  # a scale block row is 8 groups of 128
    assert QuantExperts(4, 256, 96, "int4-tiled").fmt.name == "int4"  # down_proj K = 96: all three row-major
    assert tile_tensor("weight_shape", torch.tensor([48, 256])).tolist() == [48, 256]  # not per row: untouched


@pytest.mark.parametrize("asked,layout,device,stored", [
    ("int4", "auto", "cuda", "int4-tiled"),  # the decode kernels' layout where they run
    ("int4-g128", "auto", "cuda", "int4-g128-tiled"),
    ("int4", "auto", "cpu", "int4"),
    ("int4", "auto", "meta", "int4"),
    ("int4", "row-major", "cuda", "int4"),
    ("int4-g64", "tiled", "cpu", "int4-g64-tiled"),
    ("int4-tiled", "auto", "cpu", "int4-tiled"),  # an explicit tiled name is kept
    ("fp8", "auto", "cuda", "fp8"),
    (None, "auto", "cuda", None),
])
def test_int4_layout_picks_the_stored_format(asked, layout, device, stored):
    assert int4_storage_name(asked, layout, torch.device(device)) == stored


@pytest.mark.parametrize("asked,layout,message", [
    ("int4", "sideways", "model.int4_layout='sideways': expected one of auto, row-major, tiled"),
    ("fp8", "tiled", "model.int4_layout=tiled applies to int4 formats, not quant='fp8'"),
    ("int4-g64-tiled", "row-major", "use quant='int4-g64' for row-major storage"),
])
def test_int4_layout_conflicts_are_named(asked, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        int4_storage_name(asked, layout, torch.device("cpu"))


def test_layers_load_row_major_checkpoints_into_the_tiled_layout():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    rm = get_format("int4").quantize(w)
    layer = QuantLinear(256, 64, "int4-tiled")
    for key, t in rm.items():  # a pre-quantized (compressed-tensors) checkpoint's tensors, one at a time
        layer.load_checkpoint_tensor(key, t, None, f"q.{key}")
    assert torch.equal(layer.dequantize(torch.float32), get_format("int4").dequantize(rm, torch.float32))
    assert not torch.equal(layer.weight_packed, rm["weight_packed"])
    with pytest.raises(ValueError, match=r"packed weight_packed shape \(40, 32\) != expected \(64, 32\)"):
        layer.load_checkpoint_tensor("weight_packed", torch.zeros(40, 32, dtype=torch.int32), None, "q.weight_packed")
    assert torch.equal(layer.dequantize(torch.float32), get_format("int4").dequantize(rm, torch.float32))  # kept
    experts = QuantExperts(2, 256, 128, "int4-tiled")
    gate = get_format("int4").quantize(torch.randn(2, 128, 256) * 0.02)
    for e in range(2):
        for key, t in gate.items():
            experts.load_checkpoint_tensor(f"gate_proj.{key}", t[e], e, f"gate.{e}.{key}")
    assert torch.equal(experts.dequantize("gate_proj", dtype=torch.float32),
                       get_format("int4").dequantize(gate, torch.float32))  # fmt: skip


def test_fused_rows_of_tiled_layers_are_the_members_stacked():
    gen = torch.Generator().manual_seed(5)
    layers = [QuantLinear(256, n, "int4-tiled") for n in (64, 32, 32)]
    for layer in layers:
        layer.random_init(gen)
    alone = [layer.dequantize(torch.float32) for layer in layers]
    group = fuse_rows(layers)
    assert group is not None and group.fmt.name == "int4-tiled"
    assert torch.equal(group.dequantize(torch.float32), torch.cat(alone))  # whole row tiles: a slice is a weight
    for layer, ref in zip(layers, alone):
        assert torch.equal(layer.dequantize(torch.float32), ref)
