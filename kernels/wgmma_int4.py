"""int4 x bf16 GEMM on Hopper's warpgroup MMA, for 17-128 activation rows (the rollout's decode batches).

Why: Triton's tile kernel (gemm.py) decodes the weight tile in a blocked layout and converts it to the MMA operand
layout through shared memory, and at M = 64-256 loses to cuBLAS on a bf16 weight four times its size
(bench/RESULTS.md). Written in Gluon, this kernel controls every layout:

- Swapped product: out^T [N, M] = W [N, K] x^T. The weight is wgmma's A operand, which may live in registers;
  the activations are B, streamed by TMA into a STAGES-deep shared-memory ring (rows past M and K read zeros).
- Each thread loads exactly the int4 words its A fragment needs, straight from global memory in the operand's own
  layout: a k16 step of a row holds 16 values in two words, and lane t of a quad holds values 2t, 2t + 1 and
  2t + 8, 2t + 9, i.e. byte t of each word. One `prmt` puts that byte's two nibbles 16 bits apart, and dequant.py's
  bf16 instructions (lop3 into bf16 128 + n, fma by -136, fma by the scale) turn them into one bf16x2 register.
  The values equal dequant.py's bit for bit. No layout conversion, no shared memory for the weight.
- The next step's words and scales load one step ahead into registers; the K range may split over programs, whose
  fp32 partials the last arriver sums in split order (gemm.py's scheme), so results do not depend on timing.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .formats import PackedWeight

# Byte t of the word ($2) and of the word shifted by 4 bits, by the prmt selector $3 = t | (t + 4) << 8, puts the
# byte's low nibble (value 2p) at bit 0 and its high nibble (value 2p + 1) at bit 16; then dequant.py's decode.
_PAIR_ASM = gl.constexpr("""
{
.reg .b32 w4, t, s2, one, off, nz;
shr.u32 w4, $2, 4;
prmt.b32 t, $2, w4, $3;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
mov.b32 nz, 0x80008000;
mov.b32 s2, {$4, $4};
fma.rn.bf16x2 t, t, one, off;
fma.rn.bf16x2 t, t, s2, nz;
mov.b32 {$0, $1}, t;
}
""")


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
def _load_scales(s_ptr, s_offs, row_ok, k0, GROUP: gl.constexpr, BK: gl.constexpr, GPS: gl.constexpr,
                 layout: gl.constexpr):
    """bf16 [BN, GPS]: the scales of one K step's GPS groups, each thread's rows with all their groups."""
    groups = gl.arange(0, GPS, layout=gl.SliceLayout(0, layout))
    ptrs = s_ptr + gl.expand_dims(s_offs, 1) + gl.expand_dims(k0 // GROUP + groups, 0)
    return gl.load(ptrs, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(groups >= 0, 0), other=0.0)


@gluon.jit
def _word_scales(scales, BN: gl.constexpr, BK: gl.constexpr, GPS: gl.constexpr, WPG: gl.constexpr,
                 l3: gl.constexpr, words_layout: gl.constexpr):
    """bf16 [BN, BK // 8, 1]: each word's scale, broadcast from the step's [BN, GPS] in registers."""
    zero = gl.full([BN, GPS, WPG], 0.0, gl.bfloat16, l3)
    full = gl.reshape(gl.expand_dims(scales, 2) + zero, [BN, BK // 8])
    return gl.expand_dims(gl.convert_layout(full, words_layout, assert_trivial=True), 2)


@gluon.jit
def _load_partition(x_desc, w_desc, x_smem, w_smem, ready, empty, pid_n, k_lo, n_steps,
                    BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of each step's activations and words into the ring, as slots come free."""
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # (fresh barriers count as released)
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [0, k_lo + i * BK], ready.index(slot), x_smem.index(slot))
        tma.async_copy_global_to_shared(w_desc, [pid_n * BN, (k_lo + i * BK) // 8], ready.index(slot),
                                        w_smem.index(slot))


@gluon.jit
def _mma_partition(x_smem, w_smem, ready, empty, s_ptr, pid_n, k_lo, n_steps, N, stride_sn,
                   GROUP: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, num_warps: gl.constexpr, DBG: gl.constexpr):
    """The kernel's warps: decode each step's words into wgmma's register operand and multiply, one MMA in flight
    while the next step decodes."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    pair_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=1)
    w3: gl.constexpr = _word_layout(BN, BK, num_warps)
    words_layout: gl.constexpr = gl.SliceLayout(2, w3)

    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, w3)))
    sel = gl.expand_dims(gl.expand_dims(byte | ((byte + 4) << 8), 0), 0)  # [1, 1, 4]: the prmt selector
    GPS: gl.constexpr = BK // GROUP if BK > GROUP else 1  # scale groups per step
    WPG: gl.constexpr = BK // 8 // GPS  # words per group within a step
    l3s: gl.constexpr = _scale_layout(BN, GPS, WPG, num_warps)
    s_layout: gl.constexpr = gl.SliceLayout(2, l3s)
    s_rows = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    s_offs = (pid_n * BN + s_rows) * stride_sn
    s_ok = pid_n * BN + s_rows < N

    acc = gl.zeros([BN, BM], gl.float32, acc_layout)
    a_prev = gl.zeros([BN, BK], gl.bfloat16, a_layout)
    # Scales are too small per row for TMA; they load into registers three steps ahead of their use.
    s0 = _load_scales(s_ptr, s_offs, s_ok, k_lo, GROUP, BK, GPS, s_layout)
    s1 = _load_scales(s_ptr, s_offs, s_ok & (1 < n_steps), k_lo + BK, GROUP, BK, GPS, s_layout)
    s2 = _load_scales(s_ptr, s_offs, s_ok & (2 < n_steps), k_lo + 2 * BK, GROUP, BK, GPS, s_layout)
    for i in range(n_steps):
        slot = i % STAGES
        s3 = _load_scales(s_ptr, s_offs, s_ok & (i + 3 < n_steps), k_lo + (i + 3) * BK, GROUP, BK, GPS, s_layout)
        scales = _word_scales(s0, BN, BK, GPS, WPG, l3s, words_layout)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        words = gl.expand_dims(w_smem.index(slot).load(words_layout), 2)
        lo, hi = gl.inline_asm_elementwise(_PAIR_ASM, "=h,=h,r,r,h", [words, sel, scales],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        lo = gl.convert_layout(gl.reshape(lo, [BN, BK // 2]), pair_layout, assert_trivial=True)
        hi = gl.convert_layout(gl.reshape(hi, [BN, BK // 2]), pair_layout, assert_trivial=True)
        a = gl.convert_layout(gl.reshape(gl.join(lo, hi), [BN, BK]), a_layout, assert_trivial=True)
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        # The previous step's MMA is done: its registers (kept alive through deps) and its slot are free.
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        fence_async_shared()  # (this step's words were read by ordinary loads; the slot's next fill is by TMA)
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        a_prev = a
        s0 = s1
        s1 = s2
        s2 = s3
    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
    return (acc,)  # (warp_specialize takes the default partition's results as a tuple)


@gluon.jit
def _wgmma_int4_kernel(x_desc, w_desc, s_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, k_per_split, n_splits, stride_sn, stride_om,
                       GROUP: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr,
                       DBG: gl.constexpr = 0):
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    k_lo = split * k_per_split
    n_steps = gl.cdiv(gl.minimum(k_lo + k_per_split, K) - k_lo, BK)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    results = gl.warp_specialize([
        (_mma_partition, (x_smem, w_smem, ready, empty, s_ptr, pid_n, k_lo, n_steps, N, stride_sn,
                          GROUP, BN, BM, BK, STAGES, num_warps, DBG)),
        (_load_partition, (x_desc, w_desc, x_smem, w_smem, ready, empty, pid_n, k_lo, n_steps, BN, BK, STAGES)),
    ], [1], [24])
    acc = results[0]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))

    # The tile leaves through shared memory into a layout with 4 consecutive n per thread: out and the partials
    # are [M, N] row-major, so n is the contiguous side of the transposed tile.
    io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[BN // 4, 128 // BN],
                                               warps_per_cta=[1, num_warps], order=[0, 1])
    acc = gl.convert_layout(acc, io_layout)
    ns = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, io_layout))
    ms = gl.arange(0, BM, layout=gl.SliceLayout(0, io_layout))
    mask = gl.expand_dims(ns < N, 1) & gl.expand_dims(ms < M, 0)
    out_offs = gl.expand_dims(ms * stride_om, 0) + gl.expand_dims(ns, 1)
    if SPLIT:
        # Partials in ws [n_splits, M, N] fp32 (int32 offsets: the host checks n_splits * M * N < 2**31).
        part_offs = gl.expand_dims(ms * N, 0) + gl.expand_dims(ns, 1)
        gl.store(ws_ptr + split * M * N + part_offs, acc, mask=mask)
        gl.thread_barrier()
        ticket = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            total = gl.zeros([BN, BM], gl.float32, io_layout)
            for t in range(n_splits):  # fixed order: the sum does not depend on arrival order
                total += gl.load(ws_ptr + t * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(out_ptr + out_offs, total.to(gl.bfloat16), mask=mask)
            gl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        gl.store(out_ptr + out_offs, acc.to(gl.bfloat16), mask=mask)

def wgmma_int4(x: Tensor, w: PackedWeight, out: Tensor, tickets, block_n: int = 128, block_k: int = 64,
               stages: int = 4, num_warps: int = 8, split: int = 0, maxnreg: int = 128, dbg: int = 0) -> Tensor:
    """out[M, N] = x[M, K] @ W^T for int4 W on bf16 x, M <= 128, K % block_k == 0."""
    m, k = x.shape
    bm = max(16, triton.next_power_of_2(m))
    n_tiles = triton.cdiv(w.n, block_n)
    if split == 0:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        split = max(1, min(k // block_k, (2 * sms) // n_tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    x_layout = gl.NVMMASharedLayout.get_default_for([bm, block_k], gl.bfloat16)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, block_k], x_layout)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k // 8], gl.int32)
    w_desc = TensorDescriptor(w.values, list(w.values.shape), list(w.values.stride()), [block_n, block_k // 8],
                              w_layout)
    ws = torch.empty((split, m, w.n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = tickets(n_tiles) if split > 1 else out
    _wgmma_int4_kernel[(n_tiles, split)](
        x_desc, w_desc, w.scale, out, ws, cnt, m, w.n, k, k_per_split, split, w.scale.stride(0), out.stride(0),
        GROUP=w.group, BN=block_n, BM=bm, BK=block_k, STAGES=stages, SPLIT=split > 1, num_warps=num_warps,
        maxnreg=maxnreg, DBG=dbg)
    return out
