"""dX of an int4 GEMM on Hopper's warpgroup MMA (Gluon): dx[T, K] = dy[T, N] @ W[N, K], dense or grouped over
experts, for training and prefill sizes; the backward of wgmma_int4.py's forward, on the same packed words.

Swapped like the forward: dx^T [K, T] = W^T [K, N] x dy^T, so W^T is wgmma's register A operand (rows: K, reduction:
N) and dy is B, read from shared memory. The words run along K (8 values of one row n per word), while the operand
wants pairs along N in one register: lane (g, q) of a warp holds rows g and g + 8 of its 16, columns 2q, 2q + 1 (and
+ 8). The output's row order is free (the epilogue stores each row where it belongs), so row g + 8h of warp w is
column k = 8c + j + 4h of the tile, with word column c = 2w + g // 4 and j = g % 4: a lane's two rows are values j
and j + 4 of one word column (nibbles j and j + 4; in int4-tiled's nibble order j // 2 + 4 (j % 2) and that + 2), and
for the pair of rows n, n + 1 of W one `prmt` gathers the two bytes holding them from both words, and one lop3 each
(after a shift) builds (n, n + 1) at k and at k + 4, decoded like the forward (bf16 128 + nibble, fma by -136, fma by
the pair of the two rows' scales): bit-identical weights.

Per step of 64 of N the loader warp brings dy's [BM, 64], the words [64, BN / 8] and the scales [64, 8 groups] by TMA
into one ring. Everything else (two warpgroups, halves, the grouped tile lookup, the epilogue) is the forward's.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .configs import capability, max_row_tiles
from .dequant import _INT4_BF16_ASM
from .formats import PackedWeight
from .wgmma_common import find_tile, packed_desc, smem_layout, store_block, tma_desc, tma_load, tma_load_rows
from .wgmma_int4 import PART_REGS, SCALE_CHUNK, TRAIN, WORDS_PER_BLOCK, Tile

BLOCK_R = gl.constexpr(64)  # N (the reduction) per step

# For the pair of W's rows n, n + 1 at word column c: $4, $5 their words, $6 the prmt selector of the two bytes of
# $4 then of $5 that hold the values at k = 8c + j and k + 4, $7 the shift that brings the first to bit 0 (both:
# dx_selector; row-major, bytes j // 2 and j // 2 + 2, shift 4 (j % 2)), $8 / $9 the two rows' scales. Out: ($0, $1)
# the rows' values at k, ($2, $3) at k + 4: the gathered word t and t >> 8 decoded by dequant.py's own lines for its
# registers t0 and t1 (so that the two cannot drift apart).
_DX_DECODE_LINES = ("mov.b32 one,", "mov.b32 off,", "mov.b32 nz,", "lop3.b32 t0,", "lop3.b32 t1,",
                    "fma.rn.bf16x2 t0,", "fma.rn.bf16x2 t1,")
_DX_ASM = gl.constexpr(
    "{\n.reg .b32 t, w, t0, t1, s2, one, off, nz;\nmov.b32 s2, {$8, $9};\nprmt.b32 t, $4, $5, $6;\n"
    "shr.u32 t, t, $7;\nshr.u32 w, t, 8;\n"
    + "".join(line.replace("$8", "t") + "\n" for line in _INT4_BF16_ASM.value.splitlines()
              if line.startswith(_DX_DECODE_LINES))
    + "mov.b32 {$0, $1}, t0;\nmov.b32 {$2, $3}, t1;\n}\n"
)


@gluon.jit
def dx_selector(j, TILED: gl.constexpr):
    """_DX_ASM's prmt selector ($6) and shift ($7) for lane nibble j (a tensor): bytes of each row's word holding the
    values at k (column 8c + j) and k + 4, and the shift that brings them to bits 0 and 8. Row-major they are nibbles
    j and j + 4 (bytes j // 2 and j // 2 + 2, half j % 2); int4-tiled (value v in nibble v // 2 + 4 (v % 2),
    quant/formats/tiled.py) nibbles a = j // 2 + 4 (j % 2) and a + 2 (bytes a // 2 and a // 2 + 1, half a % 2)."""
    if TILED:
        a = j // 2 + 4 * (j % 2)
        lo, hi, half = a // 2, a // 2 + 1, a % 2
    else:
        lo, hi, half = j // 2, j // 2 + 2, j % 2
    return lo | hi << 4 | (lo + 4) << 8 | (hi + 4) << 12, 4 * half


