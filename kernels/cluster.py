"""Thread-block clusters for single-CTA Gluon kernels (sm_90): a launch as clusters, a cluster barrier, and reads of
a peer CTA's shared memory (distributed shared memory, DSMEM).

Why not Triton's own clusters: Triton makes a cluster of num_ctas CTAs one program, whose every tensor and
shared-memory layout is split or broadcast over the CTAs (CGA layouts). wgmma_int4's layouts are built by hand for
one CTA, and its K splits want the opposite: independent programs that only meet to sum. So the kernel is compiled
for one CTA and *launched* as clusters: Triton's launcher makes the grid `grid[0] * num_ctas` CTAs wide in clusters
of num_ctas along x, from the compiled kernel's packed launch metadata (num_warps, num_ctas, shared bytes; the same
in triton 3.6 and 3.9), which `clustered` sets from a constexpr of the kernel. Program ids are then plain CTA ids,
and CTAs x = c * size .. c * size + size - 1 form cluster c (CTA rank = x % size).

The PTX helpers address the kernel's dynamic shared memory from its base, the `global_smem` symbol Triton declares.
They do not know Triton's allocation, so a caller may use them only where every buffer it allocated is dead (after
its main loop, its TMA loads all consumed and its barriers invalidated).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MAX_SIZE = 8  # the largest portable cluster


def clustered(jit_fn, size_arg: str):
    """Make `jit_fn` (a Gluon kernel) launch each compiled binary as clusters of its constexpr `size_arg` CTAs
    (1: a plain launch), by wrapping the JIT's compile so that it sets the binary's launch metadata. (The JIT takes
    its compile function when it first meets a device, in the factory of its per-device caches: wrap it there.)"""
    index = jit_fn.arg_names.index(size_arg)
    make_caches = jit_fn.device_caches.default_factory

    def compile_clustered(compile_fn):
        def compile(src, *args, **kwargs):
            kernel = compile_fn(src, *args, **kwargs)
            return launch_as_clusters(kernel, int(src.constants.get((index,), 1)))

        compile.clustered = True
        return compile

    def make_clustered_caches():
        caches = make_caches()
        if not getattr(jit_fn.compile, "clustered", False):
            jit_fn.compile = compile_clustered(jit_fn.compile)
        return caches

    jit_fn.device_caches.default_factory = make_clustered_caches
    return jit_fn


def launch_as_clusters(kernel, size: int):
    """Set a compiled one-CTA kernel's launch metadata so that Triton's launcher runs it as clusters of `size` CTAs
    along x (grid[0] x size CTAs); returns the kernel."""
    if size > 1:
        num_warps, num_ctas, shared = kernel.packed_metadata  # (fails loudly if Triton's format changes)
        if num_ctas != 1 or size > MAX_SIZE:
            raise ValueError(f"{kernel.name}: clusters of {size} CTAs of a kernel compiled for {num_ctas} (one CTA, "
                             f"and at most {MAX_SIZE} per cluster)")
        kernel.packed_metadata = (num_warps, size, shared)
    return kernel


_ARRIVE = gl.constexpr("barrier.cluster.arrive.release.aligned;\nmov.b32 $0, 0;")
_WAIT = gl.constexpr("barrier.cluster.wait.acquire.aligned;\nmov.b32 $0, 0;")
# A 32-bit value to this CTA's shared memory at byte offset $1 from the dynamic base, and one from peer CTA $2's.
_STORE = gl.constexpr("{\n.reg .u32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $1;\nst.shared.f32 [a], $2;\n"
                      "mov.b32 $0, 0;\n}")
_LOAD_PEER = gl.constexpr("{\n.reg .u32 a, b;\nmov.u32 a, global_smem;\nadd.u32 a, a, $1;\n"
                          "mapa.shared::cluster.u32 b, a, $2;\nld.shared::cluster.f32 $0, [b];\n}")


@gluon.jit
def arrive():
    """barrier.cluster arrive (release: this thread's earlier shared-memory writes are visible to the cluster's
    threads after their wait). Every thread of every CTA in the cluster must arrive: no warp specialization."""
    gl.inline_asm_elementwise(_ARRIVE, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait():
    """barrier.cluster wait (acquire) for the arrival of every thread of the cluster."""
    gl.inline_asm_elementwise(_WAIT, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def store_local(values, offsets):
    """Each fp32 element of `values` to this CTA's shared memory at byte `offsets` (int32, the same layout) from
    the dynamic base."""
    gl.inline_asm_elementwise(_STORE, "=r,r,f", [offsets, values], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_peer(offsets, peer):
    """fp32 values from CTA rank `peer`'s shared memory at byte `offsets` from its dynamic base (after a cluster
    barrier that orders its writes before these reads)."""
    return gl.inline_asm_elementwise(_LOAD_PEER, "=f,r,r", [offsets, offsets * 0 + peer], dtype=gl.float32,
                                     is_pure=False, pack=1)
