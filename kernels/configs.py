"""Fixed tile configurations, chosen per kernel and per M bucket (no autotuning).

Naming: a kernel computes out[M, P] = a[M, R] @ B[R, P]. For the forward pass P = N and R = K; for
dX, P = K and R = N. block_r is therefore the K step of the forward and the N step of dX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .formats import INT4, TILE_K, PackedWeight
from .mode import is_batch_invariant


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # activation rows per program
    block_p: int  # output columns per program
    block_r: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    # Compute out^T = B^T a^T so the dequantized weight tile is the MMA's first operand: on Hopper
    # that operand may live in registers, so the decoded tile never round-trips through shared memory,
    # and a small M becomes the MMA's narrow N side instead of padding a 64-row side.
    swap_ab: bool = False
    split_k: int = 1  # reduction splits; 0 = pick from the grid size to fill the GPU
    group_m: int = 8  # programs along M walked together, for L2 reuse of weight tiles

    def __post_init__(self):
        for name in ("block_m", "block_p", "block_r"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (tl.dot minimum), got {v}")
        if self.split_k < 0:
            raise ValueError(f"TileConfig.split_k must be >= 0, got {self.split_k}")


# Forward (kind "fwd") and dX ("dx") configs by M bucket: (max M, config), picked from the H200 sweep
# in bench/kernels.py. Decode buckets split the reduction so that a GEMV-sized grid still fills every
# SM while streaming the packed bytes. Large M wants tall tiles: each decoded weight tile then serves
# 256 rows, which amortizes the decode work against the tensor-core work.
_FAST: dict[str, tuple[tuple[int, TileConfig], ...]] = {
    "fwd": (
        (16, TileConfig(16, 64, 256, num_warps=4, num_stages=4, swap_ab=True, split_k=0)),
        (64, TileConfig(64, 128, 128, num_warps=8, num_stages=4, swap_ab=True, split_k=0)),
        (256, TileConfig(128, 64, 128, num_warps=4, num_stages=4, swap_ab=True)),
        (1 << 62, TileConfig(256, 128, 64, num_warps=8, num_stages=4, swap_ab=True)),
    ),
    "dx": (
        (16, TileConfig(16, 64, 128, num_warps=4, num_stages=4, swap_ab=True, split_k=0)),
        (64, TileConfig(64, 128, 128, num_warps=8, num_stages=4, swap_ab=True, split_k=0)),
        (256, TileConfig(128, 64, 128, num_warps=4, num_stages=4, swap_ab=True)),
        (1 << 62, TileConfig(256, 128, 64, num_warps=8, num_stages=3, swap_ab=True)),
    ),
}
# Grouped MoE: M is the mean rows per expert, and split-K is never used there. Decode (<= 16 rows per expert: up
# to 256 tokens of a top-8-of-128 model) reads 128 of K per step: bench/RESULTS.md's sweep (H200, Qwen3-30B-A3B
# gate and down at 1-64 tokens) found it 4-13 % faster than 256, and no other tile faster.
_FAST["grouped_fwd"] = ((16, replace(_FAST["fwd"][0][1], block_r=128, split_k=1)),
                        *((m, replace(c, split_k=1)) for m, c in _FAST["fwd"][1:]))
_FAST["grouped_dx"] = tuple((m, replace(c, split_k=1)) for m, c in _FAST["dx"])

# Batch-invariant mode: one config per kind whatever M is, never split. Forward and grouped forward
# share it so a token's row is reduced identically by the dense and the MoE path's kernels.
_INVARIANT = TileConfig(64, 128, 64, num_warps=4, num_stages=4, swap_ab=True)

_CPU = TileConfig(32, 32, 32, num_warps=1, num_stages=1)  # interpreter: small tiles, exact same code
# fp32 activations get true fp32 products, which Hopper tensor cores lack: Triton then multiplies on
# the FMA units, where only small tiles fit in registers. A reference path, not a fast one.
_FP32 = TileConfig(32, 32, 32, num_warps=4, num_stages=2)


# The int4 forward on bf16 at 17-64 rows (the rollout's decode batches past the GEMV) with a long reduction: 256 of K
# per step. bench/kernels.py --sections midm (H200, two runs; bench/RESULTS.md, eleventh session), M = 64, against
# the bucket's config: Qwen3-8B down (K = 12288) 48.2 -> 38.7-38.9 us, DeepSeek-V3 mlp.down (18432) 100.4 ->
# 91.9-92.6 us, DeepSeek-V3 o (16384) a tie; at K = 8192 (Qwen3-235B-A22B o) it lost, 26.5 -> 30.2 us. Other formats
# and dtypes were not measured, so they keep the bucket's config.
LONG_K = 12288
_FWD_LONG_K = TileConfig(64, 128, 256, num_warps=8, num_stages=3, swap_ab=True, split_k=0)


def pick_config(kind: str, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                int4_r: int = 0) -> TileConfig:  # fmt: skip
    """The tile config for kernel `kind` ("fwd", "dx", "grouped_fwd", "grouped_dx") at M rows of
    `dtype` activations; int4_r: the reduction's length R for int4 weights on bf16 activations (0 otherwise)."""
    if kind not in _FAST:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {sorted(_FAST)}")
    if device.type != "cuda":
        return _CPU
    if dtype == torch.float32:
        return _FP32
    if is_batch_invariant():
        return _INVARIANT
    if kind == "fwd" and 16 < m <= 64 and int4_r >= LONG_K:
        return _FWD_LONG_K
    return next(cfg for bound, cfg in _FAST[kind] if m <= bound)


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the small-M forward kernel (gemv.py): block_m activation rows (M padded to it),
    block_n weight rows and block_k of K per iteration; k_iters iterations per program, so one split
    covers k_iters * block_k of K (0 = pick the split count so the grid holds ~programs_per_sm programs
    per SM). dot: multiply on the tensor cores (tl.dot) instead of the FMA units."""

    block_m: int
    block_n: int
    block_k: int
    k_iters: int = 0
    dot: bool = True
    num_warps: int = 1
    num_stages: int = 1
    programs_per_sm: int = 12
    prefetch: bool = True  # int4 packed path: load the next tile's words one iteration ahead
    two_tiles: bool = False  # dot: two block_k tiles per iteration (longer contiguous reads per row)
    maxnreg: int | None = None  # register cap per thread (more programs per SM), None = compiler's choice
    tma: bool = False  # int4: words and scales by TMA descriptors, num_stages deep (gemv._gemv_tma_kernel)
    mma: bool = False  # M <= 16 int4 on bf16: the per-thread mma kernel (gemv_mma.py), block_n // 16 row tiles per
    # warp, up to num_warps warps per program splitting K, ~programs_per_sm warps per SM, with:
    mma_tiles: int = 1  # adjacent 128-wide K tiles per step (a row's 64 * mma_tiles contiguous bytes per quad of lanes)
    l2_prefetch: int = 0  # the weight loads' L2 prefetch size hint in bytes (0, 64, 128 or 256)
    # lane t of a quad takes words 2t, 2t + 1, 2t + 8, 2t + 9 of a row's K tile instead of 4t..4t+3: half the L1
    # wavefronts for the activations, twice for the weights (gemv_mma._load_w_asm)
    mma_word_pairs: bool = False
    # the program's warps take alternate steps of K (warp w steps w, w + NW, ...) instead of a run each: at any time
    # the program reads NW * 64 * mma_tiles adjacent bytes of each row, not NW runs far apart (DRAM page locality)
    mma_interleave_k: bool = False

    @property
    def launch_options(self) -> dict:
        """The launch's register cap as Triton takes it (none: the compiler's choice)."""
        return {"maxnreg": self.maxnreg} if self.maxnreg else {}

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.dot and min(self.block_m, self.block_n) < 16:
            raise ValueError("GemvConfig with dot=True needs block_m and block_n >= 16 (tl.dot minimum)")
        if self.block_k < 32:
            raise ValueError(f"GemvConfig.block_k must be >= 32, got {self.block_k}")
        if self.mma and self.block_n not in (16, 32):
            raise ValueError(f"GemvConfig with mma=True takes block_n 16 or 32, got {self.block_n}")
        if self.mma_tiles not in (1, 2, 4) or self.l2_prefetch not in (0, 64, 128, 256):
            raise ValueError("GemvConfig.mma_tiles must be 1, 2 or 4 and l2_prefetch 0, 64, 128 or 256")
        if self.k_iters < 0 or self.programs_per_sm < 1:
            raise ValueError("GemvConfig.k_iters must be >= 0 and programs_per_sm >= 1")
        # 255: the hardware's maximum per thread; 24: setmaxnreg's floor (no kernel here fits below it unspilled)
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"GemvConfig.maxnreg caps registers per thread: None or 24-255, got {self.maxnreg}")


# Small-M forward (decode) on the bandwidth-bound kernel, by M bucket; larger M uses the tile GEMM. From
# bench/gemv_sweep.py on an H200 (graph_us, the dense shapes of bench/kernels.py): one warp per program,
# each 128-wide int4 tile decoded straight into the mma operand registers (gemv.py). M = 1: 16 weight
# rows per program, two tiles per step (256-byte reads per weight row) loaded one step ahead, x as one
# broadcast row. 2 <= M <= 16: 32 rows per program, one tile per step, no prefetch (registers, not
# latency, limit these). The split count fills ~8-12 one-warp programs per SM.
_GEMV: tuple[tuple[int, GemvConfig], ...] = (
    (1, GemvConfig(16, 16, 128, programs_per_sm=12, two_tiles=True)),
    (16, GemvConfig(16, 32, 128, programs_per_sm=8, prefetch=False)),
)
GEMV_MAX_M = _GEMV[-1][0]
GEMV_TILES = _GEMV  # the tile kernels' configs by M bound (where the mma kernel cannot serve)
GEMV_ONE_ROW = GEMV_TILES[0][1]
_GEMV_CPU = GemvConfig(16, 16, 32, k_iters=0, num_warps=1)  # interpreter: small tiles, same code


# M = 1 on a tall, short matrix (a fused gate/up, DeepSeek-V3's q_b): one program per 32 rows already gives every
# SM several, so K is not split (no partials, no reduction tail) and the TMA pipeline keeps 4 tiles in flight per
# program. bench/gemv_sweep.py --sections tma: Qwen3-8B gate_up (24576 x 4096) 31.7 -> 25.3 us, DeepSeek-V3 q_b
# 15.1 -> 12.9 us; a tie at K = 7168 and slower on shorter matrices, which keep the split kernel. Since the mma
# kernel below, only for weights that one cannot read.
_GEMV_TALL = GemvConfig(16, 32, 256, k_iters=64, num_stages=4, tma=True)

# M <= 8, int4 (groups >= 32) on bf16: the per-thread mma kernel (gemv_mma.py), about half the instructions per weight
# of the tile kernels above. bench/mma_sweep.py --sections mma (H200, 2026-11-30, bench/RESULTS.md): one row tile
# per warp, two adjacent K tiles per step (a row's whole 128-byte line per quad of lanes) with the L2 told to fetch
# 128 bytes, K split over up to 8 warps of a program, ~24 warps per SM, beats the split and TMA configs on every
# shape measured (Qwen3-8B qkv / o / gate_up / down 9.3 / 7.4 / 23.4 / 14.3 us against 10.4 / 9.2 / 26.1 TMA / 16.5).
# From K = 16384 (DeepSeek-V3's o and MLP down) two row tiles per warp do better still (27.1 and 30.0 us against
# 30.5 and 34.3). K not a multiple of 256 takes one tile per step.
# Up to M = 8 (one n8 tile of activation rows) the same configs lead (M = 4 / 8 geomean over bf16 2.06x / 1.86x
# against the tile kernel's 1.28x / 1.30x); at M = 16 the mma kernel's best (1.37x) barely beats it (1.26x) and loses
# on some shapes, so M > 8 takes wgmma_int4 on Hopper (gemm.dense_gemm), but for small weights (below).
MMA_MAX_M = 8
# K tiles a step at 9-16 rows (two n8 tiles of activations, twice the activation registers a step).
MMA_WIDE_TILES = 1
# 9-16 rows (twenty-ninth session, bench/mma_sweep.py --sections pairs, H200, two runs; bench/RESULTS.md): the
# word-pair lane layout halves the L1 wavefronts of the activation loads that limit the mma GEMV there, which took
# its one-row-tile config from 1.18x to 1.54x bf16 (geomean, 12 shapes) and past wgmma_int4 on every weight of fewer
# than 16384 rows (Qwen3-8B qkv 13.3 -> 10.2 us, DeepSeek-V3 o 34.9 -> 31.8). One row tile a warp leads there
# (Qwen3-30B-A3B qkv 6.4 us against 7.3 with two). At 1-8 rows the layout's extra registers (94 against 80) cost a
# program per SM on the larger grids, and it tied overall: those rows keep the shipped layout.
# At 9-16 rows the weight loads go without the L2 prefetch hint (thirtieth session, bench/mma_sweep.py --sections ab,
# an H100, three alternating rounds; bench/RESULTS.md): geomean x bf16 at M = 9 2.095 -> 2.210, M = 16 2.082 -> 2.158
# (Qwen3-8B qkv at 9 rows 11.0 -> 9.4 us, Qwen3-235B-A22B qkv 17.1 -> 15.0); at 1-8 rows the hint held (M = 1 2.592
# with it, 2.570 without). In the word-pair layout a quad asks for 32 bytes a row per load, two loads a K tile.
MMA_WIDE_L2_PREFETCH = 0
MMA_WORD_PAIRS_FROM = 9  # rows from which the mma GEMV takes the word-pair layout (17: never)
MMA_WIDE_MAX_N = 16384  # at 9-16 rows the mma GEMV serves weights of fewer rows than this, whatever their size
_GEMV_MMA = GemvConfig(16, 16, 128, mma=True, num_warps=8, programs_per_sm=24, mma_tiles=2, l2_prefetch=128)
# Long K takes its warps on alternate K steps (thirty-sixth session, `bench/mma_sweep.py --sections interleave`, an
# H100, three alternating rounds; bench/RESULTS.md): DeepSeek-V3 o / mlp.down at 16 rows 37.7 -> 32.5 / 42.0 -> 36.5
# us, at 9 rows 36.1 -> 31.9 / 40.9 -> 35.5, at one row 28.5 -> 28.3 / 32.2 -> 31.8. On shorter K it won and lost by
# shape.
_GEMV_MMA_LONG_K = GemvConfig(16, 32, 128, mma=True, num_warps=8, programs_per_sm=16, mma_tiles=2,
                              mma_interleave_k=True)
_GEMV_MMA_ONE_TILE = GemvConfig(16, 16, 128, mma=True, num_warps=8, programs_per_sm=24, l2_prefetch=128)
# Two row tiles per warp beyond one row (H200, twenty-fifth session; two runs each of 9ac814a's gemv_sweep m16rw and
# mt4 sections, and `bench/mma_sweep.py --sections shapes` measures the shipped configs against the dispatch): at
# 2-8 rows on tall matrices (N >= 16384) Qwen3-8B gate_up 27.1 -> 23.4 us, DeepSeek-V3 q_b 11.8 -> 10.7, its MLP
# gate_up 65.4 -> 55.8 (at M = 1 a tie or slower: M = 1 keeps _GEMV_MMA). (At 9-16 rows, before the word-pair layout,
# they served the small weights: Qwen3-8B o 10.7 -> 8.8 us; with it one row tile does better, above.)
_GEMV_MMA_TWO_ROWTILES = replace(_GEMV_MMA, block_n=32, programs_per_sm=16)
MMA_SMALL_WEIGHT = 1 << 24  # N * K up to which the mma GEMV serves 9-16 rows instead of wgmma_int4 (4096 x 4096)
MMA_SHAPE_DISPATCH = True  # False: both rules above off, the dispatch before them (bench --old-mma-dispatch A/B)
# int4-tiled weights take the mma GEMV at 9-16 rows whatever their size: tiled, it beat wgmma_int4 (row-major) on the
# tall ones (H200, thirty-seventh session's probe). wgmma_int4 reads int4-tiled too now; False sends the tall tiled
# weights there as the row-major ones go (the A/B of `bench/mma_sweep.py --sections tiled`).
MMA_TILED_ALL_N = True


def _mma_config(m: int, w: PackedWeight) -> GemvConfig:
    """The mma GEMV's config for M rows of `w` (up to 8, or 16 where pick_gemv sends them), before _at_rows: see the
    measurements above."""
    if w.k >= 16384:
        return _GEMV_MMA_LONG_K
    return _GEMV_MMA_TWO_ROWTILES if MMA_SHAPE_DISPATCH and 1 < m <= MMA_MAX_M and w.n >= 16384 else _GEMV_MMA


def _at_rows(cfg: GemvConfig, m: int) -> GemvConfig:
    """An mma config as it serves m rows: past MMA_MAX_M rows at most MMA_WIDE_TILES K tiles a step and the L2
    prefetch hint MMA_WIDE_L2_PREFETCH, and the word-pair layout from MMA_WORD_PAIRS_FROM rows. (At 1-8 rows the layout
    on grids of at most two programs per SM, where its registers cost no program, lost on as many shapes as it won:
    bench/RESULTS.md, twenty-ninth session, item 8.)"""
    wide = m > MMA_MAX_M
    return _variant(cfg, MMA_WIDE_TILES if wide else cfg.mma_tiles, m >= MMA_WORD_PAIRS_FROM,
                    MMA_WIDE_L2_PREFETCH if wide else cfg.l2_prefetch)


@functools.cache  # (on the decode dispatch: built once, not per launch)
def _variant(cfg: GemvConfig, tiles: int, pairs: bool, l2_prefetch: int) -> GemvConfig:
    return replace(cfg, mma_tiles=min(cfg.mma_tiles, tiles), mma_word_pairs=pairs, l2_prefetch=l2_prefetch)


def pick_gemv(m: int, device: torch.device, dtype: torch.dtype, packed_int4: bool,
              w: PackedWeight | None = None) -> GemvConfig | None:  # fmt: skip
    """The small-M kernel's config for M rows of `dtype` activations times weight `w`, or None where the
    tile GEMM serves: larger M, batch-invariant mode (its single fixed tile config must serve every M) and, on
    the GPU, anything but int4 through the packed-bf16 decoder (`packed_int4`; bf16 activations): the kernel
    reads every format, but was tuned and measured on that one only."""
    if m > GEMV_MAX_M or is_batch_invariant():
        return None
    if device.type != "cuda":
        return _GEMV_CPU
    if not packed_int4:
        return None
    tiled = w is not None and w.tiled and MMA_TILED_ALL_N
    if w is not None and (m <= MMA_MAX_M or tiled or (MMA_SHAPE_DISPATCH and (w.n * w.k <= MMA_SMALL_WEIGHT
                                                                              or w.n < MMA_WIDE_MAX_N))):  # fmt: skip
        for cfg in (_mma_config(m, w), _GEMV_MMA_ONE_TILE):
            cfg = _at_rows(cfg, m)
            if mma_ok(w, cfg):
                return cfg
    if m == 1 and w is not None and w.k <= 4096 and w.n >= 4 * _GEMV_TALL.block_n * sm_count(device):
        if tma_ok(w, _GEMV_TALL):
            return _GEMV_TALL
    return next(cfg for bound, cfg in _GEMV if m <= bound)


FUSE_LORA_MIN_K = 4096


def fuse_lora(m: int, k: int, cfg: GemvConfig) -> bool:
    """Whether the small-M kernel of config `cfg` adds the LoRA deltas of x [m, k] in its own launch (gemv_lora.py),
    rather than `lora_add_many` after it. The fused adapters pay only where the GEMV's own loop is long enough to
    hide the rank programs' chain (x A^T by slices, the last summing the partials, then t published): the mma GEMV
    fuses them at M = 1 and K >= FUSE_LORA_MIN_K only. bench/gemv_sweep.py --sections lora (H200, twentieth
    session; us over the base GEMV, fused / after): M = 1 Qwen3-8B o 1.0 / 4.5, down 2.3 / 7.6, gate_up 3.8 / 5.1,
    qkv 4.1 / 4.2, but Qwen3-30B-A3B qkv (K = 2048) 4.6 / 3.9 and DeepSeek-V3 q_b (K = 1536) 7.6 / 4.0; at 2-8 rows
    (tensor-core slices of 256) fused cost more on every shape but down: qkv 8.1-8.5 / 5.5-5.9, gate_up 7.5-14.7 /
    5.0-5.6, q_b 22-49 / 4.0-5.1, down 4.9-6.0 / 7.4-7.9. The tile kernels (CPU, GPUs without the mma path) keep
    fusing wherever the adapters fit, as measured before them."""
    return not cfg.mma or (m == 1 and k >= FUSE_LORA_MIN_K)


# TILE_K (formats.py): K per step of the mma kernel's warps (gemv_mma.py: 4 lanes x 32 values), int4-tiled's block


def mma_ok(w: PackedWeight, cfg: GemvConfig, stacked: bool = False) -> bool:
    """Whether gemv_mma.py's kernel (grouped_mma.py's for `stacked` experts) reads `w` (with bf16 activations on an
    sm_80+ GPU, M <= 16): int4 with groups of at least 32 (a lane's 32 values share a scale), K a multiple of its
    steps (mma_tiles of 128), N of block_n, contiguous words on 16 bytes and, for the word-pair layout, scales on 8
    (each lane loads a row's 8 bytes of scales of a K tile; the activations' alignment is the caller's to check)."""
    step = TILE_K * cfg.mma_tiles
    return (w.int4 and (w.experts is not None) == stacked and w.group >= 32 and w.k % step == 0
            and w.n % cfg.block_n == 0 and w.values.is_contiguous() and w.scale.is_contiguous()
            and w.values.data_ptr() % 16 == 0 and (not cfg.mma_word_pairs or w.scale.data_ptr() % 8 == 0))


def max_row_tiles(rows: int, block_m: int, experts: int) -> int:
    """Row tiles the grouped kernels' grids provide for `rows` rows sorted over `experts` experts, each expert's rows
    in tiles of block_m: each tile holds >= 1 row and each expert wastes < 1 tile."""
    return min(rows, _cdiv(rows, block_m) + experts)


# MoE decode, int4 (groups >= 32) on bf16: grouped_mma.py, gemv_mma.py's loop on one expert's 8-row tile per program.
# bench/moe_sweeps.py --sections mma (H200, graph_us with a cold L2, Qwen3-30B-A3B gate [128 x 768 x 2048] / down,
# top-8 of 128; bench/RESULTS.md), against the tile kernel: 1 token 12.9 -> 7.3 / 8.9 -> 7.0 us, 64 tokens 70.3 ->
# 40.6 / 70.1 -> 42.8, 256 tokens (16 rows per expert) 95.9 -> 81.6 / 97.5 -> 85.5, 512 tokens 100.6 -> 141.9 / 105.1
# -> 150.4: each further 8 rows of an expert read its weights again, so the kernel serves batches of up to
# GROUPED_MMA_ROWS rows per expert on average. Two row tiles per warp (block_n 32) lead from ~4 programs per SM (64+
# tokens: 40.6 against 44.3 us), one below (1 token: 7.3 against 8.2). A K not in whole steps of 256 takes one tile
# per step. Eight warps per program measured no better than four. programs_per_sm sizes the K split over the warps
# (warps_for); at 96-136 registers only 12-20 of those warps are resident per SM at once.
GROUPED_MMA_ROWS = 16
MMA_ROW_TILE = 8  # activation rows per grouped_mma program: one n8 tile, the mma's columns
GROUPED_MMA_MAX_RANK = 64  # expert LoRA ranks its epilogue takes: from 128 u and B spill (compile test), torch serves
GROUPED_MMA_SWIGLU = True  # gate, up and SiLU-mul in one launch there (kernels.grouped_dequant_swiglu); False: three
GROUPED_MMA_LORA = True  # expert LoRA in its epilogue (grouped_dequant_swiglu / _lora); False: torch's grouped GEMMs
_GROUPED_MMA = GemvConfig(16, 32, 128, mma=True, num_warps=4, programs_per_sm=24, mma_tiles=2, l2_prefetch=128)
_GROUPED_MMA_NARROW = (replace(_GROUPED_MMA, block_n=16), replace(_GROUPED_MMA, block_n=16, mma_tiles=1))


def pick_grouped_mma(x: torch.Tensor, w: PackedWeight, swiglu: bool = False) -> GemvConfig | None:
    """grouped_mma.py's config for the sorted rows x [T, K] (bf16, int4 `w`: the caller checks) of stacked experts
    `w`, or None where grouped.py's tile kernel serves: batch-invariant mode (one fixed tile config for every
    batch), more than GROUPED_MMA_ROWS rows per expert, rows off 16-byte boundaries, weights it cannot read.
    `swiglu`: for gate and up in one launch, whose programs take 16 rows of each (block_n 16)."""
    if is_batch_invariant() or x.device.type != "cuda" or x.dim() != 2 or w.experts is None:
        return None  # (malformed arguments go on to the tile kernel's checks)
    t = x.shape[0]
    if t > GROUPED_MMA_ROWS * w.experts or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return None
    wide = max_row_tiles(t, MMA_ROW_TILE, w.experts) * (w.n // _GROUPED_MMA.block_n) >= 4 * sm_count(x.device)
    for cfg in ((_GROUPED_MMA,) if wide and not swiglu else ()) + _GROUPED_MMA_NARROW:
        if mma_ok(w, cfg, stacked=True):
            return cfg
    return None


def tma_ok(w: PackedWeight, cfg: GemvConfig) -> bool:
    """Whether the descriptor variant reads `w`: int4 whose rows of words and of scales are 16-byte
    multiples (TMA strides), with whole groups per tile and a 16-byte scale box."""
    return (w.fmt.code == INT4 and w.experts is None and w.k % 32 == 0 and w.scale.shape[-1] % 8 == 0
            and cfg.block_k >= 8 * w.group and w.values.is_contiguous() and w.scale.is_contiguous())  # fmt: skip


# The mma GEMV's outputs without LoRA stored straight from the cross-warp sum (gemv_mma._store_reduced) instead of
# assembled into a tile first (the LoRA epilogue's path); set False to compare (bench/gemv_sweep.py --sections
# epilogue). The sums are the same either way.
MMA_DIRECT_STORE = True
# Decode int4 with the packed-bf16 PTX path when activations are bf16 (see dequant.py); set False to
# force the generic fp32 decoder, e.g. to compare the two bit for bit.
FAST_INT4 = True
# int4 on bf16 at 9 to wgmma_int4.MAX_ROWS rows on Hopper: the warpgroup-MMA kernel (wgmma_int4.py) instead of the
# decode GEMV (9-16), the tile kernel (17-64) and dequantize + cuBLAS (65 up); set False to compare (bench/rollout.py
# --no-wgmma; --no-wgmma-rows keeps it to 64 rows).
WGMMA_INT4 = True
# MoE prefill and training, int4 g32 on bf16 on Hopper: chunks of experts (their sizes read on the host) averaging at
# most this many rows per expert run the grouped warpgroup-MMA kernel (wgmma_int4_grouped, which reads only the packed
# bytes) instead of dequantizing the chunk to bf16 for torch's grouped GEMM. H200, 6 MoE projections (bench/RESULTS.md,
# fifteenth session), forward x grouped_mm with two independent MMA warpgroups (Tile.parts = 2): 0.94 / 0.95 / 0.92 at
# 8k / 16k / 32k tokens (256-2048 rows per expert) against 0.73 / 0.85 / 0.90 for dequantize + grouped_mm; per shape
# within 0.04 of it where it trails. Below 64 rows per expert the device-group kernels take the batch without a host
# read (quant.dispatch.FUSED_MAX_ROWS).
WGMMA_GROUPED_MAX_ROWS = 2048
# Their dX (wgmma_int4_dx) wins over dequantize + grouped_mm only further down: at 256-512 rows per expert (8k tokens)
# 0.70-0.92 against 0.63-0.79 (five shapes of six; Qwen3-30B-A3B gate_up 0.70 against 0.79), at 512-1024 (16k) about
# even, at 1024-2048 (32k) 0.83 against 0.89.
WGMMA_GROUPED_DX_MAX_ROWS = 512


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


CPU_SMS = 132  # an H200's: what the CPU (Triton's interpreter) assumes, so its tests take the GPU's decisions


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device); CPU_SMS elsewhere."""
    if device.type != "cuda":
        return CPU_SMS
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once per device (torch reads the properties on every call, ~10 us
    of host time, and every dispatch asks)."""
    props = _properties(_index(device))
    return props.major, props.minor


def split_evenly(length: int, splits: int, step: int) -> tuple[int, int]:
    """(length per split, a multiple of `step`; the number of splits, none of them empty) for `length` in ~`splits`."""
    per_split = _cdiv(_cdiv(length, splits), step) * step
    return per_split, _cdiv(length, per_split)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def auto_split(cfg: TileConfig, programs: int, r: int, device: torch.device) -> int:
    """Number of reduction splits: cfg.split_k, or (when it is 0) enough to give ~2 programs per SM."""
    n_r_tiles = _cdiv(r, cfg.block_r)
    if cfg.split_k:
        return max(1, min(cfg.split_k, n_r_tiles))
    if device.type != "cuda":
        return 1
    want = _cdiv(2 * sm_count(device), max(programs, 1))
    return max(1, min(want, n_r_tiles, 32))


def gemv_splits(cfg: GemvConfig, programs: int, k: int, device: torch.device, step: int) -> int:
    """Iterations per program of the small-M kernel (each covers `step` of K): cfg.k_iters, or (when it is
    0) the fewest that leave about cfg.programs_per_sm programs per SM over `programs` output tiles (one
    split on the CPU)."""
    n_k_tiles = _cdiv(k, step)
    if cfg.k_iters:
        return min(cfg.k_iters, n_k_tiles)
    if device.type != "cuda":
        return n_k_tiles
    splits = max(1, min(n_k_tiles, _cdiv(cfg.programs_per_sm * sm_count(device), max(programs, 1))))
    return _cdiv(n_k_tiles, splits)
