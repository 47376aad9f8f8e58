"""The tiled storage layout of int4 weights: the same words and scales as the row-major layout, reordered so that a
decode kernel's warp reads one contiguous block where it read 16 rows a row apart.

The words of a weight [..., N, K] are cut into blocks of TILE_ROWS rows x TILE_K values (one K tile of the decode
kernels: 16 rows x 16 int32 = 1024 bytes), its scales into blocks of TILE_ROWS rows x SCALE_GROUPS groups (16 rows
x 16 bytes). A block is stored row after row; the blocks of a row tile follow one another along K, where row-major
rows 16 i .. 16 i + 15 sit. The tensors keep their row-major shapes ([..., N, K / 8] and [..., N, K / g]), so a
slice of whole row tiles is still a weight (fused q/k/v rows, one expert of a stack). Why: the mma decode GEMV reads,
each step, 64 bytes of words and 8 of scales from each of a row tile's 16 rows; tiled, the words are one run of
1024 bytes and the scales of 8 rows lie in one 128-byte line, and on the H200 that was 8 % faster at 1 and 16 rows
with the same instructions (bench/RESULTS.md, thirty-seventh session). A scale block is 8 groups wide, not one K
tile's, so that a TMA box of a block row (16 bytes, its minimum) is the row-major box's: the warpgroup-MMA kernels
load their 8-group scale chunks and their words into the same shared memory from either layout. Checkpoints stay
row-major (compressed-tensors'); the layout is made when a weight is stored.

Within a word the values are reordered too: values 2j and 2j + 1 sit in nibbles j and j + 4 (row-major: value j in
nibble j). The kernels' int4 -> bf16 decode turns the two nibbles 16 bits apart, j and j + 4, into one register of
two bf16 values, and the tensor-core operands (like activations in memory) pair adjacent K values: in this order a
decoded register is such a pair, where in K order the mma GEMV regrouped each word's activations by byte permutes
(16 of the 161 instructions of an M = 1 tile, 32 of 209 at 16 rows, sm_90 SASS) and wgmma_int4 gathered each pair's
byte by a permute.
"""

from __future__ import annotations

import torch
from torch import Tensor

TILE_ROWS = 16
TILE_K = 128
SCALE_GROUPS = 8  # scale groups a block row (16 bytes: TMA's smallest box row)
TILED_KEYS = ("weight_packed", "weight_scale")  # the int4 tensors the layout reorders (weight_shape is not per row)
NIBBLE_OF_VALUE = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of a tiled word that holds its value j (row-major: j)
_VALUE_OF_NIBBLE = tuple(NIBBLE_OF_VALUE.index(n) for n in range(8))  # its inverse: the value nibble n holds


def tiled_blocker(shape: tuple[int, ...], group: int) -> str | None:
    """Why a weight [..., N, K] with scale groups of `group` cannot be tiled (None: it can)."""
    n, k = shape[-2], shape[-1]
    if n % TILE_ROWS:
        return f"N = {n} (out features) is not a multiple of {TILE_ROWS}"
    if k % TILE_K or k % (SCALE_GROUPS * group):
        return f"K = {k} (in features) is not a multiple of {max(TILE_K, SCALE_GROUPS * group)}"
    return None


def _per_block(key: str) -> int:
    """Columns of a block row of tensor `key`: a K tile's words (16) or SCALE_GROUPS scales."""
    return TILE_K // 8 if key == "weight_packed" else SCALE_GROUPS


def _blocks(t: Tensor, per_block: int) -> Tensor:
    """t [..., N, C] as [..., N / 16, 16, C / per_block, per_block] (a view)."""
    *lead, n, c = t.shape
    return t.reshape(*lead, n // TILE_ROWS, TILE_ROWS, c // per_block, per_block)


def tiles(key: str, t: Tensor) -> bool:
    """Whether packed tensor `key` of t's shape is whole blocks (any tensor the layout leaves alone is)."""
    return key not in TILED_KEYS or (t.dim() >= 2 and t.shape[-2] % TILE_ROWS == 0
                                     and t.shape[-1] % _per_block(key) == 0)


def _move_nibbles(words: Tensor, source: tuple[int, ...]) -> Tensor:
    """int32 words whose nibble j is nibble source[j] of `words`."""
    out = torch.zeros_like(words)
    for j, src in enumerate(source):
        out |= ((words >> (4 * src)) & 0xF) << (4 * j)
    return out


def tile_tensor(key: str, t: Tensor) -> Tensor:
    """Row-major int4 tensor `key` ([..., N, C]) in the tiled layout, same shape (a new tensor)."""
    if key not in TILED_KEYS:
        return t
    if key == "weight_packed":  # nibble NIBBLE_OF_VALUE[j] takes value j
        t = _move_nibbles(t, _VALUE_OF_NIBBLE)
    return _blocks(t, _per_block(key)).transpose(-3, -2).contiguous().reshape(t.shape)


def untile_tensor(key: str, t: Tensor) -> Tensor:
    """tile_tensor's inverse: tiled tensor `key` back in row-major order (a new tensor)."""
    if key not in TILED_KEYS:
        return t
    *lead, n, c = t.shape
    per = _per_block(key)
    blocks = t.reshape(*lead, n // TILE_ROWS, c // per, TILE_ROWS, per)  # as stored: K tile, then row
    row_major = blocks.transpose(-3, -2).contiguous().reshape(t.shape)
    return _move_nibbles(row_major, NIBBLE_OF_VALUE) if key == "weight_packed" else row_major


def tile_packed(packed: dict[str, Tensor]) -> dict[str, Tensor]:
    return {key: tile_tensor(key, t) for key, t in packed.items()}


def untile_packed(packed: dict[str, Tensor]) -> dict[str, Tensor]:
    return {key: untile_tensor(key, t) for key, t in packed.items()}
