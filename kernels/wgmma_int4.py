"""int4 x bf16 GEMM on Hopper's warpgroup MMA (written in Gluon) for the rollout's decode batches: 9-512 rows.

Why a third dense kernel: at 9-64 rows the GEMM is still bound by the weight bytes, where int4 should be up to 4x
faster than bf16; yet Triton's tile kernel (gemm.py) decodes its weight tile in a blocked layout, moves it to the
MMA operand layout through shared memory, and lost to cuBLAS on a bf16 weight four times its size (0.83x at M = 64,
bench/RESULTS.md). Gluon fixes every layout by hand:

- Swapped product, out^T [N, M] = W [N, K] x^T: the weight is wgmma's A operand, which lives in registers; the
  activations are B, read from shared memory. M is wgmma's N side (tiles of 16, 32 or 64 rows; past 64 rows,
  pick_tile's wider tiles).
- Warp-specialized: one loader warp fills a STAGES-deep ring with each K step's activations and packed words by
  TMA (rows past M, N or K read zeros: a zero word past K decodes to -8 times its scale, but meets zero
  activations); the four MMA warps take the words from shared memory straight into the operand's layout. A k16
  slice of a row is two words, and lane t of a quad holds values 2t, 2t + 1 and 2t + 8, 2t + 9: byte t of each
  word. `prmt` places that byte's nibbles 16 bits apart, then dequant.py's bf16 decode (lop3 into bf16 128 + n, fma
  by -136, fma by the scale) gives one bf16x2 register, bit-identical to every other kernel's weights. Every layout
  step is checked trivial at compile time (convert_layout(assert_trivial=True)).
- Each step's wgmma completes before the next step decodes into its register operand (see _mma_partition); two or
  three programs per SM overlap one's decode with another's MMA (at training sizes, one program's two warpgroups,
  each a partition of its own: Tile.parts). A step's scales are a few bytes per row, below
  TMA's 16-byte box: the loader fetches chunks of 8 groups (2 steps at group 32, 8 at 128) into a ring of their
  own, and the MMA warps read each step's from shared memory.
- The K range splits over programs when N alone does not fill the GPU; the last program to finish a tile sums the
  fp32 partials in split order (gemm.py's scheme), so results do not depend on timing.

Triton's interpreter cannot run Gluon, so the CPU tests compile this kernel for sm_90 (which checks the layouts) and
the GPU tests hold it to the fp64 oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from .configs import capability, max_row_tiles, sm_count, split_evenly
from .dequant import _INT4_BF16_ASM
from .formats import SCALE_GROUPS, TILE_K, PackedWeight
from .pdl import gluon_launch_dependents, gluon_wait, use_pdl
from .timeline import CYCLES, check_stamps, gluon_stamp
from .wgmma_common import find_tile, packed_desc, smem_layout, store_block, tma_desc, tma_load, tma_load_rows

MIN_ROWS = 9  # below, gemv_mma.py's decode GEMV serves (one n8 tile of rows; 1.86-2.06x bf16 at M = 4-8)
# Scale groups per TMA box: 8 bf16 = 16 bytes, TMA's smallest inner box. A chunk spans 8 * GROUP of K (CS steps).
SCALE_CHUNK = gl.constexpr(SCALE_GROUPS)  # (int4-tiled's scale blocks are as wide: a chunk's box is a block row)
WORDS_PER_BLOCK = gl.constexpr(TILE_K // 8)  # int4-tiled's words: a block row is a K tile's 16 words
# Timeline stamps (kernels/timeline.py; bench/wgmma_timeline.py): cycle counts when a program's first step has
# landed, when its last wgmma is done, at exit, and when the loader began to issue loads (entry and exit on the
# global timer are timeline's own slots). A phase is timed on one clock: the global timer's exit less a cycle-timed
# loop end read the tail 1-2 us long. (The loader and the MMA warps share their SM's cycle counter.)
FIRST_DATA, LOOP_END, EXIT_CYCLES = gl.constexpr(CYCLES + 1), gl.constexpr(CYCLES + 2), gl.constexpr(CYCLES + 3)
FIRST_ISSUE = gl.constexpr(CYCLES + 4)

# Byte t of the word ($2) and of the word shifted by 4 bits, by the prmt selector $3 = t | (t + 4) << 8, puts the
# byte's low nibble (value 2t of the word) at bit 0 and its high nibble (value 2t + 1) at bit 16; then dequant.py's
# decode of one register (its own lines, so that the two cannot drift apart): lop3 into bf16 128 + n, fma by -136,
# fma by the scale $4.
_DECODE_LINES = ("mov.b32 s2,", "mov.b32 one,", "mov.b32 off,", "mov.b32 nz,", "lop3.b32 t0,", "fma.rn.bf16x2 t0,")
_DECODE = "".join(line.replace("$8", "t0").replace("$9", "$4") + "\n" for line in _INT4_BF16_ASM.value.splitlines()
                  if line.startswith(_DECODE_LINES))
_PAIR_ASM = gl.constexpr("{\n.reg .b32 w4, t0, s2, one, off, nz;\nshr.u32 w4, $2, 4;\nprmt.b32 t0, $2, w4, $3;\n"
                         + _DECODE + "mov.b32 {$0, $1}, t0;\n}\n")
# int4-tiled's words hold values 2t and 2t + 1 in nibbles t and t + 4 (quant/formats/tiled.py): the word shifted by
# $3 = 4t has them at bits 0 and 16, one shift where the permute took two instructions.
_TILED_PAIR_ASM = gl.constexpr("{\n.reg .b32 t0, s2, one, off, nz;\nshr.u32 t0, $2, $3;\n" + _DECODE
                               + "mov.b32 {$0, $1}, t0;\n}\n")


@gluon.constexpr_function
def _word_layout(BN, BK, num_warps):
    """The layout of a step's words [BN, BK // 8] expanded by the byte index t = 0..3 to [BN, BK // 8, 4]: lane t of
    a quad takes byte t of every word it holds, which flattened (pair p = 4 * word + t) is the A operand's layout for
    32-bit values (DotOperandLayout k_width 1), where pair p sits where values 2p, 2p + 1 do for bf16. One warp per 16
    rows (BN = 16 * num_warps); registers: row + 8, then the words; lanes: t, then rows; warps: rows."""
    regs = [[8, 0, 0]] + [[0, 1 << i, 0] for i in range((BK // 8).bit_length() - 1)]
    lanes = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[BN, BK // 8, 4])


@gluon.constexpr_function
def _scale_layout(BN, GPS, WPG, num_warps):
    """[BN, GPS, WPG]: a step's GPS scale groups of WPG words each, laid out so that dropping WPG gives the loaded
    scales [BN, GPS] (each thread's rows, all their groups in registers) and flattening (GPS, WPG) gives the words'
    layout (SliceLayout(2, _word_layout)), so broadcasting a scale over its words moves nothing."""
    regs = [[8, 0, 0]] + [[0, 0, 1 << i] for i in range(WPG.bit_length() - 1)]
    regs += [[0, 1 << i, 0] for i in range(GPS.bit_length() - 1)]
    lanes = [[0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[BN, GPS, WPG])


@gluon.jit
def _word_scales(scales, BN: gl.constexpr, BK: gl.constexpr, GPS: gl.constexpr, WPG: gl.constexpr,
                 l3: gl.constexpr, words_layout: gl.constexpr):
    """bf16 [BN, BK // 8, 1]: each word's scale, broadcast from the step's [BN, GPS] in registers."""
    zero = gl.full([BN, GPS, WPG], 0.0, gl.bfloat16, l3)
    full = gl.reshape(gl.expand_dims(scales, 2) + zero, [BN, BK // 8])
    return gl.expand_dims(gl.convert_layout(full, words_layout, assert_trivial=True), 2)


@gluon.jit
def _load_scales(s_desc, s_smem, s_ready, sslot, w_row, g, TILED: gl.constexpr):
    mbarrier.expect(s_ready.index(sslot), s_desc.block_type.nbytes)
    tma_load_rows(s_desc, w_row, g, s_ready.index(sslot), s_smem.index(sslot), SCALE_CHUNK, TILED)


@gluon.jit
def _load_step(x_desc, w_desc, x_smem, w_smem, ready, slot, m_lo, w_row, k, WORDS: gl.constexpr,
               TILED: gl.constexpr):
    """A step's activations and (WORDS) words into ring slot `slot`; without WORDS they went out already, under the
    slot's expected bytes for both. TILED: int4-tiled words (wgmma_common.packed_desc)."""
    if WORDS:
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma_load(x_desc, [m_lo, k], ready.index(slot), x_smem.index(slot))
    if WORDS:
        tma_load_rows(w_desc, w_row, k // 8, ready.index(slot), w_smem.index(slot), WORDS_PER_BLOCK, TILED)


@gluon.jit
def _load_partition(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, w_row, m_lo,
                    k_lo, n_chunks, GROUP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    CS: gl.constexpr, SSTAGES: gl.constexpr, TILED: gl.constexpr, stamps_ptr=None, program=0,
                    STAMPS: gl.constexpr = False, PDL: gl.constexpr = False):
    """One warp: TMA loads, as slots come free, of each chunk's scales (CS steps' worth) into their ring and of each
    step's activations and words into theirs. PDL: the first scale chunk and the first STAGES steps' words go out
    before the wait for the kernel before this one (it may write x; no kernel writes the frozen packed weights), so
    the ring's fill, the first TMA's 1-2 us latency, overlaps that kernel's tail."""
    gluon_stamp(stamps_ptr, program, FIRST_ISSUE, STAMPS)
    # (The PDL branches below stay constexpr: a runtime `c >= 0` or `i >= 0` in their place puts a warp sync in the
    # plain build's loop, as compiled for sm_90.)
    if PDL:
        if n_chunks > 0:
            _load_scales(s_desc, s_smem, s_ready, 0, w_row, k_lo // GROUP, TILED)
        for j in gl.static_range(STAGES):
            if j < n_chunks * CS:
                mbarrier.expect(ready.index(j), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma_load_rows(w_desc, w_row, (k_lo + j * BK) // 8, ready.index(j), w_smem.index(j), WORDS_PER_BLOCK,
                              TILED)
        gluon_wait()
        gluon_launch_dependents()
    for c in range(n_chunks):
        sslot = c % SSTAGES
        mbarrier.wait(s_empty.index(sslot), ((c // SSTAGES) & 1) ^ 1)  # (fresh barriers count as released)
        if PDL:
            if c > 0:
                _load_scales(s_desc, s_smem, s_ready, sslot, w_row, k_lo // GROUP + c * SCALE_CHUNK, TILED)
        else:
            _load_scales(s_desc, s_smem, s_ready, sslot, w_row, k_lo // GROUP + c * SCALE_CHUNK, TILED)
        for j in gl.static_range(CS):
            i = c * CS + j
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            if PDL:
                if i < STAGES:
                    _load_step(x_desc, w_desc, x_smem, w_smem, ready, slot, m_lo, w_row, k_lo + i * BK, False, TILED)
                else:
                    _load_step(x_desc, w_desc, x_smem, w_smem, ready, slot, m_lo, w_row, k_lo + i * BK, True, TILED)
            else:
                _load_step(x_desc, w_desc, x_smem, w_smem, ready, slot, m_lo, w_row, k_lo + i * BK, True, TILED)


@gluon.jit
def _mma_partition(x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, rows, ROW0: gl.constexpr,
                   GROUP: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   CS: gl.constexpr, SSTAGES: gl.constexpr, HALVES: gl.constexpr, TILED: gl.constexpr,
                   num_warps: gl.constexpr, stamps_ptr=None, program=0, STAMPS: gl.constexpr = False):
    """MMA warps: decode each step's words (the BN weight rows from ROW0 of the slot's tile) into wgmma's register
    operand and multiply. HALVES: the BM activation rows as two halves with their own accumulators, the second
    multiplied only when the tile has more than BM / 2 `rows` (an expert's last tile often holds a few). TILED:
    int4-tiled's nibble order."""
    HM: gl.constexpr = BM // 2 if HALVES else BM
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    pair_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    w3: gl.constexpr = _word_layout(BN, BK, num_warps)
    words_layout: gl.constexpr = gl.SliceLayout(2, w3)

    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, w3)))
    if TILED:  # [1, 1, 4]: the shift, or the prmt selector, of the decode's asm
        sel = gl.expand_dims(gl.expand_dims(4 * byte, 0), 0)
    else:
        sel = gl.expand_dims(gl.expand_dims(byte | ((byte + 4) << 8), 0), 0)
    GPS: gl.constexpr = BK // GROUP if BK > GROUP else 1  # scale groups per step
    WPG: gl.constexpr = BK // 8 // GPS  # words per group within a step
    l3s: gl.constexpr = _scale_layout(BN, GPS, WPG, num_warps)
    s_layout: gl.constexpr = gl.SliceLayout(2, l3s)

    acc = gl.zeros([BN, HM], gl.float32, acc_layout)
    if HALVES:
        acc_hi = gl.zeros([BN, HM], gl.float32, acc_layout)
        two = rows > HM
    for c in range(n_chunks):
        sslot = c % SSTAGES
        mbarrier.wait(s_ready.index(sslot), (c // SSTAGES) & 1)
        for j in gl.static_range(CS):
            i = c * CS + j
            slot = i % STAGES
            scales = s_smem.index(sslot).slice(ROW0, BN, dim=0).slice(j * GPS, GPS, dim=1).load(s_layout)
            scales = _word_scales(scales, BN, BK, GPS, WPG, l3s, words_layout)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if STAMPS and j == 0:
                if c == 0:
                    gluon_stamp(stamps_ptr, program, FIRST_DATA, True)
            words = gl.expand_dims(w_smem.index(slot).slice(ROW0, BN, dim=0).load(words_layout), 2)
            lo, hi = gl.inline_asm_elementwise(_TILED_PAIR_ASM if TILED else _PAIR_ASM, "=h,=h,r,r,h",
                                               [words, sel, scales], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                               pack=1)  # fmt: skip
            lo = gl.convert_layout(gl.reshape(lo, [BN, BK // 2]), pair_layout, assert_trivial=True)
            hi = gl.convert_layout(gl.reshape(hi, [BN, BK // 2]), pair_layout, assert_trivial=True)
            a = gl.convert_layout(gl.reshape(gl.join(lo, hi), [BN, BK]), a_layout, assert_trivial=True)
            # Synchronous: wgmma reads its register operand asynchronously, and writing those registers before the
            # wait is undefined (PTX ISA). With one MMA left in flight (warpgroup_mma_wait(1)) ptxas gave the next
            # step's decode the same registers, and an H200 returned NaNs at 64 rows, group 128; the wait's deps keep
            # the bf16 values alive, not the packed registers the MMA reads. The other programs on the SM overlap.
            if HALVES:
                acc = warpgroup_mma(a, x_smem.index(slot).slice(0, HM, dim=0).permute((1, 0)), acc)
                if two:
                    acc_hi = warpgroup_mma(a, x_smem.index(slot).slice(HM, HM, dim=0).permute((1, 0)), acc_hi)
            else:
                acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc)
            fence_async_shared()  # (this step's words were read by ordinary loads; the slot's next fill is by TMA)
            mbarrier.arrive(empty.index(slot))
        fence_async_shared()
        mbarrier.arrive(s_empty.index(sslot))
    gluon_stamp(stamps_ptr, program, LOOP_END, STAMPS)
    if not HALVES:
        acc_hi = acc  # (one result or two, the same tuple type)
    return acc, acc_hi


@gluon.jit
def _mma_store_partition(x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, out_ptr, n_lo, m_lo, m_end,
                         M, N, stride_om, ROW0: gl.constexpr, GROUP: gl.constexpr, BN: gl.constexpr,
                         BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, CS: gl.constexpr,
                         SSTAGES: gl.constexpr, TILED: gl.constexpr, num_warps: gl.constexpr):
    """One of the independent warpgroups (Tile.parts): its BN weight rows from ROW0 of the tile, in halves, stored by
    its own warps (a worker partition returns nothing)."""
    acc, acc_hi = _mma_partition(x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, m_end - m_lo, ROW0,
                                 GROUP, BN, BM, BK, STAGES, CS, SSTAGES, True, TILED, num_warps)
    store_block(acc, out_ptr, out_ptr, out_ptr, 0, n_lo + ROW0, 0, m_lo, m_end, M, N, 1, stride_om, BN, BM // 2, False,
                False, num_warps)
    store_block(acc_hi, out_ptr, out_ptr, out_ptr, 0, n_lo + ROW0, 0, m_lo + BM // 2, m_end, M, N, 1, stride_om, BN,
                BM // 2, False, False, num_warps)


# M is never specialized (Triton would compile M % 16 == 0 apart), nor the split count: one binary per tile shape.
@gluon.jit(do_not_specialize=["M", "n_splits", "num_experts"])
def _wgmma_int4_kernel(x_desc, w_desc, s_desc, out_ptr, ws_ptr, cnt_ptr, offsets_ptr, ids_ptr, stamps_ptr, M, N, K,
                       k_per_split, n_splits, num_experts, stride_om,
                       GROUP: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, SSTAGES: gl.constexpr, SPLIT: gl.constexpr, GROUPED: gl.constexpr,
                       HALVES: gl.constexpr, HAS_IDS: gl.constexpr, E_POW2: gl.constexpr, PARTS: gl.constexpr,
                       WORKER_REGS: gl.constexpr, STAMPS: gl.constexpr, PDL: gl.constexpr, TILED: gl.constexpr,
                       W_SMEM: gl.constexpr, S_SMEM: gl.constexpr, num_warps: gl.constexpr):
    # PDL's waits sit in the loader and before the one-partition stores; the grouped kernel reads the offsets first.
    gl.static_assert(not PDL or (PARTS == 1 and not GROUPED), "PDL launches take dense one-partition tiles only")
    pid_n = gl.program_id(0)
    program = pid_n + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    gluon_stamp(stamps_ptr, program, 0, STAMPS)
    split = gl.program_id(1)
    k_lo = split * k_per_split
    # Whole chunks of CS steps (k_per_split is a multiple of CS * BK); steps past K read zeros (TMA's bounds).
    CS: gl.constexpr = SCALE_CHUNK * GROUP // BK
    n_chunks = gl.cdiv(gl.minimum(k_lo + k_per_split, K) - k_lo, CS * BK)
    if GROUPED:
        # Rows sorted by group; program (n tile, 0, t) takes row tile t of the groups' tiles, whose expert (group g,
        # or ids[g] for a chunk of experts) has weight rows expert * N + n in the stacked words and scales viewed
        # 2-D. Tiles past the last do nothing.
        group, m_lo, m_end = find_tile(offsets_ptr, gl.program_id(2), num_experts, BM, E_POW2, num_warps)
        expert = group
        if HAS_IDS:
            expert = gl.load(ids_ptr + gl.minimum(group, num_experts - 1))
        w_row = expert * N + pid_n * BN
        n_chunks = gl.where(group < num_experts, n_chunks, 0)
    else:
        m_lo = gl.program_id(2) * BM
        m_end = M
        w_row = pid_n * BN

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_desc.layout)
    # (W_SMEM / S_SMEM: the 2-D boxes' layouts, which int4-tiled's 4-D boxes land in: wgmma_common.packed_desc)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], W_SMEM)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [SSTAGES, BN, SCALE_CHUNK], S_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [SSTAGES, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [SSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=PARTS)  # (each MMA partition releases the slot)
    for s in gl.static_range(SSTAGES):
        mbarrier.init(s_ready.index(s), count=1)
        mbarrier.init(s_empty.index(s), count=PARTS)
    if PARTS == 2:  # (the host launches halves, no split, num_warps = one warpgroup)
        PN: gl.constexpr = BN // 2
        gl.warp_specialize([
            (_mma_store_partition, (x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, out_ptr,
                                    pid_n * BN, m_lo, m_end, M, N, stride_om, 0, GROUP, PN, BM, BK, STAGES, CS,
                                    SSTAGES, TILED, num_warps)),
            (_mma_store_partition, (x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, out_ptr,
                                    pid_n * BN, m_lo, m_end, M, N, stride_om, PN, GROUP, PN, BM, BK, STAGES, CS,
                                    SSTAGES, TILED, num_warps)),
            (_load_partition, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, w_row,
                               m_lo, k_lo, n_chunks, GROUP, BN, BK, STAGES, CS, SSTAGES, TILED)),
        ], [num_warps, 1], [WORKER_REGS, 24])
    else:
        results = gl.warp_specialize([
            (_mma_partition, (x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, n_chunks, m_end - m_lo, 0,
                              GROUP, BN, BM, BK, STAGES, CS, SSTAGES, HALVES, TILED, num_warps, stamps_ptr, program,
                              STAMPS)),
            (_load_partition, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, s_ready, s_empty, w_row,
                               m_lo, k_lo, n_chunks, GROUP, BN, BK, STAGES, CS, SSTAGES, TILED, stamps_ptr, program,
                               STAMPS, PDL)),
        ], [1], [24])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for s in gl.static_range(SSTAGES):
        mbarrier.invalidate(s_ready.index(s))
        mbarrier.invalidate(s_empty.index(s))

    if PARTS == 1:
        if PDL:  # (the MMA warps' own wait: out, the partials and the tickets may be read or written before)
            gluon_wait()
        if HALVES:  # (the host launches no K split with halves)
            store_block(results[0], out_ptr, ws_ptr, cnt_ptr, pid_n, pid_n * BN, split, m_lo, m_end, M, N, n_splits,
                        stride_om, BN, BM // 2, False, False, num_warps)
            store_block(results[1], out_ptr, ws_ptr, cnt_ptr, pid_n, pid_n * BN, split, m_lo + BM // 2, m_end, M, N,
                        n_splits, stride_om, BN, BM // 2, False, False, num_warps)
        else:
            store_block(results[0], out_ptr, ws_ptr, cnt_ptr, pid_n, pid_n * BN, split, m_lo, m_end, M, N, n_splits,
                        stride_om, BN, BM, SPLIT, False, num_warps)
    gluon_stamp(stamps_ptr, program, EXIT_CYCLES, STAMPS)
    gluon_stamp(stamps_ptr, program, 1, STAMPS)


# The measured config (bench/RESULTS.md, twelfth and thirteenth sessions; H200, 12 dense shapes at M = 16-64): 64
# weight rows per program (one warpgroup), 128 of K per step, 4 stages, enough K splits for two programs per SM.
# Scales come by TMA in chunks of 8 groups (their own ring) and are read from shared memory: with per-step loads from
# global memory into registers, group 32 measured 1.35 / 1.29 / 1.16x bf16 at M = 16 / 32 / 64, with the ring 1.59 /
# 1.49 / 1.33 (group 128, one scale per step, was unchanged). Slower: 128 rows per program, 64 of K per step, 3 or 6
# stages, separate weight and activation rings. 128 rows by 128 of K at M = 128 returned wrong values on the GPU
# (twelfth session, not understood; the sixteenth's sweep ran that tile at 168 registers correctly, and slower than
# pick_tile's).
BLOCK_N, BLOCK_K, STAGES = 64, 128, 4
# K splits until the grid holds about this many programs per SM; 0: as many as the SMs hold at once
# (resident_programs: 3 at 16-32 rows, 2 at 64, by shared memory). One full wave measured the same as 2 in the
# sweep (eighteenth session: 1.48x bf16 at 16 rows either way) and slightly slower end to end (qwen3-8b decode at
# batch 16 / 32: 1.51 / 1.60 ms per step against 1.44 / 1.56), so 2 stays.
PROGRAMS_PER_SM = 2
SCALE_STAGES = 4  # scale chunks in flight: at group 32 a chunk is 2 steps, so the 4-step ring spans 2-3 of them


def max_registers(bm: int, group: int) -> int:
    """Registers per thread at launch. 80 (the loader warp gives its share to the MMA warps) fits three programs per
    SM, which measured faster at M <= 32 (1.70 / 1.60x bf16 at M = 16 / 32 against 1.59 / 1.49 at 128) and no slower
    at 64; only 64 rows with group 128 spill there (compile test), and keep 128."""
    return 128 if bm == 64 and group == 128 else 80


def supports(x: Tensor, w: PackedWeight) -> bool:
    """Whether wgmma_int4 can compute x @ W^T: int4 W (row-major or int4-tiled, contiguous; one matrix; groups of 32
    or 128, the compiled and tested ones,
    and at least a group of K per step: pick_tile's tile for the rows) on bf16 x of MIN_ROWS to MAX_ROWS rows, on an
    sm_90 GPU (wgmma is Hopper's), with the TMA's 16-byte alignment of the rows and bases of x, the words and the
    scales (scale rows of whole 8-group boxes: K a multiple of 8 groups)."""
    m = x.shape[0] if x.dim() == 2 else 0
    return (x.is_cuda and x.dtype == torch.bfloat16 and MIN_ROWS <= m <= MAX_ROWS and w.int4
            and w.experts is None and w.group in (32, 128) and pick_tile(m, w.n, sm_count(x.device)).bk >= w.group
            and w.k % (SCALE_CHUNK.value * w.group) == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(0) >= w.k and x.data_ptr() % 16 == 0
            and w.values.stride(1) == 1 and w.values.stride(0) % 4 == 0 and w.values.data_ptr() % 16 == 0
            and w.scale.dtype == torch.bfloat16 and w.scale.stride(1) == 1 and w.scale.stride(0) % 8 == 0
            and w.scale.data_ptr() % 16 == 0 and (not w.tiled or (w.values.is_contiguous() and w.scale.is_contiguous()))
            and capability(x.device) == (9, 0))


@dataclass(frozen=True)
class Tile:
    """A program's tile: `warps` MMA warps of 16 weight rows each (BN = 16 * warps; 4 is one warpgroup), `bm`
    activation rows (0: M rounded up to a power of two >= 16, one M tile: decode), `bk` of K per step, `stages`
    ring slots, `regs` registers per thread (0: max_registers' choice)."""

    warps: int = 4
    bm: int = 0
    bk: int = BLOCK_K
    stages: int = STAGES
    regs: int = 0
    halves: bool = False  # two accumulators of bm / 2 activation rows, the second skipped on tiles of fewer rows
    # The MMA warps as `parts` partitions (warpgroups) of their own, each with its share of the weight rows and its
    # own arrivals on the ring's barriers: one partition steps in lockstep (a barrier over all its warps each step),
    # parts drift apart, so one's decode overlaps another's synchronous wgmma. parts = 2 needs 8 warps and halves.
    parts: int = 1
    programs_per_sm: int | None = None  # the K-split target per SM (split_k; None: PROGRAMS_PER_SM)

    def __post_init__(self):
        if self.parts not in (1, 2) or (self.parts == 2 and (self.warps != 8 or not self.halves)):
            raise ValueError(f"Tile.parts={self.parts}: 1, or 2 with 8 warps and halves (got warps={self.warps}, "
                             f"halves={self.halves})")
        if self.programs_per_sm is not None and self.programs_per_sm < 0:
            raise ValueError(f"Tile.programs_per_sm={self.programs_per_sm}: a K-split target per SM >= 0 (0: one full "
                             f"wave of resident programs), or None for PROGRAMS_PER_SM")


DECODE = Tile()
# Training and prefill rows (bench/RESULTS.md, fifteenth session; H200, 12 dense shapes at M = 4096, x bf16 cuBLAS):
# two warpgroups of 64 weight rows on 256 activation rows share each step's activations (0.78 against 0.70 for one
# warpgroup); as two partitions (parts = 2) they no longer meet at a barrier every step, so while one waits on its
# synchronous wgmma the other decodes: 0.86 forward, dX 0.70 -> 0.81. 168 registers at launch: the 8 MMA warps and
# the loader round up to 12 warps, 384 threads on the SM's 64k registers.
TRAIN = Tile(warps=8, bm=256, bk=64, stages=3, regs=168, halves=True, parts=2)
# With parts = 2 the MMA warpgroups and the loader's (padded) warpgroup share 384 threads x 168 registers; setmaxnreg
# gives each MMA partition 240 and the loader 24 (at 168 each, ptxas spilled inside the loop).
PART_REGS = 240
# The rollout's larger decode batches and short prefills, 65 to MAX_ROWS rows (bench/RESULTS.md, sixteenth session;
# H200, 12 dense shapes at M = 128-2048, `bench/wgmma_sweep.py --tiles`): the widest tile whose grid still gives about
# WIDE_PROGRAMS_PER_SM programs per SM (no K split: each program owns its outputs), else the decode tile over 64-row
# activation tiles with the K range split. 256 and 128 rows per program as two independent warpgroups (TRAIN, WIDE)
# led where N is large (Qwen3-8B gate_up at 256 rows: 104-106 us against 126 for 64-row tiles), 64-row tiles where
# it is not (the o projections, N = 2048-4096: 19-23 against 34-35 us). One warpgroup on 128 rows (4 warps, wgmma
# n128, K split) lost to both everywhere. Past 512 rows dequantize + cuBLAS measured as fast or faster.
WIDE = Tile(warps=8, bm=128, bk=64, stages=4, regs=168, halves=True, parts=2)
ROWS = replace(DECODE, bm=64)
WIDE_TILES = (TRAIN, WIDE)  # widest first
WIDE_PROGRAMS_PER_SM = 0.55
DECODE_ROWS, MAX_ROWS = 64, 512
# PDL launches of the dense one-partition tiles (_load_partition's PDL prologue). Per Qwen3-8B decode layer at 16 rows
# they measured 2-3 % faster than plain launches (bench/decode_chain.py, twenty-second session), at 32 rows ~1 %, and
# they keep the plain launches' bits (the GPU tests, decode_chain's back-to-back graph replays). The switch is for A/Bs.
PDL_LAUNCH = True


def pick_tile(m: int, n: int, sms: int) -> Tile:
    """The tile for M rows of an N-row weight on `sms` SMs: DECODE (one M tile of M rounded up) to DECODE_ROWS, then
    the widest of WIDE_TILES whose row tile M fills (bm <= M rounded up to a power of two) and whose grid has at least
    WIDE_PROGRAMS_PER_SM programs per SM, else ROWS (64-row tiles, K split)."""
    if m <= DECODE_ROWS:
        return DECODE
    for tile in WIDE_TILES:
        programs = triton.cdiv(n, 16 * tile.warps) * triton.cdiv(m, tile.bm)
        if tile.bm <= triton.next_power_of_2(m) and programs >= WIDE_PROGRAMS_PER_SM * sms:
            return tile
    return ROWS


def _launch(x: Tensor, values: Tensor, scale: Tensor, out: Tensor, ws: Tensor, cnt: Tensor, offsets: Tensor,
            ids: Tensor | None, grid: tuple[int, int, int], k_per_split: int, experts: int, group: int, n: int,
            bm: int, tile: Tile, tiled: bool, stamps: Tensor | None = None) -> None:
    """The kernel over words `values` and scales `scale` viewed 2-D ([rows, K / 8], [rows, K / group]; stacked
    experts' rows one after another), in int4-tiled's layout if `tiled`."""
    m, k = x.shape
    bn = 16 * tile.warps
    if max(grid[1], 1) * m * n >= 2**31:
        raise ValueError(f"wgmma_int4: {grid[1]} x [{m}, {n}] outputs overflow the kernel's int32 offsets")
    # PDL (PDL_LAUNCH) only for the one-partition dense tiles (the grouped kernel reads the routing's offsets first).
    pdl = PDL_LAUNCH and experts == 0 and tile.parts == 1 and use_pdl(x.device)
    w_box, s_box = (bn, tile.bk // 8), (bn, SCALE_CHUNK.value)
    _wgmma_int4_kernel[grid](
        tma_desc(x, [bm, tile.bk], "bf16"), packed_desc(values, list(w_box), "int32", WORDS_PER_BLOCK.value, tiled),
        packed_desc(scale, list(s_box), "bf16", SCALE_CHUNK.value, tiled), out, ws, cnt, offsets,
        offsets if ids is None else ids,
        out if stamps is None else stamps, m, n, k,
        k_per_split, grid[1], experts, out.stride(0), GROUP=group, BN=bn, BM=bm, BK=tile.bk, STAGES=tile.stages,
        SSTAGES=SCALE_STAGES, SPLIT=grid[1] > 1, GROUPED=experts > 0, HALVES=tile.halves, HAS_IDS=ids is not None,
        E_POW2=triton.next_power_of_2(max(experts, 1)), PARTS=tile.parts, WORKER_REGS=PART_REGS,
        STAMPS=stamps is not None, PDL=pdl, TILED=tiled, W_SMEM=smem_layout(w_box, "int32"),
        S_SMEM=smem_layout(s_box, "bf16"), launch_pdl=pdl,
        num_warps=tile.warps // tile.parts, maxnreg=tile.regs or max_registers(bm, group))


SM_REGISTERS, SM_SHARED = 65536, 228 * 1024  # per SM (sm_90)


def resident_programs(tile: Tile, bm: int, group: int) -> int:
    """Programs of `tile` (bm activation rows) one SM holds at once: by registers, the launch cap over all warps (the
    loader warp rounds up to a warpgroup: setmaxnreg moves registers within a program, not between programs), and
    by the rings' shared memory."""
    threads = 32 * (tile.warps + 4)
    regs = tile.regs or max_registers(bm, group)
    bn = 16 * tile.warps
    ring = tile.stages * (bm * tile.bk * 2 + bn * tile.bk // 2) + SCALE_STAGES * bn * SCALE_CHUNK.value * 2
    # (+ 2 KB: the 1 KB the driver reserves per CTA, the ring barriers and slack)
    return max(1, min(SM_REGISTERS // (threads * regs), SM_SHARED // (ring + 2048)))


def split_k(k: int, group: int, tiles: int, tile: Tile, sms: int, bm: int) -> tuple[int, int]:
    """(K per split, splits) for `tiles` output tiles of bm activation rows on `sms` SMs: enough splits of whole
    scale chunks for about the tile's programs_per_sm (None: PROGRAMS_PER_SM; 0: one full wave, resident_programs)
    programs per SM; none with halves."""
    chunk = SCALE_CHUNK.value * group
    target = PROGRAMS_PER_SM if tile.programs_per_sm is None else tile.programs_per_sm
    want = (target or resident_programs(tile, bm, group)) * sms // tiles
    return split_evenly(k, max(1, min(triton.cdiv(k, chunk), want if not tile.halves else 1)), chunk)


def wgmma_int4(x: Tensor, w: PackedWeight, out: Tensor, tickets: Callable[[int], Tensor], tile: Tile | None = None,
               stamps: Tensor | None = None) -> Tensor:
    """out[M, N] = x[M, K] @ W^T (bf16, fp32 accumulation) where `supports(x, w)`, with `tile` (None: pick_tile's);
    out: [M, N] contiguous; tickets(n): a zeroed int32 ticket buffer of at least n entries (gemm._tickets);
    stamps: int64 [programs, timeline.SLOTS] to record each program's timeline (one-partition tiles; None: off)."""
    m, k = x.shape
    tile = tile or pick_tile(m, w.n, sm_count(x.device))
    bm = tile.bm or max(16, triton.next_power_of_2(m))
    n_tiles, m_tiles = triton.cdiv(w.n, 16 * tile.warps), triton.cdiv(m, bm)
    k_per_split, split = split_k(k, w.group, n_tiles * m_tiles, tile, sm_count(x.device), bm)
    if stamps is not None:
        if tile.parts != 1:
            raise ValueError(f"stamps: the timeline is stamped on one-partition tiles only, got {tile}")
        check_stamps(stamps, n_tiles * split * m_tiles, x.device)
    ws = torch.empty((split, m, w.n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = tickets(n_tiles * m_tiles) if split > 1 else out
    _launch(x, w.values, w.scale, out, ws, cnt, cnt, None, (n_tiles, split, m_tiles), k_per_split, 0, w.group, w.n,
            bm, tile, w.tiled, stamps)
    return out


def supports_grouped(x: Tensor, w: PackedWeight) -> bool:
    """Whether wgmma_int4_grouped can compute the grouped forward: `supports`' conditions but for the row count
    (any), on stacked int4 experts of group 32 whose words and scales view as 2-D [E * N, ...]."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and w.int4
            and w.experts is not None and w.group == 32 and w.k % (SCALE_CHUNK.value * w.group) == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and w.values.is_contiguous() and w.values.data_ptr() % 16 == 0
            and w.scale.dtype == torch.bfloat16 and w.scale.is_contiguous() and w.scale.data_ptr() % 16 == 0
            and capability(x.device) == (9, 0))


def wgmma_int4_grouped(x: Tensor, offsets: Tensor, w: PackedWeight, out: Tensor, tile: Tile = TRAIN,
                       ids: Tensor | None = None) -> Tensor:
    """Per group g: out[rows_g] = x[rows_g] @ W_e^T where `supports_grouped(x, w)`; x [T, K] sorted by group, offsets
    int32 [G + 1] on the device (rows of group g: offsets[g]:offsets[g + 1]); e = g (G = E), or ids[g] for a chunk of
    experts (ids: int32 [G]); out [T, N]. Only the row tiles of groups with rows run; no host sync."""
    t, k = x.shape
    groups = w.experts if ids is None else ids.numel()
    grid = (triton.cdiv(w.n, 16 * tile.warps), 1, max_row_tiles(t, tile.bm, groups))
    values, scale = w.values.view(w.experts * w.n, -1), w.scale.view(w.experts * w.n, -1)
    _launch(x, values, scale, out, out, offsets, offsets, ids, grid, k, groups, w.group, w.n, tile.bm, tile, w.tiled)
    return out
