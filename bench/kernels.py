"""Kernel benchmark on the GPU machine: fused low-precision GEMMs vs torch bf16 in the same run.

    python bench/kernels.py [--sections dense,moe,formats,sweep,midm] [--budget SECONDS]

Times are in microseconds: CUDA-graph replays behind an L2 flush for M <= 256 (graph_us; --l2-flush says how the
L2 is emptied), triton.testing.do_bench medians (L2 flushed before every call) above. Ratios are
bf16 time / kernel time, so > 1 means the kernel is faster. Weights are random and generated directly
in their packed form (never a bf16 copy); activations are random bf16. Layer shapes are those of
Qwen3-8B, Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3. Targets (issue 6): training (M >= 4096)
int4-g32 fwd+dX >= 0.9x bf16; decode (M <= 16) int4 >= 2.5x faster; MoE int4 fwd+dX >= 0.8x
torch._grouped_mm. int4 is stored as a model stores it on CUDA (int4-tiled; --int4-layout row-major for the
checkpoint's row-major layout). With $OUT set, the log and a JSON of every row are written there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.wgmma_int4_dx import supports_dx, wgmma_int4_dx
from triton.testing import do_bench

from orbit_lightning import kernels
from orbit_lightning.quant.dispatch import dequant_grouped, dequant_grouped_dx
from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.formats import INT4_LAYOUTS, get_format, int4_storage_name
from orbit_lightning.quant.grouped import ExpertGroups

M_SIZES = (1, 16, 64, 256, 4096, 16384)
DENSE = {  # model -> [(layer, N, K)]
    "Qwen3-8B": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
    "Qwen3-30B-A3B": [("qkv", 5120, 2048), ("o", 2048, 4096)],
    "Qwen3-235B-A22B": [("qkv", 9216, 4096), ("o", 4096, 8192)],
    "DeepSeek-V3": [("q_b", 24576, 1536), ("o", 7168, 16384), ("mlp.gate_up", 36864, 7168),
                    ("mlp.down", 7168, 18432)],
}
MOE = {  # model -> (experts, top_k, hidden, moe_intermediate, token counts)
    "Qwen3-30B-A3B": (128, 8, 2048, 768, (64, 8192, 16384, 32768)),
    "Qwen3-235B-A22B": (128, 8, 4096, 1536, (16384,)),
    "DeepSeek-V3": (256, 8, 7168, 2048, (16384,)),
}
GROUPED_MM = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


class Log:
    """say(line): print it and, with $OUT set, append it to $OUT/<name> (file: that file, or None)."""

    def __init__(self, name: str):
        out = os.environ.get("OUT")
        self.file = open(os.path.join(out, name), "w") if out else None

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def run_sweep(doc: str, script: str, say: Log, sections: dict, default: str) -> None:
    """A sweep script's command line: --budget (no section starts after it) and --sections (comma list of
    `sections`' names, each called with the deadline), logged through `say`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--budget", type=float, default=1e9, help="seconds; sections start nothing new after it")
    p.add_argument("--sections", default=default, help="comma list of " + ",".join(sections))
    args = p.parse_args()
    unknown = [name for name in args.sections.split(",") if name not in sections]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(sections)}")
    if not torch.cuda.is_available():
        sys.exit(f"bench/{script} needs a CUDA GPU")
    deadline, start = time.time() + args.budget, time.time()
    say(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    for name in args.sections.split(","):
        sections[name](deadline)
        say(f"({name} done at {time.time() - start:.0f} s)")


class Report:
    """Prints rows as they are measured and keeps them for the JSON dump."""

    def __init__(self, budget_s: float):
        self.rows: list[dict] = []
        self.deadline = time.time() + budget_s
        out = os.environ.get("OUT")
        self.out_dir = out if out else None
        self.say = Log("kernels_bench.log")

    def out_of_time(self) -> bool:
        return time.time() > self.deadline

    def add(self, row: dict, line: str) -> None:
        self.rows.append(row)
        self.say(line)

    def dump(self) -> None:
        if self.out_dir:
            with open(os.path.join(self.out_dir, "kernels_bench.json"), "w") as f:
                json.dump(self.rows, f, indent=1)


def us(fn, *args, **kwargs) -> float:
    """Median time of fn(*args, **kwargs) in microseconds (host launch cost hidden behind the L2 flush)."""
    return do_bench(partial(fn, *args, **kwargs), return_mode="median") * 1e3


_FLUSH: list[torch.Tensor] = []
# How graph_us empties the L2 before each call. "write" zeroes a 256 MiB buffer (do_bench's way): the L2 is then full
# of dirty lines, and the timed kernel pays for writing them back (up to the L2's 50 MB, ~12 us at copy bandwidth)
# while it reads. "read" reduces the buffer instead: the L2 holds clean lines, as in a decode step, where the kernel
# before a GEMV read weights and wrote a few activations. The write-back costs bf16 and int4 the same microseconds,
# so it inflates the ratio of the kernel that reads fewer bytes (int4 M <= 16: 1.96x bf16 geomean with "write", 1.73x
# with "read" in one run; bench/RESULTS.md, fourteenth session). "read" is the default since.
FLUSH_MODES = ("write", "read")
FLUSH_MODE = "read"


def _flush_l2() -> None:
    if FLUSH_MODE == "write":
        _FLUSH[0].zero_()
    else:
        _FLUSH[0].view(torch.int32).amax()


def graph_us(fn, *args, reps: int = 10, **kwargs) -> float:
    """GPU time of fn(*args, **kwargs) in microseconds with a cold L2 and no host launch cost, as under
    the engine's CUDA graphs: a graph of `reps` x (L2 flush, fn) minus a graph of `reps` flushes.
    For small M, where Python + launch overhead (tens of us) would otherwise be what do_bench measures."""
    f = partial(fn, *args, **kwargs)
    f()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    if not _FLUSH:
        _FLUSH.append(torch.ones(256 << 20, dtype=torch.int8, device="cuda"))
        _flush_l2()  # (the reduction's workspace is allocated outside the capture)
        torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                _flush_l2()
                if with_fn:
                    f()
        graphs.append(g)

    both, flush_only = replay_ms(graphs[0]), replay_ms(graphs[1])
    return max(both - flush_only, 0.0) * 1e3 / reps


def replay_ms(g: torch.cuda.CUDAGraph) -> float:
    """Median wall time of 7 replays of g, in milliseconds (CUDA events)."""
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[3]


def timer(m: int):
    """graph_us up to M = 1024 (the rollout's decode batches; do_bench's medians there scattered by up to 2x between
    runs, bench/RESULTS.md sixteenth session), do_bench above."""
    return graph_us if m <= 1024 else us


@triton.jit
def _read_kernel(words_ptr, n_words, word_programs, scales_ptr, n_scales, out_ptr, BLOCK: tl.constexpr):
    """Reads every packed word, then every scale (as int32 pairs), once: an xor per program, stored so that nothing
    is optimized away."""
    pid = tl.program_id(0)
    if pid < word_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        acc = tl.xor_sum(tl.load(words_ptr + offs, mask=offs < n_words, other=0), 0)
    else:
        offs = (pid - word_programs) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.xor_sum(tl.load(scales_ptr + offs, mask=offs < n_scales, other=0), 0)
    tl.store(out_ptr + pid, acc)


READ_BLOCK = 4096  # int32 per program: 16 KB


def read_packed(packed: dict, out: torch.Tensor) -> None:
    """One streaming read of an int4 weight's bytes (words and scales): the HBM floor, launch and ramp included, of
    any kernel that must read them, timed like the GEMMs. out: int32 of at least read_programs(packed) entries."""
    words, scales = packed["weight_packed"].view(-1), packed["weight_scale"].view(-1).view(torch.int32)
    word_programs = triton.cdiv(words.numel(), READ_BLOCK)
    _read_kernel[(read_programs(packed),)](words, words.numel(), word_programs, scales, scales.numel(), out,
                                            BLOCK=READ_BLOCK)


def read_programs(packed: dict) -> int:
    return (triton.cdiv(packed["weight_packed"].numel(), READ_BLOCK)
            + triton.cdiv(packed["weight_scale"].numel() // 2, READ_BLOCK))


# The dense and MoE sections' int4 weights: "int4" (row-major, compressed-tensors' layout), as the scripts that import
# this module pack theirs, or "int4-tiled" (the decode kernels' block layout, quant/formats/tiled.py), which a model
# stores on CUDA by default (model.int4_layout=auto) and so this script's own command measures (--int4-layout).
INT4_FORMAT = "int4"


def dq_linear(x: torch.Tensor, packed: dict) -> torch.Tensor:
    """Transient one-pass dequantization to bf16, then cuBLAS (the alternative to the fused kernel)."""
    return F.linear(x, kernels.dequantize(INT4_FORMAT, packed, x.dtype))


def dq_linear_dx(dy: torch.Tensor, packed: dict) -> torch.Tensor:
    return dy @ kernels.dequantize(INT4_FORMAT, packed, dy.dtype)


def wgmma_dx(dy: torch.Tensor, w) -> torch.Tensor:
    """The dX warpgroup-MMA kernel on a dense weight w (resolved; dispatch sends it only grouped experts): the
    candidate for dense dX at 65-1024 rows, which dequantizes today. Where `supports_dx(dy, w)`."""
    return wgmma_int4_dx(dy, w, torch.empty(dy.shape[0], w.k, dtype=dy.dtype, device=dy.device))


def invariant(fn, *args, **kwargs):
    with kernels.batch_invariant():
        return fn(*args, **kwargs)


def randn(*shape, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def packed_bytes(packed: dict) -> int:
    return sum(t.numel() * t.element_size() for t in packed.values())


def bench_dense(rep: Report) -> None:
    rep.say(f"\n== dense {INT4_FORMAT} (g32) vs bf16 F.linear (fwd) and dy @ W (dX); us; ratio = bf16 / int4 ==")
    rep.say("(M <= 1024: CUDA-graph timing with cold L2; dq+mm = one-pass dequantize + cuBLAS, M >= 256; "
            "read = one streaming read of the int4 bytes, ceil x = bf16 fwd / read: the ratio no kernel that reads "
            "them can pass, M <= 16)")
    rep.say(f"{'model':16} {'layer':12} {'N':>6} {'K':>6} {'M':>6} | {'bf16 fwd':>9} {'int4 fwd':>9} "
            f"{'x':>5} {'TB/s':>5} {'read':>5} {'ceil x':>6} | {'bf16 dX':>9} {'int4 dX':>9} {'fwd+dX x':>8} | "
            f"{'inv fwd':>9} {'inv cost':>8} | {'dq+mm x':>7}")
    fmt = get_format(INT4_FORMAT)
    fwd, dx = partial(kernels.dequant_linear, fmt=fmt), partial(kernels.dequant_linear_dx, fmt=fmt)
    for model, layers in DENSE.items():
        for layer, n, k in layers:
            w = randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            resolved = resolve(fmt, packed, stacked=False)
            read_us = graph_us(read_packed, packed, torch.empty(read_programs(packed), dtype=torch.int32,
                                                                 device="cuda"))
            for m in M_SIZES:
                if rep.out_of_time():
                    return
                x, dy = randn(m, k), randn(m, n)
                tm = timer(m)
                t = {"bf16_fwd": tm(F.linear, x, w), "int4_fwd": tm(fwd, x, packed=packed),
                     "bf16_dx": tm(torch.matmul, dy, w), "int4_dx": tm(dx, dy, packed=packed),
                     "inv_fwd": tm(invariant, fwd, x, packed=packed), "read": read_us}
                if 64 < m <= 1024 and supports_dx(dy, resolved):  # (checked, not launched, before timing)
                    t["wg_dx"] = tm(wgmma_dx, dy, resolved)
                dq = float("nan")
                if m >= 256:
                    t["dq_fwd"], t["dq_dx"] = tm(dq_linear, x, packed), tm(dq_linear_dx, dy, packed)
                    dq = (t["bf16_fwd"] + t["bf16_dx"]) / (t["dq_fwd"] + t["dq_dx"])
                moved = packed_bytes(packed) + 2 * m * (n + k)
                tbs = moved / t["int4_fwd"] / 1e6
                both = (t["bf16_fwd"] + t["bf16_dx"]) / (t["int4_fwd"] + t["int4_dx"])
                rep.add(dict(section="dense", model=model, layer=layer, n=n, k=k, m=m, **t, tbs=tbs),
                        f"{model:16} {layer:12} {n:6} {k:6} {m:6} | {t['bf16_fwd']:9.1f} "
                        f"{t['int4_fwd']:9.1f} {t['bf16_fwd'] / t['int4_fwd']:5.2f} {tbs:5.2f} {read_us:5.1f} "
                        f"{t['bf16_fwd'] / read_us:6.2f} | "
                        f"{t['bf16_dx']:9.1f} {t['int4_dx']:9.1f} {both:8.2f} | {t['inv_fwd']:9.1f} "
                        f"{t['inv_fwd'] / t['int4_fwd']:8.2f} | {dq:7.2f}"
                        + (f" | wgmma dX {t['wg_dx']:7.1f}" if "wg_dx" in t else ""))
            torch.cuda.empty_cache()


def _grouped_mm_dx_us(tm, dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> float:
    """Time of the faster valid torch grouped GEMM for dy @ W_e: W as stored [E, N, K], or K-major."""
    times = []
    for layout in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
        try:
            times.append(tm(GROUPED_MM, dy, layout, offs=offs))
        except RuntimeError:  # a layout this torch version does not take
            continue
    return min(times)


def planned(a, experts, proj: str, plan, dx: bool):
    """The model's chunked path for one projection on a plan of (first row, end row, ExpertGroups) chunks: each
    through `quant.dispatch.dequant_grouped` (dequantize the chunk's experts, grouped GEMM), as
    models.moe._chunked_mlp runs it."""
    fn = dequant_grouped_dx if dx else dequant_grouped
    return [fn(a[r0:r1], experts, proj, groups) for r0, r1, groups in plan]


def chunked(a, experts, proj: str, counts: list[int], chunk: int, dx: bool):
    """`planned` on the model's plan: the active experts of per-expert row `counts`, `chunk` at a time."""
    return planned(a, experts, proj, ExpertGroups.chunks(counts, chunk, a.device), dx)


def bench_moe(rep: Report) -> None:
    rep.say(f"\n== MoE grouped {INT4_FORMAT} (g32) vs bf16 torch grouped_mm (fwd: x @ W_e^T, dX: dy @ W_e); us ==")
    if GROUPED_MM is None:
        rep.say("torch has no _grouped_mm / grouped_mm: skipped")
        return
    rep.say("(dq+gmm = the model's chunked path: the active experts that fit 1 GiB dequantized to bf16, grouped_mm)")
    rep.say(f"{'model':16} {'proj':8} {'E':>4} {'N':>5} {'K':>5} {'tokens':>6} | {'gmm fwd':>9} "
            f"{'int4 fwd':>9} {'x':>5} | {'gmm dX':>9} {'int4 dX':>9} {'fwd+dX x':>8} | {'dq+gmm x':>8}")
    for model, (experts, top_k, hidden, inter, token_counts) in MOE.items():
        for proj, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            if rep.out_of_time():
                return
            w = randn(experts, n, k, scale=0.02)
            # Packed experts whose gate_proj is [E, n, k]: the projection measured, whichever it stands for.
            packed_experts = QuantExperts(experts, k, n, INT4_FORMAT, dtype=torch.bfloat16).cuda()
            packed_experts.random_init(torch.Generator("cuda").manual_seed(0))
            packed, per_chunk = packed_experts.packed("gate_proj"), packed_experts.experts_per_chunk()
            for tokens in token_counts:
                if rep.out_of_time():
                    return
                rows = tokens * top_k
                # Uniform routing: only the per-expert row counts matter to a grouped GEMM.
                counts = torch.bincount(torch.randint(experts, (rows,), device="cuda"), minlength=experts)
                ends = counts.cumsum(0).to(torch.int32)
                host_counts = counts.tolist()
                offsets = torch.cat([ends.new_zeros(1), ends])
                x, dy = randn(rows, k), randn(rows, n)
                tm = timer(tokens)
                t = {"gmm_fwd": tm(GROUPED_MM, x, w.transpose(1, 2), offs=ends),
                     "int4_fwd": tm(kernels.grouped_dequant_linear, x, offsets, packed_experts.fmt, packed),
                     "gmm_dx": _grouped_mm_dx_us(tm, dy, w, ends),
                     "int4_dx": tm(kernels.grouped_dequant_linear_dx, dy, offsets, packed_experts.fmt, packed),
                     "dq_fwd": tm(chunked, x, packed_experts, "gate_proj", host_counts, per_chunk, dx=False),
                     "dq_dx": tm(chunked, dy, packed_experts, "gate_proj", host_counts, per_chunk, dx=True)}
                dq = (t["gmm_fwd"] + t["gmm_dx"]) / (t["dq_fwd"] + t["dq_dx"])
                both = (t["gmm_fwd"] + t["gmm_dx"]) / (t["int4_fwd"] + t["int4_dx"])
                row = dict(section="moe", model=model, proj=proj, experts=experts, n=n, k=k, tokens=tokens)
                rep.add(row | t,
                        f"{model:16} {proj:8} {experts:4} {n:5} {k:5} {tokens:6} | {t['gmm_fwd']:9.1f} "
                        f"{t['int4_fwd']:9.1f} {t['gmm_fwd'] / t['int4_fwd']:5.2f} | {t['gmm_dx']:9.1f} "
                        f"{t['int4_dx']:9.1f} {both:8.2f} | {dq:8.2f}")
            torch.cuda.empty_cache()


def bench_formats(rep: Report) -> None:
    n, k = 24576, 4096  # Qwen3-8B gate_up
    rep.say(f"\n== other formats, fwd (and dX at M=4096), N={n} K={k}; ratio = bf16 / kernel ==")
    w = randn(n, k, scale=0.02)
    for name in ("int4-g128", "fp8", "mxfp4", "nvfp4"):
        packed = get_format(name).random_packed((n, k), device="cuda")
        for m in (1, 16, 4096):
            if rep.out_of_time():
                return
            x, dy = randn(m, k), randn(m, n)
            tm = timer(m)
            t = {"bf16_fwd": tm(F.linear, x, w), "fwd": tm(kernels.dequant_linear, x, name, packed)}
            line = f"{name:10} M={m:5} | bf16 {t['bf16_fwd']:9.1f} kernel {t['fwd']:9.1f} x "
            line += f"{t['bf16_fwd'] / t['fwd']:5.2f}"
            if m == 4096:
                t["bf16_dx"] = us(torch.matmul, dy, w)
                t["dx"] = us(kernels.dequant_linear_dx, dy, name, packed)
                line += f" | dX bf16 {t['bf16_dx']:9.1f} int {t['dx']:9.1f} x {t['bf16_dx'] / t['dx']:5.2f}"
            rep.add(dict(section="formats", fmt=name, n=n, k=k, m=m, **t), line)


def _sweep_candidates(m: int) -> list[kernels.TileConfig]:
    T = kernels.TileConfig  # (block_m, block_p, block_r, warps, stages, swap_ab, split_k; 0 = auto)
    if m <= 64:
        bm = 16 if m <= 16 else 64
        return [T(bm, 64, 128, 4, 4, True, 0), T(bm, 64, 256, 4, 4, True, 0), T(bm, 128, 128, 4, 4, True, 0),
                T(bm, 64, 128, 4, 6, True, 0), T(bm, 64, 128, 4, 4, True, 8), T(bm, 64, 128, 4, 4, False, 0),
                T(bm, 64, 128, 4, 4, True, 1), T(bm, 128, 128, 8, 4, True, 0)]
    if m <= 256:
        return [T(128, 128, 64, 8, 3, True), T(64, 64, 128, 4, 4, True), T(128, 64, 128, 4, 4, True),
                T(64, 128, 128, 4, 4, True), T(128, 128, 64, 8, 3, False)]
    return [T(256, 128, 64, 8, 3, True), T(256, 128, 64, 8, 3, False), T(128, 256, 64, 8, 3, False),
            T(128, 256, 64, 8, 3, True), T(128, 128, 64, 8, 3, True), T(256, 128, 64, 8, 4, True),
            T(256, 64, 64, 8, 3, True), T(128, 128, 64, 4, 4, True)]


def bench_sweep(rep: Report) -> None:
    rep.say("\n== tile sweep, int4-g32 bf16, us (cfg = BM BP BR warps stages swap split) ==")
    fmt = get_format("int4")
    for n, k, ms in ((24576, 4096, (1, 16, 64, 256, 4096)), (4096, 4096, (1, 16, 64)),
                     (4096, 12288, (1, 16, 64, 256, 4096))):
        packed = fmt.random_packed((n, k), device="cuda")
        for m in ms:
            for dx in (False, True):
                if rep.out_of_time():
                    return
                a = randn(m, n if dx else k)
                fn = kernels.int4_linear_dx if dx else kernels.int4_linear
                times = []
                for cfg in _sweep_candidates(m):
                    try:
                        times.append((timer(m)(fn, a, packed, config=cfg), cfg))
                    except Exception as e:  # a config may not fit shared memory / registers
                        rep.say(f"  cfg {cfg} failed: {type(e).__name__}")
                times.sort(key=lambda tc: tc[0])
                kernels.configs.FAST_INT4 = False  # the best config again, with the generic fp32 decoder
                try:
                    generic = timer(m)(fn, a, packed, config=times[0][1]) if times else float("nan")
                finally:
                    kernels.configs.FAST_INT4 = True
                desc = f"generic decoder {generic:8.1f} | " + "  ".join(
                    f"{t:8.1f}:{c.block_m},{c.block_p},{c.block_r},{c.num_warps},{c.num_stages},{int(c.swap_ab)},"
                    f"{c.split_k}" for t, c in times)
                rep.add(dict(section="sweep", n=n, k=k, m=m, dx=dx, generic=generic,
                             times=[(t, repr(c)) for t, c in times]),
                        f"{'dX ' if dx else 'fwd'} N={n:5} K={k:5} M={m:5} | {desc}")


def _midm_candidates(m: int, k: int) -> dict[str, kernels.TileConfig]:
    """Tile configs of the fused kernel for 64 <= M <= 256 (the RL rollout's decode batches): the leaders of a first,
    wider grid (bench/RESULTS.md), fewer than 4 warps (Triton then multiplies with mma.sync, the weight tile in
    registers and the activations from shared memory by ldmatrix: Marlin's structure), and unswapped tiles."""
    T = kernels.TileConfig
    bm = min(m, 128)
    grid = [(bm, 128, 128, 8, 4, True, 0), (64, 128, 256, 8, 3, True, 0), (64, 128, 128, 8, 4, True, 0),
            (64, 32, 128, 2, 4, True, 0), (64, 32, 256, 2, 3, True, 0), (64, 64, 128, 2, 4, True, 0),
            (64, 16, 256, 1, 4, True, 0), (64, 32, 128, 1, 4, True, 0), (64, 64, 256, 2, 3, True, 0),
            (64, 32, 128, 2, 4, True, 1), (64, 128, 128, 4, 4, False, 0), (64, 256, 64, 8, 3, False, 0),
            (bm, 128, 64, 8, 3, False, 0), (bm, 256, 64, 8, 3, False, 0)]  # fmt: skip
    out = {",".join(str(int(v) if isinstance(v, bool) else v) for v in c): T(*c) for c in grid}
    out["shipped"] = kernels.configs.pick_config("fwd", m, torch.device("cuda"), int4_r=k)
    return out


def bench_midm(rep: Report) -> None:
    """Fused int4 forward at the rollout's decode batches (M = 64 / 128 / 256) over a wider grid of tiles than the
    `sweep` section's, on every dense shape, against bf16 cuBLAS and one-pass dequantize + cuBLAS."""
    rep.say("\n== M = 64-256 tiles: int4-g32 fwd, graph_us (cold L2), x = bf16 / int4 ==")
    fmt = get_format("int4")
    ratios: dict[tuple[int, str], list[float]] = {}
    for model, layers in DENSE.items():
        for layer, n, k in layers:
            w = randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            for m in (64, 128, 256):
                if rep.out_of_time():
                    return
                x = randn(m, k)
                tm = timer(m)
                bf16 = tm(F.linear, x, w)
                ref = kernels.int4_linear(x, packed)  # (the dispatched path)
                times = {"dq+mm": tm(dq_linear, x, packed)}
                for name, cfg in _midm_candidates(m, k).items():
                    try:
                        y = kernels.int4_linear(x, packed, config=cfg)
                        if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2):
                            rep.say(f"  WRONG {name} {model}.{layer} M={m}")
                            continue
                        times[name] = tm(kernels.int4_linear, x, packed, config=cfg)
                    except Exception as e:  # a config may not fit shared memory / registers
                        rep.say(f"  cfg {name} failed: {type(e).__name__}")
                for name, t in times.items():
                    ratios.setdefault((m, name), []).append(bf16 / t)
                best = min(times, key=times.get)
                rep.add(dict(section="midm", model=model, layer=layer, n=n, k=k, m=m, bf16=bf16, times=times),
                        f"{model:16} {layer:12} {n:6} {k:6} {m:4} | bf16 {bf16:7.1f} shipped {times['shipped']:7.1f} "
                        f"({bf16 / times['shipped']:4.2f}x) dq+mm {times['dq+mm']:7.1f} | best {best:22} "
                        f"{times[best]:7.1f} ({bf16 / times[best]:4.2f}x)")  # fmt: skip
            torch.cuda.empty_cache()
    for m in (64, 128, 256):
        ranked = sorted(((geomean(v), min(v), name) for (mm, name), v in ratios.items()
                         if mm == m and len(v) == max(len(u) for (m2, _), u in ratios.items() if m2 == m)),
                        reverse=True)  # fmt: skip
        rep.say(f"-- M={m}: geomean (min) x over bf16, top 8: " + "; ".join(f"{n} {g:.2f} ({mn:.2f})"
                                                                            for g, mn, n in ranked[:8]))  # fmt: skip


def summary(rep: Report) -> None:
    def best(r, base: str, paths=("int4", "dq")) -> float:
        # What quant/dispatch.py picks per shape: the fused kernel or dequantize + cuBLAS / grouped GEMM.
        return max((r[f"{base}_fwd"] + r[f"{base}_dx"]) / (r[f"{p}_fwd"] + r[f"{p}_dx"]) for p in paths
                   if f"{p}_fwd" in r)

    dense = [r for r in rep.rows if r["section"] == "dense"]
    train = [best(r, "bf16") for r in dense if r["m"] >= 4096]
    decode = [r["bf16_fwd"] / r["int4_fwd"] for r in dense if r["m"] <= 16]
    ceiling = [r["bf16_fwd"] / r["read"] for r in dense if r["m"] <= 16]
    moe = [best(r, "gmm") for r in rep.rows if r["section"] == "moe" and r["tokens"] >= 8192]
    inv = [r["inv_fwd"] / r["int4_fwd"] for r in dense]
    rep.say("\n== summary (geomean / min over shapes) ==")
    for name, vals, target in (("training fwd+dX int4 / bf16 (M>=4096, dispatched)", train, ">= 0.9"),
                               ("decode fwd speedup (M<=16)", decode, ">= 2.5"),
                               ("decode ceiling: bf16 / one read of the int4 bytes", ceiling, "bound"),
                               ("MoE fwd+dX int4 / grouped_mm (>=8k tok, dispatched)", moe, ">= 0.8"),
                               ("batch-invariant fwd time / fast fwd time", inv, "cost")):
        if vals:
            rep.say(f"{name:46} geomean {geomean(vals):5.2f}  min {min(vals):5.2f}  max {max(vals):5.2f}  "
                    f"target {target}")


def main(argv=None) -> None:
    global FLUSH_MODE, M_SIZES, INT4_FORMAT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="dense,moe,formats", help="comma list of dense,moe,formats,sweep,midm")
    p.add_argument("--budget", type=float, default=1e9, help="start no new measurement after this many s")
    p.add_argument("--m", type=int, nargs="+", default=list(M_SIZES), help="the dense section's row counts")
    p.add_argument("--l2-flush", choices=FLUSH_MODES, default=FLUSH_MODE, help="graph_us's L2 flush (see FLUSH_MODE)")
    p.add_argument("--int4-layout", choices=INT4_LAYOUTS, default="auto",
                   help="the dense and MoE sections' int4 weights, as model.int4_layout: auto (what the framework "
                        "stores on CUDA: int4-tiled), row-major or tiled (INT4_FORMAT)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    FLUSH_MODE, M_SIZES = args.l2_flush, tuple(args.m)
    INT4_FORMAT = int4_storage_name("int4", args.int4_layout, torch.device("cuda"))
    torch.manual_seed(0)
    rep = Report(args.budget)
    rep.say(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} | L2 flush: {FLUSH_MODE}")
    sections = {"dense": bench_dense, "moe": bench_moe, "formats": bench_formats, "sweep": bench_sweep,
                "midm": bench_midm}
    for name in args.sections.split(","):
        sections[name](rep)
        rep.dump()
    summary(rep)
    if rep.out_of_time():
        rep.say("(budget exhausted: some rows were skipped)")


if __name__ == "__main__":
    main()
