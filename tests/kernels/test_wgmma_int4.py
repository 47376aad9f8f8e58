"""The warpgroup-MMA int4 GEMM (kernels/wgmma_int4.py): it compiles for sm_90 on any machine (Triton's interpreter
cannot run Gluon, and the compile is what checks its hand-built layouts: every layout step asserts itself trivial),
and on an H200 it meets the fp64 oracle's bf16 bound where dense_gemm sends 17-64 rows of int4 on bf16.

The bound is test_gpu.py's: one rounding of each decoded weight, fp32 accumulation and one rounding of the output,
each within 2^-9 relative; 2^-8 allowed.
"""

import functools
import sys

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import (
    assert_within,
    compile_report,
    gpu,
    matmul_bound,
    needs_sm90_compiler,
    random_weight,
)

_SCRIPT = r"""
import inspect, json, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from orbit_lightning.kernels import wgmma_int4 as wg

ptxas = get_ptxas(90)
ptxas = getattr(ptxas, "path", ptxas)
names = list(inspect.signature(wg._wgmma_int4_kernel.fn).parameters)
report = {}
for bm in (32, 64):
    for group in (32, 128):
        for split in (False, True):
            x = torch.empty(bm, 4096, dtype=torch.bfloat16)
            words = torch.empty(4096, 512, dtype=torch.int32)
            descs = {"x_desc": TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, wg.BLOCK_K],
                                                gl.NVMMASharedLayout.get_default_for([bm, wg.BLOCK_K], gl.bfloat16)),
                     "w_desc": TensorDescriptor(words, list(words.shape), list(words.stride()),
                                                [wg.BLOCK_N, wg.BLOCK_K // 8],
                                                gl.NVMMASharedLayout.get_default_for([wg.BLOCK_N, wg.BLOCK_K // 8],
                                                                                     gl.int32))}
            const = dict(GROUP=group, BN=wg.BLOCK_N, BM=bm, BK=wg.BLOCK_K, STAGES=wg.STAGES, SPLIT=split, num_warps=4)
            pointers = {"s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
            sig = {n: "constexpr" if n in const else mangle_type(descs[n]) if n in descs else pointers.get(n, "i32")
                   for n in names}
            # Triton's launch-time specializations (16-divisible pointers and sizes) shape the code; pass them.
            attrs = {(names.index(n),): [["tt.divisibility", 16]]
                     for n in ("s_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "stride_sn", "stride_om", "K", "N")}
            src = GluonASTSource(fn=wg._wgmma_int4_kernel, signature=sig, attrs=attrs,
                                 constexprs={(names.index(k),): v for k, v in const.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=4, maxnreg=wg.MAX_REGISTERS))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(compiled.asm["ptx"])
                f.flush()
                out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                     text=True, check=True).stderr
            ptx = compiled.asm["ptx"]
            report[f"bm{bm}-g{group}-split{int(split)}"] = {
                "registers": int(out.split("Used ")[1].split(" registers")[0]),
                "spills": out.count("0 bytes spill stores") != 1 or out.count("0 bytes spill loads") != 1,
                "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor")}
print(json.dumps(report))
"""


@functools.cache
def _report() -> dict:
    """The script's report (compiled once for this module's tests)."""
    return compile_report(_SCRIPT)


@needs_sm90_compiler
def test_compiles_for_sm90_with_trivial_layouts_and_no_spills():
    """Each shipped variant compiles (a layout step that is not trivial fails the compile), keeps within the register
    cap that gives two programs per SM, spills nothing, and multiplies with wgmma on TMA-loaded tiles."""
    report = _report()
    assert set(report) == {f"bm{bm}-g{g}-split{s}" for bm in (32, 64) for g in (32, 128) for s in (0, 1)}
    for name, r in report.items():
        assert not r["spills"], (name, r)
        assert r["registers"] <= kernels.wgmma_int4.MAX_REGISTERS, (name, r)
        # 128 of K per step is 8 k16 wgmmas; the loader's TMA loads: the words, and x in 128-byte swizzle boxes.
        assert r["wgmma"] == kernels.wgmma_int4.BLOCK_K // 16 and r["tma"] == 3, (name, r)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _spy(monkeypatch) -> list:
    """Record each launch of the wgmma kernel by dense_gemm."""
    gemm = sys.modules["orbit_lightning.kernels.gemm"]
    calls = []
    monkeypatch.setattr(gemm, "wgmma_int4", lambda x, *a, _f=gemm.wgmma_int4: calls.append(x.shape) or _f(x, *a))
    return calls


# (format, N, K, M): N not a multiple of the 64-row tile; K = 1056 ends in a part step (33 groups of 32); one split
# (N = 8192 fills the GPU) and many (N = 192, K = 12288); M at both ends of the range and between.
CASES = [("int4", 200, 1056, 17), ("int4", 8192, 1024, 64), ("int4", 192, 12288, 33), ("int4-g128", 320, 2048, 48),
         ("int4-g128", 4096, 4096, 64)]


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("fmt,n,k,m", CASES)
def test_against_fp64_where_dense_gemm_sends_it(fmt, n, k, m, monkeypatch):
    calls = _spy(monkeypatch)
    packed, w = random_weight(fmt, (n, k), seed=n + k, device="cuda")
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()
    ref = x.double() @ w.T
    y = kernels.dequant_linear(x, fmt, packed)
    assert calls == [(m, k)]
    assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))
    # The split partials are summed in a fixed order: a second launch is bit-identical.
    assert torch.equal(kernels.dequant_linear(x, fmt, packed), y)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
def test_other_rows_layouts_and_modes_keep_their_kernels(monkeypatch):
    """16 rows (the mma GEMV), 65 (the tile kernel), fp16 activations, rows off TMA's 16-byte alignment, the switch
    off and batch-invariant mode do not reach it, and still meet the bound."""
    calls = _spy(monkeypatch)
    packed, w = random_weight("int4", (256, 1024), seed=7, device="cuda")
    x = torch.randn(80, 1032, generator=torch.Generator("cuda").manual_seed(8), device="cuda").bfloat16()
    cases = [x[:16, :1024], x[:65, :1024], x[:32, :1024].half(), x[:32, 1:1025]]
    for xs in cases:
        ref = xs.double() @ w.T
        assert_within(kernels.dequant_linear(xs, "int4", packed), ref, matmul_bound(xs, w, ref, 2.0**-8))
    with kernels.batch_invariant():
        kernels.dequant_linear(x[:32, :1024], "int4", packed)
    monkeypatch.setattr(kernels.configs, "WGMMA_INT4", False)
    kernels.dequant_linear(x[:32, :1024], "int4", packed)
    assert calls == []
