"""The tiled storage layout of int4 weights: the same words and scales as the row-major layout, reordered so that a
decode kernel's warp reads one contiguous block where it read 16 rows a row apart.

A weight [..., N, K] is cut into blocks of TILE_ROWS rows x TILE_K values (one K tile of the decode kernels). A
block's words (16 rows x 16 int32 = 1024 bytes) and its scales (16 rows x TILE_K / g bf16) are each stored row
after row; the blocks of a row tile follow one another K tile after K tile, where row-major rows 16 i .. 16 i + 15
sit. The tensors keep their row-major shapes ([..., N, K / 8] and [..., N, K / g]), so a slice of whole row tiles is
still a weight (fused q/k/v rows, one expert of a stack). Why: the mma decode GEMV reads, each step, 64 bytes of
words and 8 of scales from each of a row tile's 16 rows; tiled, those are one run of 1024 and one of 128, and on
the H200 that was 8 % faster at 1 and 16 rows with the same instructions (bench/RESULTS.md, thirty-seventh
session). Checkpoints stay row-major (compressed-tensors'); the layout is made when a weight is stored.
"""

from __future__ import annotations

from torch import Tensor

TILE_ROWS = 16
TILE_K = 128
TILED_KEYS = ("weight_packed", "weight_scale")  # the int4 tensors the layout reorders (weight_shape is not per row)


def tiled_blocker(shape: tuple[int, ...], group: int) -> str | None:
    """Why a weight [..., N, K] with scale groups of `group` cannot be tiled (None: it can)."""
    n, k = shape[-2], shape[-1]
    if n % TILE_ROWS:
        return f"N = {n} (out features) is not a multiple of {TILE_ROWS}"
    if k % TILE_K:
        return f"K = {k} (in features) is not a multiple of {TILE_K}"
    if group > TILE_K:
        return f"scale groups of {group} are wider than a tile's {TILE_K} values"
    return None


def _per_block(key: str, group: int) -> int:
    """Columns of a block row of tensor `key`: a K tile's words (16) or scales (TILE_K / group)."""
    return TILE_K // 8 if key == "weight_packed" else TILE_K // group


def _blocks(t: Tensor, per_block: int) -> Tensor:
    """t [..., N, C] as [..., N / 16, 16, C / per_block, per_block] (a view)."""
    *lead, n, c = t.shape
    return t.reshape(*lead, n // TILE_ROWS, TILE_ROWS, c // per_block, per_block)


def tile_tensor(key: str, t: Tensor, group: int) -> Tensor:
    """Row-major int4 tensor `key` ([..., N, C]) in the tiled layout, same shape (a new tensor)."""
    if key not in TILED_KEYS:
        return t
    return _blocks(t, _per_block(key, group)).transpose(-3, -2).contiguous().reshape(t.shape)


def untile_tensor(key: str, t: Tensor, group: int) -> Tensor:
    """tile_tensor's inverse: tiled tensor `key` back in row-major order (a new tensor)."""
    if key not in TILED_KEYS:
        return t
    *lead, n, c = t.shape
    per = _per_block(key, group)
    blocks = t.reshape(*lead, n // TILE_ROWS, c // per, TILE_ROWS, per)  # as stored: K tile, then row
    return blocks.transpose(-3, -2).contiguous().reshape(t.shape)


def tile_packed(packed: dict[str, Tensor], group: int) -> dict[str, Tensor]:
    return {key: tile_tensor(key, t, group) for key, t in packed.items()}


def untile_packed(packed: dict[str, Tensor], group: int) -> dict[str, Tensor]:
    return {key: untile_tensor(key, t, group) for key, t in packed.items()}
