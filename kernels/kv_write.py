"""Writing a forward's new keys and values into the paged cache: one launch for both (two index_copy_ otherwise).

At decode a layer's write is a few kilobytes, so its cost is the launch; a batch-1 Qwen3-8B step issued 16 of
them. The values are copied, converted to the cache dtype with round-to-nearest as `Tensor.to` does.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_cs, stride_ch, stride_ds, stride_dh, DK: tl.constexpr, DV: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Token n, kv head h: k[n, h] -> k_cache[slot[n], h] and v[n, h] -> v_cache[slot[n], h]."""
    wait_for_producers(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + dk, mask=dk < DK)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + dv, mask=dv < DV)
    tl.store(kc_ptr + slot * stride_cs + h * stride_ch + dk, k.to(kc_ptr.dtype.element_ty), mask=dk < DK)
    tl.store(vc_ptr + slot * stride_ds + h * stride_dh + dv, v.to(vc_ptr.dtype.element_ty), mask=dv < DV)


def kv_write(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """k_cache [S, Hkv, dk], v_cache [S, Hkv, dv] (one layer, slots flattened); slots [N] int; k [N, Hkv, dk],
    v [N, Hkv, dv] with unit stride along the head dim. In place."""
    n, hkv, dk = k.shape
    dv = v.shape[-1]
    if v.shape[:2] != (n, hkv) or k_cache.shape[1:] != (hkv, dk) or v_cache.shape[1:] != (hkv, dv):
        raise ValueError(f"kv_write: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")  # fmt: skip
    if slots.shape != (n,):
        raise ValueError(f"kv_write: slots must be [{n}], got {tuple(slots.shape)}")
    if min(k.stride(-1), v.stride(-1), k_cache.stride(-1), v_cache.stride(-1)) != 1:
        raise ValueError("kv_write needs a unit stride along the head dim")
    if n == 0 or hkv == 0:
        return
    pdl = use_pdl(k.device)
    _kv_write_kernel[(n, hkv)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv), PDL=pdl, launch_pdl=pdl,
        num_warps=1,
    )  # fmt: skip