def row_column(row: int) -> int:
    """The tile column (of K) that accumulator row `row` holds (wgmma_common.store_block's ROW_PERM)."""
    return 8 * (2 * (row // 16) + row % 8 // 4) + 4 * (row // 8 % 2) + row % 4


@gluon.constexpr_function
def _pair_layout(BR, C, num_warps):
    """[BR // 2, C, 4]: pair i of W's rows (n = 2i, 2i + 1), word column c, nibble j. Lanes (q, g % 4, g // 4) take i
    bits 0-1, j, c bit 0; registers i bits 2..; warps c bits 1... (the A operand's rows 16 w + g + 8 h are columns
    8 c + j + 4 h)."""
    regs = [[1 << i, 0, 0] for i in range(2, (BR // 2).bit_length() - 1)]
    lanes = [[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0]]
    warps = [[0, 2 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[BR // 2, C, 4])


@gluon.constexpr_function
def _group_layout(BR, C, num_warps):
    """[BR // 2, C // 4, 4]: _pair_layout without j, its word columns c split into the group of 32 (c // 4) and the
    word within it (c % 4)."""
    regs = [[1 << i, 0, 0] for i in range(2, (BR // 2).bit_length() - 1)]
    lanes = [[1, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 1]]
    warps = [[0, 0, 2]] + [[0, 1 << i, 0] for i in range(num_warps.bit_length() - 2)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[BR // 2, C // 4, 4])


@gluon.constexpr_function
def _rows_layout(BR, C, num_warps, groups):
    """[BR, C] of W's rows n (pairs in registers: n bit 0 first) by word column c (or, with `groups`, by the group of
    32 of K, c // 4: lanes and warps that only change c within a group hold the same one)."""
    regs = [[1, 0]] + [[1 << i, 0] for i in range(3, BR.bit_length() - 1)]
    col = (lambda b: [0, (1 << b) // 4] if (1 << b) >= 4 else [0, 0]) if groups else (lambda b: [0, 1 << b])
    lanes = [[2, 0], [4, 0], [0, 0], [0, 0], col(0)]
    warps = [col(i + 1) for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[], shape=[BR, C])


@gluon.jit
def _split_pairs(t, BR: gl.constexpr, C: gl.constexpr):
    """[BR, C] -> rows 2i and 2i + 1, each [BR // 2, C]."""
    return gl.split(gl.permute(gl.reshape(t, [BR // 2, 2, C]), (0, 2, 1)))


@gluon.jit
def _over_group(scales, zero, l3s: gl.constexpr, BR: gl.constexpr, C: gl.constexpr):
    """[BR // 2, C // 4] scales of the pairs' groups -> [BR // 2, C], each over its group's 4 word columns (a
    broadcast: it moves nothing)."""
    scales = gl.expand_dims(gl.convert_layout(scales, gl.SliceLayout(2, l3s), assert_trivial=True), 2)
    return gl.reshape(gl.broadcast(scales, zero)[0], [BR // 2, C])


@gluon.jit
def _dx_load_partition(dy_desc, w_desc, s_desc, dy_smem, w_smem, s_smem, ready, empty, w_row, m_lo, k0, n_steps,
                       GROUP: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr, TILED: gl.constexpr):
    """One warp: each step's dy, words (a box per MMA partition: each takes its own columns of K) and scales (TILED:
    int4-tiled's, wgmma_common.packed_desc)."""
    PC: gl.constexpr = w_desc.block_type.shape[-1]  # word columns per partition (the box's last dim, 2-D or 4-D)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), dy_desc.block_type.nbytes + PARTS * w_desc.block_type.nbytes
                        + s_desc.block_type.nbytes)
        tma_load(dy_desc, [m_lo, i * BLOCK_R], ready.index(slot), dy_smem.index(slot))
        for p in gl.static_range(PARTS):
            tma_load_rows(w_desc, w_row + i * BLOCK_R, k0 // 8 + p * PC, ready.index(slot),
                          w_smem.index(slot * PARTS + p), WORDS_PER_BLOCK, TILED)
        # (TMA boxes start on 16 bytes: the scales' box starts at the tile's groups rounded down to 8)
        tma_load_rows(s_desc, w_row + i * BLOCK_R, k0 // GROUP // SCALE_CHUNK * SCALE_CHUNK, ready.index(slot),
                      s_smem.index(slot), SCALE_CHUNK, TILED)


@gluon.jit
def _dx_mma_partition(dy_smem, w_smem, s_smem, ready, empty, n_steps, rows, s_upper, PART: gl.constexpr,
                      PARTS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                      TILED: gl.constexpr, num_warps: gl.constexpr):
    """Decode each step's words into W^T's register operand (rows: BN columns of K in row_column order; partition
    PART of PARTS takes the PART-th BN of the tile's) and multiply by dy^T, in two halves of BM // 2 activation rows
    (the second only when the tile has more). s_upper: the tile's groups are the upper half of the scale box."""
    BR: gl.constexpr = BLOCK_R
    C: gl.constexpr = BN // 8  # word columns
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    l3: gl.constexpr = _pair_layout(BR, C, num_warps)
    words_in: gl.constexpr = gl.SliceLayout(2, l3)

    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    sel, shift = dx_selector(j, TILED)
    sel = gl.expand_dims(gl.expand_dims(sel, 0), 0)  # [1, 1, 4]
    shift = gl.expand_dims(gl.expand_dims(shift, 0), 0)
    l3s: gl.constexpr = _group_layout(BR, C, num_warps)
    zero_s = gl.full([BR // 2, C // 4, 4], 0.0, gl.bfloat16, l3s)
    S_LO: gl.constexpr = PART * C // 4  # this partition's first scale group within the tile's

    acc = gl.zeros([BN, HM], gl.float32, acc_layout)
    acc_hi = gl.zeros([BN, HM], gl.float32, acc_layout)
    two = rows > HM
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        wa, wb = _split_pairs(w_smem.index(slot * PARTS + PART).load(_rows_layout(BR, C, num_warps, False)), BR, C)
        s_layout: gl.constexpr = _rows_layout(BR, C // 4, num_warps, True)
        if s_upper:
            scales = s_smem.index(slot).slice(PARTS * C // 4 + S_LO, C // 4, dim=1).load(s_layout)
        else:
            scales = s_smem.index(slot).slice(S_LO, C // 4, dim=1).load(s_layout)
        sa, sb = _split_pairs(scales, BR, C // 4)
        sa = _over_group(sa, zero_s, l3s, BR, C)
        sb = _over_group(sb, zero_s, l3s, BR, C)
        args = [gl.expand_dims(gl.convert_layout(t, words_in, assert_trivial=True), 2) for t in (wa, wb)]
        args += [sel, shift]
        args += [gl.expand_dims(gl.convert_layout(t, words_in, assert_trivial=True), 2) for t in (sa, sb)]
        v00, v01, v10, v11 = gl.inline_asm_elementwise(_DX_ASM, "=h,=h,=h,=h,r,r,r,r,h,h", args,
                                                       dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1)
        # [i, c, j, e, h] -> rows (c // 2, h, c % 2, j), columns (i, e): the A operand, moved nowhere.
        v = gl.join(gl.join(v00, v01), gl.join(v10, v11))
        v = gl.permute(gl.reshape(v, [BR // 2, C // 2, 2, 4, 2, 2]), (1, 5, 2, 3, 0, 4))
        a = gl.convert_layout(gl.reshape(v, [BN, BR]), a_layout, assert_trivial=True)
        # Synchronous, as the forward (wgmma_int4._mma_partition says why).
        acc = warpgroup_mma(a, dy_smem.index(slot).slice(0, HM, dim=0).permute((1, 0)), acc)
        if two:
            acc_hi = warpgroup_mma(a, dy_smem.index(slot).slice(HM, HM, dim=0).permute((1, 0)), acc_hi)
        fence_async_shared()  # (the words and scales were read by ordinary loads; the slot's next fill is by TMA)
        mbarrier.arrive(empty.index(slot))
    return acc, acc_hi


@gluon.jit
def _dx_mma_store_partition(dy_smem, w_smem, s_smem, ready, empty, n_steps, s_upper, out_ptr, k0, m_lo, m_end, M, K,
                            stride_om, PART: gl.constexpr, PARTS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
                            STAGES: gl.constexpr, TILED: gl.constexpr, num_warps: gl.constexpr):
    """One of the independent warpgroups (Tile.parts): its BN columns of K, stored by its own warps."""
    acc, acc_hi = _dx_mma_partition(dy_smem, w_smem, s_smem, ready, empty, n_steps, m_end - m_lo, s_upper, PART,
                                    PARTS, BN, BM, STAGES, TILED, num_warps)
    store_block(acc, out_ptr, out_ptr, out_ptr, 0, k0 + PART * BN, 0, m_lo, m_end, M, K, 1, stride_om, BN, BM // 2,
                False, True, num_warps)
    store_block(acc_hi, out_ptr, out_ptr, out_ptr, 0, k0 + PART * BN, 0, m_lo + BM // 2, m_end, M, K, 1, stride_om,
                BN, BM // 2, False, True, num_warps)


@gluon.jit(do_not_specialize=["M", "num_experts"])
def _wgmma_int4_dx_kernel(dy_desc, w_desc, s_desc, out_ptr, offsets_ptr, ids_ptr, M, N, K, num_experts, stride_om,
                          GROUP: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                          GROUPED: gl.constexpr, HAS_IDS: gl.constexpr, E_POW2: gl.constexpr, PARTS: gl.constexpr,
                          WORKER_REGS: gl.constexpr, TILED: gl.constexpr, W_SMEM: gl.constexpr, S_SMEM: gl.constexpr,
                          num_warps: gl.constexpr):
    pid_k = gl.program_id(0)
    k0 = pid_k * BN
    n_steps = gl.cdiv(N, BLOCK_R)
    if GROUPED:  # (as the forward's: row tile t of the groups' tiles; its expert's rows of the stacked words)
        group, m_lo, m_end = find_tile(offsets_ptr, gl.program_id(2), num_experts, BM, E_POW2, num_warps)
        expert = group
        if HAS_IDS:
            expert = gl.load(ids_ptr + gl.minimum(group, num_experts - 1))
        w_row = expert * N
        n_steps = gl.where(group < num_experts, n_steps, 0)
    else:
        m_lo = gl.program_id(2) * BM
        m_end = M
        w_row = 0

    dy_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BLOCK_R], dy_desc.layout)
    # (W_SMEM / S_SMEM: the 2-D boxes' layouts, which int4-tiled's 4-D boxes land in: wgmma_common.packed_desc)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * PARTS, BLOCK_R, BN // 8 // PARTS], W_SMEM)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, SCALE_CHUNK], S_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=PARTS)  # (each MMA partition releases the slot)
    s_upper = k0 // GROUP % SCALE_CHUNK != 0
    if PARTS == 2:
        PN: gl.constexpr = BN // 2
        gl.warp_specialize([
            (_dx_mma_store_partition, (dy_smem, w_smem, s_smem, ready, empty, n_steps, s_upper, out_ptr, k0, m_lo,
                                       m_end, M, K, stride_om, 0, PARTS, PN, BM, STAGES, TILED, num_warps)),
            (_dx_mma_store_partition, (dy_smem, w_smem, s_smem, ready, empty, n_steps, s_upper, out_ptr, k0, m_lo,
                                       m_end, M, K, stride_om, 1, PARTS, PN, BM, STAGES, TILED, num_warps)),
            (_dx_load_partition, (dy_desc, w_desc, s_desc, dy_smem, w_smem, s_smem, ready, empty, w_row, m_lo, k0,
                                  n_steps, GROUP, STAGES, PARTS, TILED)),
        ], [num_warps, 1], [WORKER_REGS, 24])
    else:
        results = gl.warp_specialize([
            (_dx_mma_partition, (dy_smem, w_smem, s_smem, ready, empty, n_steps, m_end - m_lo, s_upper, 0, 1, BN, BM,
                                 STAGES, TILED, num_warps)),
            (_dx_load_partition, (dy_desc, w_desc, s_desc, dy_smem, w_smem, s_smem, ready, empty, w_row, m_lo, k0,
                                  n_steps, GROUP, STAGES, 1, TILED)),
        ], [1], [24])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    if PARTS == 1:
        store_block(results[0], out_ptr, out_ptr, out_ptr, pid_k, k0, 0, m_lo, m_end, M, K, 1, stride_om, BN, BM // 2,
                    False, True, num_warps)
        store_block(results[1], out_ptr, out_ptr, out_ptr, pid_k, k0, 0, m_lo + BM // 2, m_end, M, K, 1, stride_om,
                    BN, BM // 2, False, True, num_warps)


def supports_dx(dy: Tensor, w: PackedWeight) -> bool:
    """Whether wgmma_int4_dx runs dy @ W: int4 of group 32, words and scales contiguous (stacked experts view 2-D),
    bf16 dy with TMA's 16-byte rows and base, K in whole 8-group scale boxes, on an sm_90 GPU."""
    return (dy.is_cuda and dy.dtype == torch.bfloat16 and dy.dim() == 2 and w.int4 and w.group == 32
            and w.k % (SCALE_CHUNK.value * w.group) == 0 and dy.stride(1) == 1 and dy.stride(0) % 8 == 0
            and dy.data_ptr() % 16 == 0 and w.values.is_contiguous() and w.values.data_ptr() % 16 == 0
            and w.scale.dtype == torch.bfloat16 and w.scale.is_contiguous() and w.scale.data_ptr() % 16 == 0
            and capability(dy.device) == (9, 0))


def wgmma_int4_dx(dy: Tensor, w: PackedWeight, out: Tensor, offsets: Tensor | None = None,
                  ids: Tensor | None = None, tile: Tile = TRAIN) -> Tensor:
    """out[T, K] = dy[T, N] @ W where `supports_dx(dy, w)`: one matrix, or (offsets int32 [G + 1] on the device) per
    group g of rows sorted by group, with expert g (G = E) or ids[g]'s weights (wgmma_int4_grouped's convention)."""
    t = dy.shape[0]
    bn = 16 * tile.warps
    experts = w.experts or 1
    groups = 0 if offsets is None else (experts if ids is None else ids.numel())
    if t * w.k >= 2**31:
        raise ValueError(f"wgmma_int4_dx: [{t}, {w.k}] outputs overflow the kernel's int32 offsets")
    row_tiles = triton.cdiv(t, tile.bm) if offsets is None else max_row_tiles(t, tile.bm, groups)
    values, scale = w.values.view(experts * w.n, -1), w.scale.view(experts * w.n, -1)
    w_box, s_box = (BLOCK_R.value, bn // 8 // tile.parts), (BLOCK_R.value, SCALE_CHUNK.value)
    _wgmma_int4_dx_kernel[(triton.cdiv(w.k, bn), 1, row_tiles)](
        tma_desc(dy, [tile.bm, BLOCK_R.value], "bf16"),
        packed_desc(values, list(w_box), "int32", WORDS_PER_BLOCK.value, w.tiled),
        packed_desc(scale, list(s_box), "bf16", SCALE_CHUNK.value, w.tiled), out, out if offsets is None else offsets,
        out if ids is None else ids, t, w.n, w.k, groups, out.stride(0), GROUP=w.group, BN=bn, BM=tile.bm,
        STAGES=tile.stages, GROUPED=offsets is not None, HAS_IDS=ids is not None,
        E_POW2=triton.next_power_of_2(max(groups, 1)), PARTS=tile.parts, WORKER_REGS=PART_REGS, TILED=w.tiled,
        W_SMEM=smem_layout(w_box, "int32"), S_SMEM=smem_layout(s_box, "bf16"),
        num_warps=tile.warps // tile.parts, maxnreg=tile.regs)
    return out
