"""A thread-private shared-memory ring for the mma GEMV's weights (GemvConfig.mma_ring = S stages): cp.async copies
run S - 1 steps ahead of the products, and the bytes in flight cost no registers (gemv_mma.py's own loop holds one
step ahead in registers).

One inline-asm statement per loop trip holds the ring, declared inside the statement (ptxas accepts a .shared array
in a nested block; one statement, one array, so the loop must keep exactly one copy of it). Trip j issues step j's
copies into slot j % S, waits for step j - S + 1's (cp.async.wait_group S - 1: a thread waits for its own copies,
so no barrier), and reads that step back from slot (j + 1) % S into the registers gemv_mma._load_w_rows fills. A
thread reads back only what it copied. The scales travel as the aligned 4-byte pair that holds the lane's (cp.async
copies 4, 8 or 16 bytes; with groups of 32 its half is the same every step) and a prmt picks the half. Static shared
memory caps a program's ring, with the kernel's own, at 48 KB (configs.RING_LIMIT).

Under Triton's interpreter gemv_mma.ring_mainloop loads the step a trip reads straight from global memory instead.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .configs import slot_bytes


def ring_asm(u: int, stages: int, threads: int, hint: str) -> str:
    """PTX of one trip: outputs per tile t as _load_w_rows' (4 words of row g, 4 of row g + 8, their 2 bf16 scales);
    inputs: this trip's word addresses of rows g, g + 8, its scale-pair addresses, whether to issue, the write and read
    slots' byte offsets, and the lane's prmt selector of its scale's half."""
    out = 10 * u
    wa, wb, sa, sb, issue, wofs, rofs, sel = (f"${out + i}" for i in range(8))
    slot = slot_bytes(u)
    lines = ["{", f".shared .align 16 .b8 ring[{threads * stages * slot}];", ".reg .pred p;",
             ".reg .u32 base, w, r, v;", ".reg .b16 hi;", "mov.u32 base, %tid.x;",
             f"mul.lo.u32 base, base, {stages * slot};", "mov.u32 w, ring;", "add.u32 base, base, w;",
             f"add.u32 w, base, {wofs};", f"add.u32 r, base, {rofs};", f"setp.ne.b32 p, {issue}, 0;"]  # fmt: skip
    for t in range(u):
        lines += [f"@p cp.async.cg.shared.global{hint} [w + {32 * t}], [{wa} + {64 * t}], 16;",
                  f"@p cp.async.cg.shared.global{hint} [w + {32 * t + 16}], [{wb} + {64 * t}], 16;",
                  f"@p cp.async.ca.shared.global [w + {32 * u + 8 * t}], [{sa} + {8 * t}], 4;",
                  f"@p cp.async.ca.shared.global [w + {32 * u + 8 * t + 4}], [{sb} + {8 * t}], 4;"]  # fmt: skip
    lines += ["cp.async.commit_group;", f"cp.async.wait_group {stages - 1};"]
    for t in range(u):
        o = 10 * t
        lines += [f"ld.shared.v4.u32 {{${o}, ${o + 1}, ${o + 2}, ${o + 3}}}, [r + {32 * t}];",
                  f"ld.shared.v4.u32 {{${o + 4}, ${o + 5}, ${o + 6}, ${o + 7}}}, [r + {32 * t + 16}];"]  # fmt: skip
        for i in range(2):
            lines += [f"ld.shared.b32 v, [r + {32 * u + 8 * t + 4 * i}];", f"prmt.b32 v, v, 0, {sel};",
                      f"mov.b32 {{${o + 8 + i}, hi}}, v;"]  # fmt: skip
    lines.append("}")
    return "\n".join(lines)


@triton.jit
def _regroup(v, U: tl.constexpr):
    """The asm's 10 U registers as U tuples of _load_w_rows' 10."""
    out = ()
    for t in tl.static_range(U):
        out = out + ((v[10 * t], v[10 * t + 1], v[10 * t + 2], v[10 * t + 3], v[10 * t + 4], v[10 * t + 5],
                      v[10 * t + 6], v[10 * t + 7], v[10 * t + 8], v[10 * t + 9]),)  # fmt: skip
    return out


@triton.jit
def ring_trip(wa, sa, issue, j, sel, STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr, U: tl.constexpr,
              S: tl.constexpr, SLOT: tl.constexpr, TEXT: tl.constexpr):  # fmt: skip
    """Trip j: issue the step at word / scale-pair addresses wa / sa (if issue), and return the U tiles of the step
    S - 1 before it (_load_w_rows' registers per tile). Compiled code only: under the interpreter
    gemv_mma.ring_mainloop reads that step straight from global memory."""
    v = tl.inline_asm_elementwise(
        TEXT, ("=r," * 8 + "=h,=h,") * U + "l,l,l,l,r,r,r,r",
        [wa, wa + 8 * 4 * STRIDE_W, sa, sa + 8 * 2 * STRIDE_S, issue, (j % S) * SLOT, ((j + 1) % S) * SLOT, sel],
        dtype=((tl.int32,) * 8 + (tl.bfloat16,) * 2) * U, is_pure=False, pack=1)  # fmt: skip
    return _regroup(v, U)


@functools.cache  # (per launch on the decode path: built once per config)
def ring_text(u: int, stages: int, threads: int, l2_prefetch: int) -> str:
    """ring_asm for a launch (the L2 prefetch hint as GemvConfig.l2_prefetch gives it)."""
    return ring_asm(u, stages, threads, f".L2::{l2_prefetch}B" if l2_prefetch else "")

